"""Where each SmoothQuant ``diag(s)^-1`` can go in a graph (the scales themselves are
``qcompiler.algorithms.smoothquant``).

Where ``diag(s)^-1`` goes (:func:`plan_smoothing`), by the producer of ``X``:

- ``norm``: a LayerNorm (``γ/s``, ``β/s``) or RMSNorm (``γ/s``) whose output feeds only the
  group's linears;
- ``linear``: a linear whose output reaches the group through per-channel operations only
  (views/transposes, attention's value path, ``relu``, multiplication by an unrelated tensor):
  its output rows are divided by ``s`` (v_proj → o_proj, up_proj → down_proj, fc1 → fc2);
- ``explicit``: a norm that cannot absorb it (its output also feeds a residual add, as in
  BERT's post-LN blocks): a per-channel multiply node in front of the consumers, which int8
  lowering fuses into its activation quantizer;
- ``none``: anything else is left alone, and the report says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from torch.fx import Node

from qcompiler.ir.graph import LinearLayer, NormInfo, aten, find_producing_norm, source_of
from qcompiler.pipeline.layer_filter import ignore_reason

__all__ = ["SmoothingPlan", "plan_smoothing"]


@dataclass
class SmoothingPlan:
    """Where one producer group's ``1/s`` goes: a norm, a previous linear, or an explicit multiply."""

    form: str  # "norm" | "linear" | "explicit" | "none"
    reason: str
    norm: Optional[NormInfo] = None
    producer: Optional[LinearLayer] = None
    label: str = ""  # the producer's module path, for the report
    path_nodes: list[Node] = field(default_factory=list)


_VIEWS = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.transpose.int,
    aten.permute.default,
    aten.contiguous.default,
    aten.clone.default,
    aten.dropout.default,
    aten.to.dtype,
    aten._to_copy.default,
    aten.relu.default,
}


def _terminal_users(node: Node) -> set[Node]:
    """Users of ``node``'s value, looking through nodes that only pass it on (source_of's set)."""
    out, todo = set(), list(node.users)
    while todo:
        user = todo.pop()
        if user.op == "call_function" and source_of(user) is not user and source_of(user) is source_of(node):
            todo.extend(user.users)
        elif user.op == "call_function" and user.target is aten._assert_tensor_metadata.default:
            continue
        else:
            out.add(user)
    return out


def _depends_on(node: Node, target: Node, limit: int = 10_000) -> bool:
    seen, todo = set(), [node]
    while todo and len(seen) < limit:
        n = todo.pop()
        if n is target:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def _channel_producer(node: Node, layers_by_node: dict[Node, LinearLayer]) -> tuple[Optional[LinearLayer], list[Node]]:
    """Follow per-channel operations back from ``node`` to a linear; every step must have one user."""
    path = []
    while True:
        if node in layers_by_node:
            return layers_by_node[node], path
        if node.op != "call_function" or (path and len(node.users) != 1):
            return None, path
        path.append(node)
        if node.target in _VIEWS:
            node = node.args[0]
        elif node.target is aten.scaled_dot_product_attention.default:
            node = node.args[2]  # softmax(QKᵀ)·V is linear in V, channel by channel
        elif node.target is aten.mul.Tensor and len(node.args) == 2 and all(isinstance(a, Node) for a in node.args):
            # x·y scales with y when x does not depend on y (SwiGLU: silu(gate)·up)
            for operand, other in (node.args, node.args[::-1]):
                found, sub = _channel_producer(operand, layers_by_node)
                if (
                    found is not None
                    and (operand.users.keys() == {node} or operand is found.node)
                    and not _depends_on(other, found.node)
                ):
                    return found, path + sub
            return None, path
        else:
            return None, path


def _value_users(node) -> list:
    """``node``'s users that read its value (not torch.export's dtype / shape assertions on it)."""
    return [u for u in node.users if u.target is not aten._assert_tensor_metadata.default]


def plan_smoothing(
    consumers: Sequence[LinearLayer], all_layers: Sequence[LinearLayer], ignore: Sequence[str] = ()
) -> SmoothingPlan:
    """Where this group's ``1/s`` can be folded (see the module docstring). Scaling rescales every
    consumer of the producer, so a group with a layer ``ignore`` matches is left alone."""
    for layer in consumers:
        why = ignore_reason(layer.path, ignore)
        if why:
            return SmoothingPlan("none", reason=f"{layer.path} is {why}")
    src = source_of(consumers[0].input)
    consumer_nodes = {c.node for c in consumers}
    norm = find_producing_norm(consumers[0])
    if norm is not None:
        outside = _terminal_users(norm.output) - consumer_nodes
        weight_shared = norm.weight_node is not None and len(_value_users(norm.weight_node)) > 1
        if norm.weight_node is None:
            return SmoothingPlan(
                "explicit", f"{norm.path} has no affine weight to absorb 1/s", norm=norm, label=norm.path
            )
        if weight_shared:
            return SmoothingPlan("explicit", f"{norm.path}'s weight is used by other nodes", norm=norm, label=norm.path)
        if outside:
            names = ", ".join(sorted(u.name for u in outside))
            return SmoothingPlan(
                "explicit", f"{norm.path}'s output also feeds {names} (e.g. a residual add)", norm=norm, label=norm.path
            )
        return SmoothingPlan("norm", f"folded into {norm.kind} {norm.path}", norm=norm, label=norm.path)
    outside = _terminal_users(src) - consumer_nodes
    if outside:
        return SmoothingPlan(
            "none", f"input {src.name} also feeds {', '.join(sorted(u.name for u in outside))}", label=src.name
        )
    producer, path = _channel_producer(src, {layer.node: layer for layer in all_layers})
    if producer is None or producer in consumers:
        return SmoothingPlan(
            "none", f"input {src.name} has no norm or linear producer that can absorb 1/s", label=src.name
        )
    width = producer.weight_node.meta["val"].shape[1 if producer.transposed else 0]
    if width != consumers[0].in_features or len(producer.node.users) != 1:
        return SmoothingPlan(
            "none",
            f"{producer.path} has {width} outputs but the consumers read "
            f"{consumers[0].in_features} channels (e.g. grouped-query attention)",
            label=producer.path,
        )
    return SmoothingPlan(
        "linear",
        f"folded into the output rows of {producer.path}",
        producer=producer,
        label=producer.path,
        path_nodes=path,
    )
