"""How ``compile()`` runs, apart from what it compiles (model, inputs, recipe, calibration,
backend): one object that ``qc.compile``, the command line's ``quantize`` and every rank of a
distributed run take, so a new setting is one field here instead of a parameter threaded through
three signatures."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["CompileOptions", "compile_options"]


@dataclass(frozen=True)
class CompileOptions:
    """``backend_options``: passed to the backend (onnxruntime: ``path``, ``threads``,
    ``accuracy_level``, ``fused_attention``). ``progress``: the ``[qcompiler]`` lines.
    ``device``: where calibration and the solvers run, one block at a time (``auto``: the GPU when
    there is one); the model's weights stay where they are. ``offload``: keep the cached block
    inputs on the CPU (calibration sets larger than the device's memory). ``checkpoint``: a folder
    where each finished block of a weight-quantizing pass is recorded; ``resume`` continues a run
    killed with the same model, recipe and calibration; the folder is removed when compile returns
    unless ``keep_checkpoint``. ``materialize=False`` (a streamed model, eager backend): leave the
    tensors waiting on disk there, so ``save`` writes them one at a time."""

    backend_options: Optional[dict] = None
    progress: bool = True
    device: Any = "auto"
    offload: bool = False
    checkpoint: Any = None
    resume: bool = False
    keep_checkpoint: bool = False
    materialize: bool = True

    def __post_init__(self):
        if self.resume and self.checkpoint is None:
            raise ValueError("resume=True continues the run recorded in checkpoint=DIR: give the folder")


def compile_options(options: Optional[CompileOptions], settings: dict) -> CompileOptions:
    """``options``, or one made of ``settings`` (CompileOptions' fields as keywords); not both, and
    an unknown keyword is a TypeError naming it and the fields there are."""
    if options is not None and settings:
        raise TypeError(f"give options=CompileOptions(...) or its fields as keywords ({sorted(settings)}), not both")
    if options is not None:
        return options
    fields = {f.name for f in dataclasses.fields(CompileOptions)}
    unknown = sorted(set(settings) - fields)
    if unknown:
        raise TypeError(f"compile() got unknown keyword(s) {unknown}; its options are {sorted(fields)}")
    return CompileOptions(**settings)
