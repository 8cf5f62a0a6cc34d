"""Typed errors: each names what went wrong and where (pass, node, layer, value)."""

from __future__ import annotations

__all__ = [
    "QCompilerError",
    "CaptureError",
    "PipelineError",
    "PassError",
    "GraphLintError",
    "RecipeError",
    "BackendError",
    "CalibrationError",
    "QuantizationError",
    "ArtifactError",
    "ExportError",
    "DistributedError",
]


class QCompilerError(Exception):
    """Base class of every error qcompiler raises on purpose."""


class CaptureError(QCompilerError):
    """The model could not be captured into a graph (the message says which construct and a fix)."""


class PipelineError(QCompilerError, ValueError):
    """The list of passes cannot run as given (checked before anything runs)."""


class PassError(QCompilerError):
    """A pass raised while running; the message names it and the passes that ran before it."""


class GraphLintError(QCompilerError):
    """A pass left an invalid graph; the message names the pass and the broken node."""


class RecipeError(QCompilerError, ValueError):
    """Unknown recipe name or malformed recipe."""


class BackendError(QCompilerError, ValueError):
    """Unknown backend, or a graph the backend cannot run."""


class CalibrationError(QCompilerError, ValueError):
    """Calibration data that cannot be used (empty, non-finite, wrong shape)."""


class ArtifactError(QCompilerError):
    """A saved artifact is missing, damaged, or holds something this version cannot load."""


class QuantizationError(QCompilerError, ValueError):
    """A quantization setting or layer that cannot be quantized as asked."""


class ExportError(QCompilerError):
    """The graph holds something the chosen checkpoint format cannot express, or a checkpoint read
    back is not what its format says (the message names it)."""


class DistributedError(QCompilerError):
    """A distributed run could not form: its ranks did not all join (the message says who waited where)."""
