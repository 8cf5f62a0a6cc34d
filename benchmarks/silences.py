"""The longest stretch without output in each command a user runs first, timed line by line.

    python benchmarks/silences.py                              (~2 min: the bundled tinylm)
    python benchmarks/silences.py --model gemma-3-270m --update   (the cached Gemma-3 270M folder)

Each command runs as the user would run it (``python -m qcompiler ...``, output piped, unbuffered);
every line of its merged stdout/stderr is stamped on arrival, and the longest gap — from the start
to the first line, between lines, or from the last line to the exit — is reported with the line it
followed. A wall-clock figure, so a benchmark and not a test (no test asserts wall time): the target
from the first-run issue is no gap over 5 s on 2 idle cores. Writes benchmarks/results/silences.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_file import merged_rows, write_rows

from qcompiler.store.escaping import printable


def stamped_run(argv: list[str], cwd: Path) -> tuple[int, list[tuple[float, str]], float]:
    """``(exit code, [(seconds since start, line)], total seconds)`` of ``python -m qcompiler argv``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "qcompiler", *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    lines = [(time.monotonic() - start, line.rstrip("\n")) for line in proc.stdout]
    code = proc.wait()
    return code, lines, time.monotonic() - start


def longest_gap(lines: list[tuple[float, str]], total: float) -> tuple[float, str]:
    """The longest stretch without a line, and the line it followed ("(start)" before the first)."""
    marks = [(0.0, "(start)"), *lines, (total, "(exit)")]
    gap, after = max((b[0] - a[0], a[1]) for a, b in zip(marks, marks[1:]))
    return gap, after


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bundled:tinylm", help="bundled:NAME, a folder, or gemma-3-270m (the cache)")
    ap.add_argument("--recipe", default="gptq-w4g128")
    ap.add_argument(
        "--commands", nargs="*", default=None, help="only these (quantize always runs: the others read its artifact)"
    )
    ap.add_argument("--update", action="store_true", help="merge these rows into the committed file")
    args = ap.parse_args()
    model = args.model
    if model == "gemma-3-270m":
        from qcompiler.models.gemma3_270m import gemma3_270m_dir

        model = str(gemma3_270m_dir())
    rows = []
    with tempfile.TemporaryDirectory(prefix="qcompiler-silences-") as tmp:
        work = Path(tmp)
        out = work / "artifact"
        commands = [
            ("quantize", ["quantize", model, "--recipe", args.recipe, "--out", str(out)]),
            ("eval", ["eval", str(out)]),
            ("export onnx", ["export", str(out), "--format", "onnx", "--out", str(work / "model.onnx")]),
            ("generate", ["generate", str(out), "--prompt", "def main(", "--max-new-tokens", "32"]),
        ]
        for label, argv in commands:
            if args.commands is not None and label not in args.commands and label != "quantize":
                continue
            code, lines, total = stamped_run(argv, work)
            if code != 0:
                tail = printable("\n".join(line for _t, line in lines[-5:]))
                raise SystemExit(f"{label} failed with exit code {code}:\n{tail}")
            gap, after = longest_gap(lines, total)
            rows.append(
                dict(
                    model=args.model,
                    command=label,
                    seconds=round(total, 2),
                    lines=len(lines),
                    longest_gap_seconds=round(gap, 2),
                    gap_after=printable(after.replace(str(work), "<tmp>"))[:120],
                )
            )
            print(
                f"{label:12s} {total:7.1f} s  {len(lines):4d} lines  longest gap {gap:5.1f} s after: {rows[-1]['gap_after']}"
            )
    if args.update:
        rows = merged_rows("silences", rows, key=("model", "command"))
    print("wrote", write_rows("silences", rows))


if __name__ == "__main__":
    main()
