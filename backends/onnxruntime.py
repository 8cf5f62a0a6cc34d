"""The ``onnxruntime`` backend: export the graph, then run it in an ``InferenceSession``.

The CUDA execution provider is used when onnxruntime-gpu sees a GPU, else the CPU one. The
session is called like the original model and returns the original output structure.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule

from .onnx_export import export_onnx

__all__ = ["prepare_onnxruntime", "session_for"]


def session_for(path, *, threads: Optional[int] = None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    available = ort.get_available_providers()
    providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
    return ort.InferenceSession(str(path), options, providers=providers)


def prepare_onnxruntime(gm: GraphModule, example_inputs: tuple[tuple, dict], *, path=None,
                        threads: Optional[int] = None, accuracy_level: Optional[int] = None, recipe: str = ""):
    """Export ``gm`` (to ``path`` or a temporary folder) and return a callable session wrapper."""
    if path is None:
        path = Path(tempfile.mkdtemp(prefix="qcompiler-onnx-")) / "model.onnx"
    export_onnx(gm, path, example_inputs, recipe=recipe, accuracy_level=accuracy_level)
    session = session_for(path, threads=threads)
    names = [i.name for i in session.get_inputs()]
    out_spec = gm._out_spec

    def run(*args, **kwargs):
        feeds = {}
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        for name, value in zip(names, tensors):
            feeds[name] = value.numpy()
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor) and name in names:
                feeds[name] = value.numpy()
        missing = [n for n in names if n not in feeds]
        if missing:
            raise ValueError(f"the ONNX model needs inputs {missing}")
        outputs = [torch.from_numpy(o) for o in session.run(None, feeds)]
        return pytree.tree_unflatten(outputs, out_spec)

    run.session, run.path = session, Path(path)
    return run
