"""qcompiler: post-training quantization of transformer models as torch.fx graph passes."""

from __future__ import annotations

import importlib
import sys

from qcompiler import (
    layouts,  # registers the storage layouts and their qc:: ops
    passes,  # qcompiler.passes, mapped from the top-level passes/ folder
)
from qcompiler.checkpoint_import import import_gptq
from qcompiler.compile_options import CompileOptions
from qcompiler.compiler import CompiledModel, compile, load
from qcompiler.errors import (
    BackendError,
    CalibrationError,
    CaptureError,
    GraphLintError,
    PassError,
    PipelineError,
    QCompilerError,
    QuantizationError,
    RecipeError,
)
from qcompiler.frontend.capture import capture
from qcompiler.ir import ops  # registers the layout-free qc:: ops
from qcompiler.pipeline.pass_base import GraphProperty, Pass, PassContext, PassRecord, PassResult
from qcompiler.pipeline.pass_contract import run_checked as run_pass
from qcompiler.pipeline.pass_manager import PassManager
from qcompiler.pipeline.recipes import Recipe, get_recipe, list_recipes, register_recipe
from qcompiler.pipeline.report import Report
from qcompiler.pipeline.weight_quantizer import WeightQuantizer
from qcompiler.version import __version__

__all__ = [
    "__version__",
    "capture",
    "compile",
    "load",
    "import_gptq",
    "CompiledModel",
    "CompileOptions",
    "Pass",
    "PassContext",
    "PassRecord",
    "PassResult",
    "GraphProperty",
    "PassManager",
    "run_pass",
    "WeightQuantizer",
    "Recipe",
    "get_recipe",
    "list_recipes",
    "register_recipe",
    "Report",
    "passes",
    "layouts",
    "ops",
    "QCompilerError",
    "CaptureError",
    "PipelineError",
    "PassError",
    "GraphLintError",
    "RecipeError",
    "BackendError",
    "CalibrationError",
    "QuantizationError",
]

# Import paths from before qcompiler/ was grouped into rooms, kept for user passes and scripts: the old
# name is the same module object as the new one (so a monkeypatch through either is seen by both).
MOVED_MODULES = {
    "graph": "qcompiler.ir.graph",
    "op_registry": "qcompiler.ir.op_registry",
    "ops": "qcompiler.ir.ops",
    "weight_only": "qcompiler.pipeline.block_walk",
    "folding": "qcompiler.pipeline.folding",
    "weight_quantizer": "qcompiler.pipeline.weight_quantizer",
    "pass_base": "qcompiler.pipeline.pass_base",
}
for _old, _new in MOVED_MODULES.items():
    sys.modules[f"{__name__}.{_old}"] = globals()[_old] = importlib.import_module(_new)
del _old, _new
