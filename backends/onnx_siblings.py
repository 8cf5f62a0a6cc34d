"""Linears that read one input (q/k/v; gate/up) as one ``MatMulNBits`` node and a ``Split``.

A decode step at batch 1 is a chain of matrix-vector products; one kernel over the stacked
weights does the same arithmetic in fewer, larger calls and reads the input once (measured on a
32-layer, 1024-wide LLaMA through onnxruntime-genai: +2.8 % decode tokens/s, docs/results.md).
Every ``MatMulNBits`` tensor leads with the output dim ``N`` (SpQR's ``group_corr`` trails with
it), so stacking is concatenation, and each output is exactly the column slice it was.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from qcompiler.ir.op_registry import OpArgs, args_of, call_op
from qcompiler.ir.tensors import drop_attr_if_unused, set_tensor

__all__ = ["fuse_sibling_nbits"]

_MATMUL_NBITS = torch.ops.qc.matmul_nbits.default
_STACKED = {"B": 0, "scales": 0, "zero_points": 0, "group_corr": 1, "bias": 0}  # tensor -> its N dim


def _key(a: OpArgs) -> tuple:
    """Siblings: the same input, shape of the blocks and kinds of optional arguments."""
    return a.x, a.K, a.bits, a.block_size, a.perm is None, a.group_corr is None, a.bias is None


def _fusable(gm: GraphModule, args: list[OpArgs]) -> bool:
    first = args[0]
    same_dtype = len({a.tensor(gm, "zero_points").dtype for a in args}) == 1
    same_perm = first.perm is None or all(torch.equal(a.tensor(gm, "perm"), first.tensor(gm, "perm")) for a in args)
    stored_bias = first.bias is None or all(isinstance(a.bias, Node) and a.bias.op == "get_attr" for a in args)
    return same_dtype and same_perm and stored_bias


def fuse_sibling_nbits(gm: GraphModule) -> int:
    """Fuse each set of ``qc.matmul_nbits`` nodes with one input into one node + ``split``;
    returns how many nodes were removed."""
    graph = gm.graph
    siblings: dict[tuple, list[Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target == _MATMUL_NBITS:
            siblings.setdefault(_key(args_of(node)), []).append(node)
    removed = 0
    for nodes in siblings.values():
        args = [args_of(n) for n in nodes]
        if len(nodes) < 2 or not _fusable(gm, args):
            continue
        first = args[0]
        prefix = first.B.target.rsplit(".onnx_", 1)[0] + ".onnx_siblings"
        widths = [a.N for a in args]
        with graph.inserting_before(nodes[0]):
            stacked = {}
            for name, dim in _STACKED.items():
                if getattr(first, name) is not None:
                    set_tensor(gm, f"{prefix}_{name}", torch.cat([a.tensor(gm, name) for a in args], dim=dim))
                    stacked[name] = graph.get_attr(f"{prefix}_{name}")
            fused = call_op(
                graph,
                "matmul_nbits",
                x=first.x,
                perm=first.perm,
                K=first.K,
                N=sum(widths),
                bits=first.bits,
                block_size=first.block_size,
                **stacked,
            )
            parts = graph.call_function(torch.ops.aten.split_with_sizes.default, (fused, widths, -1))
            for i, node in enumerate(nodes):
                node.replace_all_uses_with(graph.call_function(operator.getitem, (parts, i)))
        for node, a in zip(nodes, args):
            graph.erase_node(node)
            for attr in a.stored():  # the siblings' own tensors: no second copy of them in memory
                drop_attr_if_unused(gm, attr)
        removed += len(nodes) - 1
    return removed
