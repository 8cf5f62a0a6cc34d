"""The ``qcompiler`` command line: quantize, save, evaluate, inspect, export and report.

    qcompiler quantize bundled:tinylm --recipe gptq-w4g128 --out out/tinylm-w4
    qcompiler eval out/tinylm-w4
    qcompiler export out/tinylm-w4 --format onnx --out tinylm.onnx
    qcompiler inspect out/tinylm-w4
    qcompiler report out/tinylm-w4 --out out/report
    qcompiler recipes

Errors are one line on stderr (exit 2: bad arguments or inputs; 1: system or internal error;
130: interrupted); ``--debug`` shows the traceback.
"""

from __future__ import annotations

from qcompiler.cli import evaluate, export, generate, info, quantize
from qcompiler.cli.common import app
from qcompiler.cli.entry import main, quiet_library_warnings

# the commands, in the order --help lists them (one module each)
app.command()(quantize.quantize)
app.command(name="eval")(evaluate.evaluate)
app.command()(export.export)
app.command()(generate.generate)
app.command()(info.inspect)
app.command()(info.recipes)
app.command()(info.report)

__all__ = ["app", "main", "quiet_library_warnings"]
