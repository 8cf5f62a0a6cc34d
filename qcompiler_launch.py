"""The ``qcompiler`` command's first lines, outside the package: importing ``qcompiler`` imports
torch (seconds), and a Ctrl-C in those seconds must end like one anywhere later — one line and exit
130 — not in Python's 30-line traceback. The package's own ``cli.main`` handles everything after."""

import sys


def main() -> int:
    """Import the command line, then run it; Ctrl-C during the import is one line and 130."""
    try:
        from qcompiler.cli import main as command_line
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted; no partial output was left\n")
        return 130
    return command_line()


if __name__ == "__main__":
    sys.exit(main())
