"""``qc.hadamard`` lowered for ONNX export: ``((x · s) reshaped to blocks) @ (H_b/√b)``, plain
Mul / Reshape / MatMul that every ONNX runtime runs (the signs and ``H_b/√b`` become fp32
initializers; the product is computed in fp32, as the reference op does)."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from qcompiler.algorithms.hadamard import hadamard_matrix
from qcompiler.ir.graph import aten
from qcompiler.ir.op_registry import OpArgs, implement
from qcompiler.ir.tensors import set_tensor

__all__ = ["lower_hadamard"]


def lower_hadamard(gm: GraphModule, a: OpArgs, path: str, notes: list) -> Node:
    """The aten nodes computing ``qc.hadamard(x)``; returns the last one."""
    graph, b = gm.graph, int(a.block_size)
    set_tensor(gm, f"{path}.onnx_signs", a.tensor(gm, "signs").float())
    set_tensor(gm, f"{path}.onnx_hadamard", hadamard_matrix(b))
    dtype = a.x.meta["val"].dtype if "val" in a.x.meta else torch.float32
    x = graph.call_function(aten._to_copy.default, (a.x,), {"dtype": torch.float32})
    x = graph.call_function(aten.mul.Tensor, (x, graph.get_attr(f"{path}.onnx_signs")))
    x = graph.call_function(aten.unflatten.int, (x, -1, [-1, b]))
    x = graph.call_function(aten.matmul.default, (x, graph.get_attr(f"{path}.onnx_hadamard")))
    x = graph.call_function(aten.flatten.using_ints, (x, -2, -1))
    return graph.call_function(aten._to_copy.default, (x,), {"dtype": dtype})


implement("onnx", "hadamard", lower_hadamard, kind="lowering", label="Mul + MatMul by H_b")
