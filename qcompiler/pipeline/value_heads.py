"""Attention's value → output path: the linears a per-head rotation can pair (``passes/rotate.py``).

``o_proj`` reads ``softmax(QKᵀ)·V`` head by head, and attention mixes tokens, never channels, so
rotating every head's channels of ``V`` by ``R`` (``v_proj``'s output rows) and ``o_proj``'s
input columns by the same ``R`` leaves the output unchanged, whatever the mask, cache or
grouped-query sharing of heads. The path is walked back from ``o_proj``'s input through views,
transposes that keep the channel dimension last, the KV cache's concatenation along the sequence,
grouped-query ``expand``/``reshape`` and the attention product itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch.fx import Node

from qcompiler.ir.graph import LinearLayer, aten

__all__ = ["ValueOutputPair", "value_output_pairs"]


@dataclass
class ValueOutputPair:
    """An attention's value and output projections, and its head width."""

    value: LinearLayer  # v_proj
    output: LinearLayer  # o_proj
    head_dim: int


_THROUGH = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.contiguous.default,
    aten.clone.default,
    aten.expand.default,
    aten.unsqueeze.default,
    aten.to.dtype,
    aten._to_copy.default,
    aten.dropout.default,
    aten.alias.default,
}


def _val_width(node: Node) -> int:
    return node.meta["val"].shape[-1]


def _keeps_last(node: Node, dim: Optional[int] = None) -> bool:
    """A transpose/permute/slice (or a cat along ``dim``) that leaves the last (channel) dimension alone."""
    ndim = node.meta["val"].dim()
    if dim is not None:
        return dim % ndim != ndim - 1
    if node.target is aten.transpose.int:
        return all(d % ndim != ndim - 1 for d in node.args[1:3])
    if node.target is aten.permute.default:
        return node.args[1][-1] % ndim == ndim - 1
    return node.args[1] % ndim != ndim - 1  # slice.Tensor(x, dim, ...)


def _value_source(o: LinearLayer, by_node: dict[Node, LinearLayer]) -> Optional[ValueOutputPair]:
    node, head_dim = o.input, None
    while True:
        if node in by_node:
            v = by_node[node]
            break
        if node.op != "call_function":
            return None
        t = node.target
        if t in _THROUGH:
            node = node.args[0]
        elif t in (aten.transpose.int, aten.permute.default, aten.slice.Tensor) and _keeps_last(node):
            node = node.args[0]
        elif t is aten.scaled_dot_product_attention.default and head_dim is None:
            node = node.args[2]
            head_dim = node.meta["val"].shape[-1]
        elif t is aten.matmul.default and head_dim is None and _val_width(node) == _val_width(node.args[1]):
            node = node.args[1]  # softmax(QKᵀ) @ V
            head_dim = node.meta["val"].shape[-1]
        elif t is aten.cat.default and head_dim is not None and _keeps_last(node, dim=node.args[1]):
            node = node.args[0][-1]  # [past values, new values] along the sequence
        else:
            return None
    if head_dim is None or v is o:
        return None
    out_v = v.weight_node.meta["val"].shape[1 if v.transposed else 0]
    if out_v % head_dim or o.in_features % head_dim:
        return None
    return ValueOutputPair(v, o, head_dim)


def value_output_pairs(layers: list[LinearLayer]) -> list[ValueOutputPair]:
    """(v_proj, o_proj, head_dim) for each attention the walk can follow."""
    by_node = {layer.node: layer for layer in layers}
    return [pair for o in layers if (pair := _value_source(o, by_node)) is not None]
