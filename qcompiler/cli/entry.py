"""The command line's entry point: every failure one line on stderr and an exit code (2: the
command line or an input it names is wrong; 1: the system failed or an internal error; 130:
interrupted), library chatter the user can do nothing about filtered."""

from __future__ import annotations

import logging
import os
import sys
import warnings

import typer

from qcompiler.cli.common import ARGV, app, err

# Library warnings about qcompiler's own calls, not the user's model, kept off the terminal by the
# command-line entry points (the Python API leaves logging to its caller); a warning that could
# matter to a user (weights not found in a checkpoint, a tokenizer mismatch) is never filtered.
# (logger name, text the message starts with): the graph takes the KV cache as ``past_key_values``,
# the name every transformers 5.x release accepts; the newest ones prefer ``cache`` and say so per call.
_LOG_MESSAGES = (("transformers.utils.generic", "`past_key_values`/`cache_params` are deprecated"),)


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_library_warnings() -> None:
    """Install the filters (idempotent): each drops a message a user can do nothing about."""
    for name, prefix in _LOG_MESSAGES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages((prefix,)))
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)  # torch.export internals


def _os_message(e: OSError) -> str:
    where = f": {e.filename}" if e.filename else ""
    return f"{e.strerror or e}{where}" if e.strerror else str(e)


def main(argv=None) -> int:
    """Console-script entry point. Every failure is one line on stderr, no traceback unless --debug:
    exit 2 when the command line or an input it names is wrong, 1 when the system failed (disk
    full, permissions) or qcompiler hit an internal error, 130 when interrupted (Ctrl-C; outputs
    are published atomically, so nothing half-written stays behind)."""
    from typer._click import exceptions as click_errors  # typer vendors its own click

    from qcompiler.errors import QCompilerError

    quiet_library_warnings()
    args = list(sys.argv[1:] if argv is None else argv)
    ARGV[:] = args  # what --nproc starts each rank with
    debug = "--debug" in args
    if debug:  # accepted anywhere on the line, as the guide's "add --debug" means
        args = ["--debug", *(a for a in args if a != "--debug")]
    if not [a for a in args if a != "--debug"]:
        args = ["--help"]

    rank = int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0

    def fail(message: str, code: int, *, same_on_every_rank: bool = False) -> int:
        if rank and same_on_every_rank:
            return code  # rank 0 prints the same line
        message = " ".join(line.strip() for line in str(message).splitlines() if line.strip())
        message = f"rank {rank}: {message}" if rank else message
        err.print(f"error: {message}", soft_wrap=True)
        return code

    try:
        code = app(args=args, prog_name="qcompiler", standalone_mode=False)
        if code == 130:  # typer turns Ctrl-C into an exit code in non-standalone mode
            raise KeyboardInterrupt
        if isinstance(code, int) and code:  # typer.Exit(code) is returned, not raised, here
            return code
    except (KeyboardInterrupt, typer.Abort):
        if debug:
            raise
        return fail("interrupted; no partial output was left", 130)
    except click_errors.UsageError as e:
        where = e.ctx.command_path if e.ctx is not None else "qcompiler"  # the command's own help
        return fail(f"{e.format_message()} (see '{where} --help')", 2)
    except typer.Exit as e:
        return e.exit_code
    except click_errors.ClickException as e:
        return fail(e.format_message(), 2)
    except (QCompilerError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
        if debug:
            raise
        return fail(str(e), 2, same_on_every_rank=True)
    except OSError as e:
        if debug:
            raise
        return fail(_os_message(e), 1)
    except Exception as e:  # a bug: still one line, with the way to see more
        if debug:
            raise
        return fail(f"internal error: {type(e).__name__}: {e} (run with --debug for the traceback)", 1)
    return 0
