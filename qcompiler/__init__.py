"""qcompiler: post-training quantization of transformer models as torch.fx graph passes."""
from __future__ import annotations

from . import ops  # registers the qc:: operator library
from .capture import capture
from .compiler import CompiledModel, compile, load
from .errors import (BackendError, CalibrationError, CaptureError, GraphLintError, PassError,
                     PipelineError, QCompilerError, QuantizationError, RecipeError)
from .pass_base import GraphProperty, Pass, PassContext, PassRecord, PassResult
from .pass_contract import run_checked as run_pass
from .pass_manager import PassManager
from .recipes import Recipe, get_recipe, list_recipes, register_recipe
from .report import Report
from .weight_quantizer import WeightQuantizer

from . import passes  # noqa: E402  (qcompiler.passes, mapped from the top-level passes/ folder)

from .version import __version__  # noqa: E402

__all__ = ["__version__", "capture", "compile", "load", "CompiledModel", "Pass", "PassContext", "PassRecord",
           "PassResult", "GraphProperty", "PassManager", "run_pass", "WeightQuantizer", "Recipe", "get_recipe",
           "list_recipes", "register_recipe", "Report", "passes", "ops", "QCompilerError", "CaptureError",
           "PipelineError", "PassError", "GraphLintError", "RecipeError", "BackendError", "CalibrationError",
           "QuantizationError"]
