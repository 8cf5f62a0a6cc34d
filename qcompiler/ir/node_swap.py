"""Swapping a linear (or a grouped expert matmul) for a ``qc`` op whose tensors are stored beside
it: the one graph edit every storage layout's rewrite makes (``qcompiler/layouts/``); and a ``qc``
node for the same op with some arguments changed (an activation pass's edit)."""

from __future__ import annotations

from typing import Callable

import torch
from torch.fx import GraphModule, Node

from qcompiler.ir.experts import ExpertLinear
from qcompiler.ir.graph import LinearLayer
from qcompiler.ir.op_registry import args_of, call_op
from qcompiler.ir.tensors import drop_attr_if_unused, set_tensor

__all__ = ["replace_linear", "replace_experts", "with_arguments"]


def with_arguments(gm: GraphModule, node: Node, **changes) -> Node:
    """``node`` (a ``qc`` op) replaced by a node of the same op with ``changes`` to its arguments by
    name, in its place and with its metadata; returns the new node."""
    a = args_of(node)
    with gm.graph.inserting_before(node):
        new = call_op(gm.graph, a.spec.name, **{**a.as_dict(), **changes})
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return new


def replace_experts(
    gm: GraphModule, expert: ExpertLinear, op_name: str, tensors: dict[str, torch.Tensor], constants: dict
) -> torch.fx.Node:
    """Swap a grouped matmul over 3-D expert weights for ``qc.{op_name}`` on the stacked tensors
    (stored beside the parameter, as ``{path}_qweight`` etc.) and ``constants`` (bits, ...)."""
    graph = gm.graph
    for name, tensor in tensors.items():
        set_tensor(gm, f"{expert.path}_{name}", tensor)
    with graph.inserting_before(expert.node):
        attrs = {name: graph.get_attr(f"{expert.path}_{name}") for name in tensors}
        new = call_op(graph, op_name, x=expert.input, offsets=expert.offsets, **attrs, **constants)
    new.meta.update({k: v for k, v in expert.node.meta.items() if k in ("nn_module_stack", "val", "stack_trace")})
    weight_user = expert.weight_user
    expert.node.replace_all_uses_with(new)
    graph.erase_node(expert.node)
    if weight_user is not expert.weight_node and not weight_user.users:
        graph.erase_node(weight_user)  # the transpose that read the FP weight
    drop_attr_if_unused(gm, expert.weight_node)
    return new


def replace_linear(
    gm: GraphModule,
    layer: LinearLayer,
    op_name: str,
    tensors: dict[str, torch.Tensor],
    make_args: Callable[[torch.fx.Node, dict], dict],
) -> torch.fx.Node:
    """Store ``tensors`` beside the layer (``{path}.{name}``; callers put them where the graph's
    weights live) and swap its node for ``qc.{op_name}(**make_args(x, attrs))``."""
    graph = gm.graph
    base = layer.path or layer.node.name
    for name, tensor in tensors.items():
        set_tensor(gm, f"{base}.{name}", tensor)
    with graph.inserting_before(layer.node):
        attrs = {name: graph.get_attr(f"{base}.{name}") for name in tensors}
        new = call_op(graph, op_name, **make_args(layer.input, attrs))
    new.meta.update({k: v for k, v in layer.node.meta.items() if k in ("nn_module_stack", "val", "stack_trace")})
    layer.node.replace_all_uses_with(new)
    graph.erase_node(layer.node)
    drop_attr_if_unused(gm, layer.weight_node)
    return new
