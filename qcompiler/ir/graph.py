"""Graph helpers every pass shares: linears, their producing norms and siblings, blocks.

Structure is matched, not names: a linear's input is walked back through value-preserving nodes
(dropout in eval, dtype casts, flattening views) to the node that really produces it; a
LayerNorm is one ``aten.layer_norm`` node, an RMSNorm is ``aten.rms_norm`` or its decomposed form
``weight * (h * rsqrt(mean(h²) + eps))`` as Hugging Face writes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch.fx import GraphModule, Node

# get_tensor / set_tensor / drop_attr_if_unused live in ir/tensors.py; imported here too so passes written
# against the old ``qcompiler.graph`` keep working.
from qcompiler.ir.tensors import drop_attr_if_unused, get_raw_tensor, get_tensor, set_tensor  # noqa: F401

__all__ = [
    "module_path",
    "LinearLayer",
    "NormInfo",
    "find_linears",
    "source_of",
    "find_producing_norm",
    "rms_norm_parts",
    "find_siblings",
    "producer_groups",
    "ProducerGroup",
    "transformer_blocks",
    "block_of",
    "contiguous_before_reshape",
    "aten",
]

aten = torch.ops.aten

_PASSTHROUGH = {
    aten.dropout.default,
    aten.clone.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.to.dtype,
    aten._to_copy.default,
    aten.to.dtype_layout,
    aten.type_as.default,  # Gemma's RMSNorm casts back with x.type_as(input)
}
_FLATTEN = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def module_path(node: Node) -> str:
    """The dotted path of the innermost module that created ``node`` ('' at top level)."""
    if node.op == "get_attr":
        return str(node.target).rsplit(".", 1)[0] if "." in str(node.target) else ""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _cls in reversed(list(stack.values())):
        if path and not path.startswith("_"):
            return path
    return ""


def contiguous_before_reshape(graph: torch.fx.Graph) -> int:
    """Insert a contiguous copy between a transpose/permute and the reshape/view that reads it; returns
    how many. Re-tracing with symbolic shapes (the ONNX exporter) cannot always prove that the
    transposed tensor needs a copy and decomposes the reshape into a view that then fails (T5's
    attention output). In ONNX the copy is free: tensors have no strides."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.reshape.default, aten.view.default):
            continue
        src = node.args[0]
        if (
            isinstance(src, Node)
            and src.op == "call_function"
            and src.target in (aten.transpose.int, aten.permute.default)
        ):
            with graph.inserting_before(node):
                copy = graph.call_function(aten.clone.default, (src,), {"memory_format": torch.contiguous_format})
                node.replace_input_with(src, copy)
            count += 1
    return count


@dataclass
class LinearLayer:
    """One linear layer in the graph: ``y = x @ weight.T + bias``."""

    node: Node  # aten.linear, or aten.addmm for GPT-2's Conv1D
    path: str  # module path, e.g. "model.layers.3.self_attn.q_proj"
    input: Node  # the activation the node reads
    weight_node: Node  # get_attr of the stored weight
    bias_node: Optional[Node]
    transposed: bool  # stored weight is [in, out] (Conv1D) instead of [out, in]

    def weight(self, gm: GraphModule) -> torch.Tensor:
        """The weight as ``[out_features, in_features]`` (a view of the stored tensor)."""
        w = get_tensor(gm, self.weight_node.target)
        return w.t() if self.transposed else w

    def weight_shape(self, gm: GraphModule) -> tuple[int, int]:
        """``(out, in)`` from what is stored, without reading it (a streamed weight's placeholder)."""
        shape = get_raw_tensor(gm, self.weight_node.target).shape
        return (shape[1], shape[0]) if self.transposed else (shape[0], shape[1])

    def bias(self, gm: GraphModule) -> Optional[torch.Tensor]:
        """The layer's bias tensor, or None."""
        return None if self.bias_node is None else get_tensor(gm, self.bias_node.target)

    @property
    def in_features(self) -> int:
        """The layer's input width."""
        return self.weight_node.meta["val"].shape[0 if self.transposed else 1] if "val" in self.weight_node.meta else -1


def _is_attr(node) -> bool:
    return isinstance(node, Node) and node.op == "get_attr"


