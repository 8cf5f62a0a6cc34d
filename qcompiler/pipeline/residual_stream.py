"""Which nodes carry the residual stream, and what reads and writes it: everything a rotation of
the stream has to touch (``passes/rotate.py``).

Walking the graph in order from the token embeddings, a value is *on the stream* when it is an
embedding, a sum of stream values, or a stream value passed through an operation that commutes
with an orthogonal map of the channels: casts, views and slices that keep the channel dimension,
a scalar factor, a per-token factor (RMSNorm's ``rsqrt(mean(x²) + eps)``: ``mean(x²)`` over the
channels is the one use of ``x²`` allowed, and a rotation does not change it). Around it:

- **writers**: linears whose output is added into the stream (o_proj, down_proj): their output
  rows are rotated. A value added that is no linear's output (Gemma-2's post-norms) is listed in
  ``added``: it needs an online rotation in front of the add;
- **norms**: a per-channel factor on the stream (RMSNorm's ``γ``, Gemma's ``1 + γ``); its output may
  only reach linears, which absorb it (``γ`` becomes 1) before their columns are rotated;
- **readers**: the linears that read the stream (q/k/v, gate/up, a router, lm_head).

Anything else that reads the stream stops the plan with one line naming the node: a LayerNorm
(it subtracts the channel mean, which a rotation does not keep), a norm whose output also
continues the stream (post-LN models such as BERT), a graph output that returns hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.utils._pytree as pytree
from torch.fx import GraphModule, Node

from qcompiler.errors import QuantizationError
from qcompiler.ir.graph import LinearLayer, aten, module_path

__all__ = ["RotationError", "StreamNorm", "StreamPlan", "plan_stream"]


class RotationError(QuantizationError):
    """A graph whose residual stream cannot be rotated exactly (the message names the node)."""


@dataclass
class StreamNorm:
    """A per-channel factor on the stream: ``x · (γ + offset)`` (offset 1 for Gemma's ``1 + γ``)."""

    node: Node
    weight: Node  # get_attr of γ
    offset: float
    path: str


@dataclass
class StreamPlan:
    """What rotating the stream touches (see the module docstring)."""

    width: int
    embeddings: list[tuple[Node, Node]] = field(default_factory=list)  # (aten.embedding node, its table's get_attr)
    writers: list[LinearLayer] = field(default_factory=list)
    added: list[tuple[Node, Node]] = field(default_factory=list)  # (add node, the operand to rotate online)
    readers: list[tuple[LinearLayer, Optional[StreamNorm]]] = field(default_factory=list)
    norms: list[StreamNorm] = field(default_factory=list)


_SAME = {  # value-preserving per channel
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.to.device,
    aten._to_copy.default,
    aten.clone.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.detach.default,
    aten.dropout.default,
}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_DIM_OPS = {aten.slice.Tensor, aten.select.int, aten.unsqueeze.default}  # (x, dim, ...)
_IGNORED = {aten._assert_tensor_metadata.default, aten.sym_size.int}


def _val(node) -> Optional[object]:
    return node.meta.get("val") if isinstance(node, Node) else None


def _is_last(dim: int, ndim: int) -> bool:
    return dim % ndim == ndim - 1


def _where(node: Node) -> str:
    path = module_path(node)
    return f"node {node.name} ({node.target})" + (f" in {path}" if path else "")


def _norm_weight(other: Node) -> Optional[tuple[Node, float]]:
    """``γ`` (a get_attr, maybe cast) or ``γ + c`` → (γ's get_attr, c); else None."""
    offset = 0.0
    if other.op == "call_function" and other.target is aten.add.Tensor and isinstance(other.args[1], (int, float)):
        offset, other = float(other.args[1]), other.args[0]
    while isinstance(other, Node) and other.op == "call_function" and other.target in _SAME:
        other = other.args[0]
    return (other, offset) if isinstance(other, Node) and other.op == "get_attr" else None


class _Walk:
    def __init__(self, gm: GraphModule, layers: list[LinearLayer]):
        self.by_node = {layer.node: layer for layer in layers}
        self.on: set[Node] = set()  # values on the stream
        self.squares: set[Node] = set()  # x² of a stream value
        self.scaled: dict[Node, StreamNorm] = {}  # stream values after a norm's γ (until a linear absorbs it)
        self.plan = StreamPlan(width=-1)
        self.gm = gm

    def status(self, a) -> bool:
        return isinstance(a, Node) and (a in self.on or a in self.squares)

    def run(self) -> StreamPlan:
        for node in self.gm.graph.nodes:
            if node.op == "output":
                for a in pytree.tree_leaves(node.args):
                    if isinstance(a, Node) and a in self.on:
                        raise RotationError(
                            f"the graph returns the residual stream ({a.name}, e.g. hidden states): "
                            "rotating it would change that output"
                        )
            elif node.op == "call_function":
                self.visit(node)
        if not self.plan.embeddings:
            raise RotationError("no token embedding (aten.embedding of a stored table) starts a residual stream")
        if not self.plan.writers and not self.plan.added:
            raise RotationError("nothing is added into the stream after the embeddings: no residual stream found")
        return self.plan

    def visit(self, node: Node) -> None:
        t = node.target
        if t is aten.embedding.default and isinstance(node.args[0], Node) and node.args[0].op == "get_attr":
            width = _val(node).shape[-1]
            if self.plan.width not in (-1, width):
                raise RotationError(f"{_where(node)}: embeddings of widths {self.plan.width} and {width}")
            self.plan.width = width
            self.plan.embeddings.append((node, node.args[0]))
            self.on.add(node)
            return
        if not any(self.status(a) for a in node.all_input_nodes) or t in _IGNORED:
            return
        x = node.args[0] if node.args else None
        if t in _SAME or t is aten.type_as.default:
            if x in self.on:
                self._keep(node, x)
            return
        if t in _VIEWS or t in _DIM_OPS or t is aten.expand.default:
            self._view(node, x)
        elif t is aten.pow.Tensor_Scalar and x in self.on and node.args[1] == 2:
            if x in self.scaled:
                self._refuse(node, "squares a value scaled by a norm")
            self.squares.add(node)
        elif t is aten.mean.dim and x in self.squares:
            if [d % _val(x).dim() for d in node.args[1]] != [_val(x).dim() - 1]:
                self._refuse(node, "averages x² over other dimensions than the channels")
        elif t is aten.mul.Tensor:
            self._mul(node)
        elif t is aten.add.Tensor:
            self._add(node)
        elif node in self.by_node and self.by_node[node].input in self.on:
            reader = self.by_node[node]
            self.plan.readers.append((reader, self.scaled.get(reader.input)))
        elif t is aten.layer_norm.default:
            self._refuse(node, "is a LayerNorm: it subtracts the channel mean, which a rotation does not keep")
        else:
            self._refuse(node, "reads the residual stream and does not commute with a rotation")

    def _refuse(self, node: Node, why: str):
        raise RotationError(f"{_where(node)} {why}")

    def _keep(self, node: Node, x: Node) -> None:
        self.on.add(node)
        if x in self.scaled:
            self.scaled[node] = self.scaled[x]

    def _view(self, node: Node, x: Node) -> None:
        if x in self.squares or x not in self.on:
            self._refuse(node, "reshapes x² of the stream")
        src, out = _val(x), _val(node)
        if node.target in _DIM_OPS:
            if _is_last(node.args[1], out.dim() if node.target is aten.unsqueeze.default else src.dim()):
                self._refuse(node, "indexes the channel dimension")
        elif out.shape[-1] != src.shape[-1]:
            self._refuse(node, "changes the channel dimension")
        self._keep(node, x)

    def _mul(self, node: Node) -> None:
        a, b = node.args
        if self.status(a) and self.status(b) or a in self.squares or b in self.squares:
            self._refuse(node, "multiplies two values of the stream")
        x, other = (a, b) if self.status(a) else (b, a)
        v = _val(other)
        if not isinstance(other, Node) or v is None or v.dim() == 0 or v.shape[-1] == 1:
            self._keep(node, x)  # a scalar or per-token factor commutes with the rotation
            return
        found = _norm_weight(other) if v.shape[-1] == self.plan.width else None
        if found is None:
            self._refuse(node, "multiplies the stream by a per-channel tensor that is not a norm's weight")
        if x in self.scaled:
            self._refuse(node, f"scales the stream a second time after {self.scaled[x].path}")
        norm = StreamNorm(node, found[0], found[1], module_path(node))
        self.plan.norms.append(norm)
        self.on.add(node)
        self.scaled[node] = norm

    def _add(self, node: Node) -> None:
        a, b = node.args[:2]
        for operand in (a, b):
            if operand in self.scaled:
                self._refuse(
                    node,
                    f"adds the output of norm {self.scaled[operand].path} back into the stream (a post-norm): "
                    "its weight cannot be folded into linears",
                )
            if operand in self.squares:
                self._refuse(node, "adds x² of the stream")
        if a in self.on and b in self.on:
            self.on.add(node)
            return
        other = b if a in self.on else a
        if not isinstance(other, Node) or node.kwargs.get("alpha", 1) != 1:
            self._refuse(node, "adds a constant to the stream")
        writer = self._writer(other)
        if writer is not None:
            self.plan.writers.append(writer)
        else:
            self.plan.added.append((node, other))
        self.on.add(node)

    def _writer(self, node: Node) -> Optional[LinearLayer]:
        """The linear whose output (through per-channel no-ops, used only here) is ``node``."""
        while len(node.users) == 1:
            if node in self.by_node:
                return self.by_node[node]
            if node.op != "call_function" or node.target not in _SAME:
                return None
            node = node.args[0]
        return None


def plan_stream(gm: GraphModule, layers: list[LinearLayer]) -> StreamPlan:
    """The residual stream's embeddings, writers, norms and readers, or a RotationError naming
    the node that prevents an exact rotation."""
    return _Walk(gm, layers).run()
