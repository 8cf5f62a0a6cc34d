"""The ``onnxruntime`` backend: export the graph, then run it in an ``InferenceSession``.

The CUDA execution provider is used when onnxruntime-gpu sees a GPU, else the CPU one. The
session is called like the original model and returns the original output structure.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional

import torch
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree
from torch.fx import GraphModule

from qcompiler.backends.onnx_export import cache_io_names, export_onnx
from qcompiler.errors import BackendError
from qcompiler.frontend.causal_lm import CacheLayout

__all__ = ["prepare_onnxruntime", "session_for"]


def session_for(path, *, threads: Optional[int] = None):
    """An ONNX Runtime CPU session for the model file at ``path`` (``threads`` intra-op threads)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    available = ort.get_available_providers()
    providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
    return ort.InferenceSession(str(path), options, providers=providers)


def prepare_onnxruntime(
    gm: GraphModule,
    example_inputs: tuple[tuple, dict],
    *,
    path=None,
    threads: Optional[int] = None,
    accuracy_level: Optional[int] = None,
    fused_attention: Optional[bool] = None,
):
    """Export ``gm`` (to ``path``, or to a temporary folder removed once the session holds the
    model) and return a callable session wrapper.

    ``fused_attention`` (default: when the session runs on the CPU provider): KV-cache attention as
    ``GroupQueryAttention``, whose CUDA kernel takes fp16/bf16 only — an fp32 node would run on the
    CPU, copying the cache across every step."""
    import onnxruntime as ort

    if fused_attention is None:
        fused_attention = "CUDAExecutionProvider" not in ort.get_available_providers()
    options = dict(accuracy_level=accuracy_level, fused_attention=fused_attention)
    if path is None:
        with tempfile.TemporaryDirectory(prefix="qcompiler-onnx-") as tmp:
            export_onnx(gm, Path(tmp) / "model.onnx", example_inputs, **options)
            session = session_for(Path(tmp) / "model.onnx", threads=threads)
    else:
        export_onnx(gm, path, example_inputs, **options)
        session = session_for(path, threads=threads)
    names = [i.name for i in session.get_inputs()]
    types = {i.name: i.type for i in session.get_inputs()}
    out_spec = gm._out_spec
    in_spec = gm._in_spec
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    info = gm.meta["qcompiler"]
    onnx_name = cache_io_names(CacheLayout.from_dict(info.cache)) if info.cache else {}

    def run(*args, **kwargs):
        unknown = [k for k in kwargs if k not in in_spec.child(1).context] if in_spec.num_children == 2 else []
        if unknown:  # never drop an input silently (a padding mask changes the result)
            raise BackendError(
                f"the ONNX model was exported without input {unknown[0]!r} (its inputs: "
                f"{', '.join(names)}); compile with an example that includes {unknown[0]}"
            )
        try:
            flat = fx_pytree.tree_flatten_spec((args, kwargs), in_spec)
        except Exception as exc:  # pytree raises several types for a structure that does not match
            raise BackendError(f"inputs do not match the exported model's inputs ({', '.join(names)}): {exc}") from None
        values = {onnx_name.get(p, p): v for p, v in zip(placeholders, flat)}
        missing = [n for n in names if n not in values]
        if missing:
            raise BackendError(f"the ONNX model needs inputs {missing}")
        feeds = {n: _as_input(values[n], types[n]) for n in names}
        outputs = [torch.from_numpy(o) for o in session.run(None, feeds)]
        return pytree.tree_unflatten(outputs, out_spec)

    run.session, run.path = session, (Path(path) if path is not None else None)
    return run


_INTEGER_INPUTS = {"tensor(int64)": torch.int64, "tensor(int32)": torch.int32}


def _as_input(value, onnx_type: str):
    """``value`` as the array the session takes: integer tensors (token ids, masks) in the integer
    type the model declares, as eager accepts int32 or int64 alike."""
    if not isinstance(value, torch.Tensor):
        return value
    wanted = _INTEGER_INPUTS.get(onnx_type)
    if wanted is not None and not value.is_floating_point() and value.dtype != wanted:
        value = value.to(wanted)
    return value.detach().numpy()