def find_linears(gm: GraphModule) -> list[LinearLayer]:
    """Every linear layer whose weight is a stored tensor, in graph order."""
    layers = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.linear.default and _is_attr(node.args[1]):
            bias = node.args[2] if len(node.args) > 2 and _is_attr(node.args[2]) else None
            path = module_path(node) or module_path(node.args[1])  # a reloaded graph has no module stack
            layers.append(LinearLayer(node, path, node.args[0], node.args[1], bias, False))
        elif (
            node.target is aten.addmm.default and _is_attr(node.args[2]) and _is_attr(node.args[0]) and not node.kwargs
        ):  # Conv1D: addmm(bias, x2d, weight[in, out])
            path = module_path(node) or module_path(node.args[2])
            layers.append(LinearLayer(node, path, node.args[1], node.args[2], node.args[0], True))
    for layer in layers:
        if "val" not in layer.weight_node.meta:
            layer.weight_node.meta["val"] = get_tensor(gm, layer.weight_node.target)
    return layers


_TRANSPOSES = (aten.numpy_T.default, aten.t.default)


def canonicalize_linears(gm: GraphModule) -> int:
    """Rewrite ``matmul(x, W.T)`` with a stored 2-D ``W`` (Falcon's ``FalconLinear``, any hand-written
    ``x @ self.weight.T``) as ``aten.linear(x, W)``, the same math, so that passes see the layer.
    Returns how many were rewritten."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.matmul.default:
            continue
        x, rhs = node.args[0], node.args[1]
        if not (
            isinstance(rhs, Node)
            and rhs.op == "call_function"
            and rhs.target in _TRANSPOSES
            and _is_attr(rhs.args[0])
            and len(rhs.users) == 1
        ):
            continue
        weight = get_raw_tensor(gm, rhs.args[0].target)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        with gm.graph.inserting_before(node):
            linear = gm.graph.call_function(aten.linear.default, (x, rhs.args[0]))
        linear.meta.update(node.meta)
        node.replace_all_uses_with(linear)
        gm.graph.erase_node(node)
        gm.graph.erase_node(rhs)
        count += 1
    if count:
        gm.recompile()
    return count


def _keeps_last_dim(node: Node) -> bool:
    src, out = node.args[0].meta.get("val"), node.meta.get("val")
    return src is not None and out is not None and src.shape[-1] == out.shape[-1]


def source_of(node: Node) -> Node:
    """Walk back through nodes that do not change values per feature (eval dropout, casts, views)."""
    while node.op == "call_function":
        if node.target in _PASSTHROUGH and not (node.target is aten.dropout.default and node.args[2]):
            node = node.args[0]
        elif node.target in _FLATTEN and _keeps_last_dim(node):
            node = node.args[0]
        else:
            break
    return node


@dataclass
class NormInfo:
    """A normalization that produces a linear's input; ``weight``/``bias`` are get_attr nodes."""

    kind: str  # "layer_norm" or "rms_norm"
    output: Node  # the node whose value the consumers read
    weight_node: Optional[Node]
    bias_node: Optional[Node]
    path: str
    offset: float = 0.0  # the norm scales by offset + weight (Gemma's RMSNorm: 1 + w)


def _rms_core(node: Node) -> bool:
    """``h * rsqrt(mean(h^2) + eps)`` (either operand order, optional cast around it)."""
    node = source_of(node)
    if node.op != "call_function" or node.target is not aten.mul.Tensor:
        return False
    for a in node.args:
        if isinstance(a, Node) and a.op == "call_function" and a.target is aten.rsqrt.default:
            inner = a.args[0]
            if inner.op == "call_function" and inner.target is aten.add.Tensor:
                inner = inner.args[0]
            return inner.op == "call_function" and inner.target is aten.mean.dim
    return False


def find_producing_norm(node_or_layer) -> Optional[NormInfo]:
    """The LayerNorm / RMSNorm whose output is this linear's input, or None."""
    start = node_or_layer.input if isinstance(node_or_layer, LinearLayer) else node_or_layer
    src = source_of(start)
    if src.op != "call_function":
        return None
    if src.target is aten.layer_norm.default:
        weight = src.args[2] if len(src.args) > 2 and _is_attr(src.args[2]) else None
        bias = src.args[3] if len(src.args) > 3 and _is_attr(src.args[3]) else None
        return NormInfo("layer_norm", src, weight, bias, module_path(src))
    if src.target is aten.rms_norm.default:
        weight = src.args[2] if len(src.args) > 2 and _is_attr(src.args[2]) else None
        return NormInfo("rms_norm", src, weight, None, module_path(src))
    if src.target is aten.mul.Tensor and len(src.args) == 2:
        a, b = src.args
        for scale, core in ((a, b), (b, a)):
            weight, offset = _affine_weight(scale)
            if weight is not None and isinstance(core, Node) and _rms_core(core):
                return NormInfo("rms_norm", src, weight, None, module_path(src), offset)
    return None


