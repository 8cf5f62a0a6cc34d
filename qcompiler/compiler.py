"""``qc.compile()``: capture → passes → backend, returning a model called like the original."""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch.fx import GraphModule

from .capture import CaptureInfo, capture, normalize_inputs
from .errors import CalibrationError
from .pass_base import PassContext
from .pass_manager import PassManager
from .recipes import Recipe, resolve_recipe
from .report import Report

__all__ = ["compile", "CompiledModel", "normalize_calibration"]


class CompiledModel:
    """A quantized model: call it like the original; inspect ``graph_module`` and ``report``."""

    def __init__(self, graph_module: GraphModule, recipe: Recipe, report: Report, backend: str, runner,
                 example_inputs: tuple[tuple, dict]):
        self.graph_module = graph_module
        self.recipe = recipe
        self.report = report
        self.backend = backend
        self.example_inputs = example_inputs
        self._runner = runner

    @property
    def capture_info(self) -> CaptureInfo:
        return self.graph_module.meta["qcompiler"]

    def __call__(self, *args, **kwargs) -> Any:
        for name, value in self.capture_info.constant_kwargs.items():
            kwargs.setdefault(name, value)
        with torch.no_grad():
            return self._runner(*args, **kwargs)

    def export_onnx(self, path, *, accuracy_level: Optional[int] = None):
        """Write the graph as an ONNX model that ONNX Runtime runs (see docs/backends/onnx.md)."""
        from .backends.onnx_export import export_onnx
        return export_onnx(self.graph_module, path, self.example_inputs, recipe=self.recipe.name,
                           accuracy_level=accuracy_level)

    def save(self, path, *, metadata: Optional[dict] = None):
        """Write the quantized model to folder ``path`` (atomic; reload with ``qc.load(path)``)."""
        from .artifact import save
        return save(self, path, metadata=metadata)

    def __repr__(self) -> str:
        passes = ", ".join(repr(p) for p in self.recipe.passes) or "none"
        return (f"CompiledModel({self.capture_info.model_class}, recipe={self.recipe.name!r}, "
                f"backend={self.backend!r}, passes=[{passes}])")


def normalize_calibration(calibration: Optional[Iterable], info: CaptureInfo) -> Optional[list[tuple[tuple, dict]]]:
    """Calibration batches as ``(args, kwargs)``, with the capture's constant kwargs filled in."""
    if calibration is None:
        return None
    if isinstance(calibration, torch.Tensor):  # a stacked batch of token windows
        calibration = [calibration]
    batches = []
    for item in calibration:
        args, kwargs = normalize_inputs(item)
        for name, value in info.constant_kwargs.items():
            kwargs.setdefault(name, value)
        batches.append((args, kwargs))
    if not batches:
        raise CalibrationError("the calibration set is empty: pass at least one batch of inputs")
    return batches


def compile(model: torch.nn.Module, example_inputs, recipe="none", calibration: Optional[Iterable] = None,
            backend: str = "eager", *, backend_options: Optional[dict] = None, progress: bool = True) -> CompiledModel:
    """Capture ``model``, apply ``recipe``'s passes in order, and prepare ``backend`` to run it.

    ``recipe``: a built-in name (see ``qc.list_recipes()``), a ``qc.Recipe``, or a list of passes.
    ``calibration``: an iterable of inputs shaped like ``example_inputs`` (needed by data-driven passes).
    ``backend``: ``eager`` (reference ops), ``triton`` (GPU kernels; CPU only under TRITON_INTERPRET=1) or
    ``onnxruntime``. ``backend_options``: passed to the backend (onnxruntime: ``path``, ``threads``, ``accuracy_level``).
    """
    from .backends import get_backend  # qcompiler.backends imports this module's package

    resolved = resolve_recipe(recipe)
    runner_factory = get_backend(backend)  # unknown backend: fail before any work
    manager = PassManager(resolved.passes)
    manager.validate(has_calibration=calibration is not None)
    gm = capture(model, example_inputs)
    info: CaptureInfo = gm.meta["qcompiler"]
    ctx = PassContext(example_inputs=normalize_inputs(example_inputs),
                      calibration=normalize_calibration(calibration, info), progress=progress)
    report = manager.run(gm, ctx)
    options = dict(backend_options or {})
    if backend == "onnxruntime":
        options.setdefault("recipe", resolved.name)
    runner = runner_factory(gm, ctx.example_inputs, **options)
    if getattr(runner, "record", None) is not None:  # the backend's plan (kernels, fallbacks) joins the report
        report.passes.append(runner.record)
    return CompiledModel(gm, resolved, report, backend, runner, ctx.example_inputs)
