"""A bfloat16 graph exported to ONNX in float32.

ONNX Runtime has no bfloat16 kernels for what the export emits (``MatMulNBits`` takes float16 or
float32 activations; most CPU kernels float32 only): a bf16 checkpoint's graph failed at the end of
its export with a shape-inference error. Its copy for the export is widened instead — every bf16
tensor to float32 (exact: bf16 is float32's top half), every cast to bf16 made a cast to float32 —
so ONNX Runtime computes it in float32: within bf16 rounding of the graph, never coarser."""

from __future__ import annotations

import torch
from torch.fx import GraphModule
from torch.fx.node import map_aggregate

from qcompiler.ir.tensors import get_raw_tensor, set_tensor

__all__ = ["widen_bfloat16", "widened_inputs"]


def _float32_for_bf16(value):
    return torch.float32 if value is torch.bfloat16 else value


def widen_bfloat16(gm: GraphModule) -> list[str]:
    """Widen ``gm``'s (an export copy's) bf16 tensors and casts to float32, in place; a note when it did."""
    widened = 0
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            tensor = get_raw_tensor(gm, node.target)
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bfloat16:
                set_tensor(gm, node.target, tensor.float(), parameter=isinstance(tensor, torch.nn.Parameter))
                widened += 1
        args, kwargs = map_aggregate(node.args, _float32_for_bf16), map_aggregate(node.kwargs, _float32_for_bf16)
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs = args, kwargs
            widened += 1
    if not widened:
        return []
    for node in gm.graph.nodes:  # recorded shapes carry the old dtypes: later steps recompute them
        node.meta.pop("val", None)
        node.meta.pop("tensor_meta", None)
    gm.recompile()
    return ["a bfloat16 graph, exported in float32 (ONNX Runtime has no bfloat16 MatMulNBits)"]


def widened_inputs(value):
    """Example inputs with their bf16 tensors (a KV cache's past) as float32."""
    return map_aggregate(value, lambda v: v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 else v)
