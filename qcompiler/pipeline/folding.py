"""Graph rewrites that passes share: replacing a tensor, folding per-channel scales into a
linear's weight columns or output rows, inserting an explicit scale multiply, and swapping a
linear (or a grouped expert matmul) for a ``qc`` op whose tensors are stored beside it.
Each keeps the graph valid; numerics are the caller's business."""

from __future__ import annotations

from typing import Callable

import torch
from torch.fx import GraphModule

from qcompiler.ir.experts import ExpertLinear
from qcompiler.ir.graph import LinearLayer, aten
from qcompiler.ir.op_registry import call_op
from qcompiler.ir.tensors import drop_attr_if_unused, get_tensor, set_tensor
from qcompiler.pipeline.smoothing_plan import SmoothingPlan

__all__ = [
    "SMOOTH_META",
    "replace_tensor",
    "scale_input_columns",
    "scale_output_rows",
    "insert_smoothing_multiply",
    "replace_linear",
    "replace_experts",
    "fold_channel_scales",
    "insert_pending_multiplies",
]

SMOOTH_META = "qc_smooth_inv"  # marks an explicit 1/s multiply node; value: its buffer's target


def replace_tensor(gm: GraphModule, target: str, tensor: torch.Tensor) -> None:
    """Store ``tensor`` at ``target`` (a new tensor: the user's parameters are never modified in place)."""
    old = get_tensor(gm, target)
    set_tensor(gm, target, tensor.to(old.dtype).contiguous(), parameter=isinstance(old, torch.nn.Parameter))


def scale_input_columns(gm: GraphModule, layer: LinearLayer, s: torch.Tensor) -> None:
    """Multiply ``layer``'s weight columns by ``s`` (the consumer side of a smoothing scale)."""
    w = get_tensor(gm, layer.weight_node.target).detach()
    replace_tensor(gm, layer.weight_node.target, w * s.unsqueeze(1) if layer.transposed else w * s)


def scale_output_rows(gm: GraphModule, layer: LinearLayer, inv: torch.Tensor) -> None:
    """Multiply ``layer``'s output rows (and bias) by ``inv`` (a producer absorbing ``1/s``)."""
    w = get_tensor(gm, layer.weight_node.target).detach()
    replace_tensor(gm, layer.weight_node.target, w * inv if layer.transposed else w * inv.unsqueeze(1))
    if layer.bias_node is not None:
        replace_tensor(gm, layer.bias_node.target, get_tensor(gm, layer.bias_node.target).detach() * inv)


def insert_smoothing_multiply(gm: GraphModule, consumers: list[LinearLayer], inv: torch.Tensor, label: str) -> None:
    """Put an explicit ``x * inv`` before ``consumers`` when no producer can absorb it."""
    target = f"{label}.smooth_inv_scale" if label else "smooth_inv_scale"
    set_tensor(gm, target, inv.float())
    made = {}
    for layer in consumers:
        x = layer.input
        if x not in made:
            with gm.graph.inserting_after(x):
                attr = gm.graph.get_attr(target)
            with gm.graph.inserting_after(attr):
                mul = gm.graph.call_function(aten.mul.Tensor, (x, attr))
            mul.meta.update({k: v for k, v in x.meta.items() if k in ("nn_module_stack", "val")})
            mul.meta[SMOOTH_META] = target
            made[x] = mul
        idx = 1 if layer.node.target is aten.addmm.default else 0
        layer.node.update_arg(idx, made[x])


def fold_channel_scales(gm: GraphModule, group: list[LinearLayer], plan: SmoothingPlan, s: torch.Tensor, pending: list):
    """``Y = (X diag(s)⁻¹)(W diag(s))ᵀ``, exactly: ``diag(s)`` into every consumer's weight columns and
    ``diag(s)⁻¹`` where ``plan`` says (a norm's weight and bias, a producer linear's output rows). An
    ``explicit`` plan is queued on ``pending`` for :func:`insert_pending_multiplies` (SmoothQuant and AWQ
    calibrate on a fixed node list, so new nodes go in once they are done)."""
    inv = 1.0 / s
    if plan.form == "norm":
        weight = plan.norm.weight_node.target
        replace_tensor(gm, weight, get_tensor(gm, weight).detach() * inv)
        if plan.norm.bias_node is not None:
            bias = plan.norm.bias_node.target
            replace_tensor(gm, bias, get_tensor(gm, bias).detach() * inv)
    elif plan.form == "linear":
        scale_output_rows(gm, plan.producer, inv)
    else:
        pending.append((group, inv, plan.label))
        return
    for layer in group:
        scale_input_columns(gm, layer, s)


def insert_pending_multiplies(gm: GraphModule, pending: list) -> None:
    """The explicit ``x · diag(s)⁻¹`` nodes :func:`fold_channel_scales` queued, and their consumers' ``diag(s)``."""
    for group, inv, label in pending:
        insert_smoothing_multiply(gm, group, inv, label)
        for layer in group:
            scale_input_columns(gm, layer, 1.0 / inv)


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
