"""A bfloat16 or float16 graph exported to ONNX in float32.

ONNX Runtime has no bfloat16 kernels for what the export emits, and its float16 ``MatMulNBits``
wants float16 scales where the layout stores float32 ones (most CPU kernels are float32 only): a
16-bit checkpoint's graph failed at the end of its export with a shape-inference error. Its copy
for the export is widened instead — every 16-bit float tensor to float32 (exact), every cast to a
16-bit float made a cast to float32 — so ONNX Runtime computes it in float32: within 16-bit
rounding of the graph, never coarser."""

from __future__ import annotations

import torch
from torch.fx import GraphModule
from torch.fx.node import map_aggregate

from qcompiler.ir.tensors import get_raw_tensor, set_tensor

__all__ = ["widen_half_floats", "widened_inputs"]


_HALF = (torch.bfloat16, torch.float16)


def _float32_for_half(value):
    return torch.float32 if isinstance(value, torch.dtype) and value in _HALF else value


def widen_half_floats(gm: GraphModule) -> list[str]:
    """Widen ``gm``'s (an export copy's) 16-bit float tensors and casts to float32, in place; a note
    naming the dtype when it did."""
    widened, seen = 0, set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            tensor = get_raw_tensor(gm, node.target)
            if isinstance(tensor, torch.Tensor) and tensor.dtype in _HALF:
                seen.add(str(tensor.dtype).removeprefix("torch."))
                set_tensor(gm, node.target, tensor.float(), parameter=isinstance(tensor, torch.nn.Parameter))
                widened += 1
        args, kwargs = map_aggregate(node.args, _float32_for_half), map_aggregate(node.kwargs, _float32_for_half)
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs = args, kwargs
            widened += 1
    if not widened:
        return []
    for node in gm.graph.nodes:  # recorded shapes carry the old dtypes: later steps recompute them
        node.meta.pop("val", None)
        node.meta.pop("tensor_meta", None)
    gm.recompile()
    what = "/".join(sorted(seen)) or "16-bit float casts"
    return [f"a {what} graph, exported in float32 (ONNX Runtime's MatMulNBits takes no bfloat16)"]


def widened_inputs(value):
    """Example inputs with their 16-bit float tensors (a KV cache's past) as float32."""
    return map_aggregate(value, lambda v: v.float() if isinstance(v, torch.Tensor) and v.dtype in _HALF else v)
