"""What every ``qcompiler`` command shares: the typer app, the two consoles (results on stdout,
progress on stderr, control characters escaped), the registries' choices, progress helpers, and
reading an artifact's source model."""

from __future__ import annotations

import time
from enum import Enum
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from qcompiler.backends import available_backends
from qcompiler.export_formats import export_format_names
from qcompiler.interop.gguf_export import REQUANTIZE_TYPES
from qcompiler.store.escaping import printable

ARGV: list[str] = []  # the command line main() runs (each rank of --nproc gets it again)

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="The ``qcompiler`` command line: quantize, save, evaluate, inspect, export and report.",
)


class _PlainConsole(Console):
    """Rich output without markup or highlighting (a ``[`` in a path is text), control characters escaped."""

    def print(self, *objects, **kwargs):
        super().print(*(printable(o) if isinstance(o, str) else o for o in objects), **kwargs)


out = _PlainConsole(markup=False, highlight=False, soft_wrap=True)
err = _PlainConsole(stderr=True, markup=False, highlight=False, soft_wrap=True)


def _choices(name: str, names: list[str]) -> type[Enum]:
    """A typer choice type from a registry's names (the registries are the one list of choices)."""
    return Enum(name, {n: n for n in names}, type=str)


ExportFormat = _choices("ExportFormat", export_format_names())
Backend = _choices("Backend", available_backends())
Packing = _choices("Packing", ["windows", "none"])
ZeroFormat = _choices("ZeroFormat", ["auto", "v1", "v2"])
RequantizeType = _choices("RequantizeType", list(REQUANTIZE_TYPES))


def _show_version(value: bool) -> None:
    if value:
        from qcompiler.version import __version__

        out.print(f"qcompiler {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    debug: bool = typer.Option(False, "--debug", help="show tracebacks (also after the command's name)"),
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_show_version, help="print the version"),
):
    """(--debug is read by main() wherever it stands, which decides how errors are shown.)"""


def artifact_source(target: str, needed_for: str) -> tuple[bool, str]:
    """``(is_artifact, model source)``: an artifact names the model it was made from."""
    from qcompiler.store.artifact import MANIFEST, read_manifest

    path = Path(target)
    if not (path / MANIFEST).is_file():
        return False, target
    source = read_manifest(path)["metadata"].get("source")
    if not source:
        raise ValueError(f"artifact {path} does not record its source model; {needed_for}")
    return True, source


def layer_table(report, title: str) -> Table:
    """The per-layer figures of ``report`` as a table, every cell escaped (names come from files)."""
    table = Table(title=title)
    rows = report.layer_table()
    keys = [
        k
        for k in ("bits", "bits_per_weight", "rel_error", "outlier_fraction", "kernel", "seconds")
        if any(k in r for r in rows)
    ]
    for column in ["pass", "layer", *keys]:
        table.add_column(column)
    for r in rows:
        cells = [r["pass"], r["layer"], *[fmt_cell(r.get(k, "")) for k in keys]]
        table.add_row(*(printable(str(c), newlines=False) for c in cells))
    return table


def fmt_cell(value) -> str:
    """A float to 4 significant digits, anything else as it prints."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def say(message: str) -> None:
    """A progress line on stderr, as the passes print theirs (stdout keeps the results)."""
    err.print(f"[qcompiler] {message}")


def counter(label: str, unit: str, every: float = 2.0):
    """``report(done, total)`` printing ``label: done/total unit`` at most every ``every`` seconds,
    and always at the end: a long loop is never silent, and never floods the terminal."""
    last = [time.monotonic()]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if done >= total or now - last[0] >= every:
            last[0] = now
            say(f"{label}: {done}/{total} {unit}")

    return report


def triton_runtime() -> None:
    """Without a GPU, Triton kernels run only in the interpreter, which must be chosen before import."""
    import os

    import torch

    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "1"
        err.print("no CUDA GPU: running the Triton kernels under TRITON_INTERPRET=1 (slow; for correctness)")