def _affine_weight(node) -> tuple[Optional[Node], float]:
    """``(w, c)`` when ``node`` is a stored weight ``w`` scaled as ``c + w`` — ``w`` itself (c = 0),
    cast to float32, or ``add(w, c)`` as Gemma's ``1.0 + weight.float()`` — else ``(None, 0)``."""
    offset = 0.0
    if _is_call(node, aten.add.Tensor, 2) and isinstance(node.args[1], float):
        node, offset = node.args[0], node.args[1]
    if _is_call(node, aten.to.dtype, 2):
        node = node.args[0]
    return (node, offset) if _is_attr(node) else (None, 0.0)


def _is_call(node, target, n_args: int) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target == target and len(node.args) == n_args


def rms_norm_parts(x: Node):
    """``(h, weight node, eps, norm dtype)`` when ``x`` is exactly the captured RMSNorm
    ``weight · (to_f32(h) · rsqrt(mean(to_f32(h)², [-1], keepdim) + eps)).to(dtype)``, else None."""
    if not _is_call(x, aten.mul.Tensor, 2):
        return None
    weight, cast = x.args
    if not (isinstance(weight, Node) and weight.op == "get_attr" and _is_call(cast, aten.to.dtype, 2)):
        return None
    scaled, norm_dtype = cast.args
    if not (_is_call(scaled, aten.mul.Tensor, 2) and _is_call(scaled.args[1], aten.rsqrt.default, 1)):
        return None
    hf, add = scaled.args[0], scaled.args[1].args[0]
    if not (_is_call(add, aten.add.Tensor, 2) and isinstance(add.args[1], float)):
        return None
    mean = add.args[0]
    if not (_is_call(mean, aten.mean.dim, 3) and list(mean.args[1]) == [-1] and mean.args[2] is True):
        return None
    square = mean.args[0]
    if not (_is_call(square, aten.pow.Tensor_Scalar, 2) and square.args == (hf, 2)):
        return None
    if not (_is_call(hf, aten.to.dtype, 2) and hf.args[1] == torch.float32):
        return None
    return hf.args[0], weight, add.args[1], norm_dtype


def find_siblings(layers: Iterable[LinearLayer], layer: LinearLayer) -> list[LinearLayer]:
    """All linears (``layer`` included) that read the same tensor as ``layer``."""
    src = source_of(layer.input)
    return [other for other in layers if source_of(other.input) is src]


@dataclass
class ProducerGroup:
    """Linears that consume one tensor, with the norm that produced it (if any)."""

    source: Node
    norm: Optional[NormInfo]
    consumers: list[LinearLayer]


def producer_groups(gm: GraphModule, layers: Optional[list[LinearLayer]] = None) -> list[ProducerGroup]:
    """Linears grouped by the tensor they read, in graph order."""
    layers = find_linears(gm) if layers is None else layers
    groups: dict[Node, ProducerGroup] = {}
    for layer in layers:
        src = source_of(layer.input)
        if src not in groups:
            groups[src] = ProducerGroup(src, find_producing_norm(layer), [])
        groups[src].consumers.append(layer)
    return list(groups.values())


_BLOCK = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def is_router(path: str) -> bool:
    """A mixture-of-experts router (``mlp.gate``, ``block_sparse_moe.gate``, ``router``,
    ``shared_expert_gate``): tiny, and its argmax picks the experts, so it stays in full precision
    (as llm-compressor and AutoGPTQ leave it)."""
    leaf = path.rsplit(".", 1)[-1]
    return leaf in ("gate", "router") or leaf.endswith("expert_gate")


def block_of(path: str) -> Optional[str]:
    """The transformer block a module path lies in: the prefix up to its first numeric index."""
    m = _BLOCK.match(path)
    return m.group(1) if m else None


def transformer_blocks(gm: GraphModule) -> dict[str, list[Node]]:
    """Nodes grouped by transformer block (``model.layers.3``, ``encoder.layer.0``, ``transformer.h.1``)."""
    blocks: dict[str, list[Node]] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        block = block_of(module_path(node))
        if block is not None:
            blocks.setdefault(block, []).append(node)
    return blocks
