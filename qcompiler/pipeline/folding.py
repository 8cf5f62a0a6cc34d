"""Graph rewrites that passes share: replacing a tensor, folding per-channel scales into a
linear's weight columns or output rows, inserting an explicit scale multiply (swapping a linear
for a ``qc`` op is ``qcompiler/ir/node_swap.py``). Each keeps the graph valid; numerics are the
caller's business."""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from qcompiler.ir.graph import LinearLayer, aten
from qcompiler.ir.tensors import get_tensor, set_tensor
from qcompiler.pipeline.smoothing_plan import SmoothingPlan

__all__ = [
    "SMOOTH_META",
    "replace_tensor",
    "scale_input_columns",
    "scale_output_rows",
    "insert_smoothing_multiply",
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
        weight, offset = plan.norm.weight_node.target, plan.norm.offset
        stored = get_tensor(gm, weight).detach()
        if offset:  # the norm scales by offset + w (Gemma: 1 + w): w' with offset + w' = (offset + w) / s
            replace_tensor(gm, weight, ((offset + stored.float()) * inv - offset).to(stored.dtype))
        else:
            replace_tensor(gm, weight, stored * inv)
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
