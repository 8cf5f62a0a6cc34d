"""KV-cache attention as one ONNX Runtime ``GroupQueryAttention`` node, found in the captured graph.

transformers writes a cached attention step as ``present = cat([past, new], dim=2)`` for keys and
values, the KV heads repeated to the query heads (``repeat_kv``: unsqueeze, expand, reshape) or
``enable_gqa``, and ``scaled_dot_product_attention(q, K, V, mask, scale)``. Exported as is, that is
a dozen ONNX nodes per layer; ORT's contrib ``GroupQueryAttention`` does the concatenation, the
head sharing, the causal mask and the softmax in one kernel (as emitted here: 0.56-0.80x of the
plain ops' time per decode step, benchmarks/attention_ops.py).

The match is strict: both caches must be ``cat`` along the length axis and returned as the
graph's ``present`` (or sliced to a sliding window first); anything else (eager attention with
soft-capping, ALiBi written as ``baddbmm``, a non-causal step, dropout) is left as plain ops and
named in the export's notes.
Rotary embeddings stay outside the node (already applied to ``q`` and ``new``), and the model's
own mask goes in as ``attention_bias``, so padding, sliding windows and any other masking are
exactly transformers'. The node runs with ``seqlens_k = T - 1`` and ``query_seqlens = S`` for
every row: then its ``present`` is exactly ``cat([past, new])`` for left-padded batches and for
batched chunks with a past (checked against the eager graph in tests/test_causal_lm.py).
"""

from __future__ import annotations

import operator
import sys
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch.fx import Graph, GraphModule, Node

from qcompiler.ir.graph import module_path
from qcompiler.ir.op_registry import OpSpec, call_op, register

__all__ = ["kv_cache_attention", "fuse_kv_cache_attention"]

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_CAT = aten.cat.default


@torch.library.custom_op("qc::kv_cache_attention", mutates_args=())
def kv_cache_attention(
    query: Tensor, key: Tensor, value: Tensor, past_key: Tensor, past_value: Tensor, bias: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``(sdpa(query, K, V, bias, scale), K, V)`` with ``K = cat([past_key, key], 2)`` (same for V)
    and the KV heads shared by consecutive query heads, as transformers' ``repeat_kv``.

    ``query`` [B, H, S, D]; ``key``/``value`` [B, Hkv, S, D]; ``past_*`` [B, Hkv, P, D]; ``bias``
    additive (0 where a key is seen, the dtype's minimum where masked), [B or 1, H or 1, S, P + S]."""
    keys, values = torch.cat([past_key, key], 2), torch.cat([past_value, value], 2)
    rep = query.shape[1] // keys.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1), attn_mask=bias, scale=scale
    )
    return out, keys, values


@kv_cache_attention.register_fake
def _kv_cache_attention_fake(query, key, value, past_key, past_value, bias, scale):
    return (
        query.new_empty((*query.shape[:3], value.shape[3])),
        torch.cat([past_key, key], 2),
        torch.cat([past_value, value], 2),
    )


register(OpSpec("kv_cache_attention", export_only="onnx"))  # export-only (the artifact writer refuses it)


@dataclass(frozen=True)
class _Match:
    sdpa: Node
    query: Node
    key_cache: Node  # cat([past_key, key], 2)
    value_cache: Node
    mask: Node
    scale: float


def _is_identity_slice(node: Node) -> bool:
    """``x[:, :, ...]`` along one dim, as export writes full slices: start 0, end past any size."""
    if node.target != aten.slice.Tensor:
        return False
    start = node.args[2] if len(node.args) > 2 else node.kwargs.get("start", 0)
    end = node.args[3] if len(node.args) > 3 else node.kwargs.get("end", None)
    step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
    return start in (0, None) and (end is None or (isinstance(end, int) and end >= sys.maxsize)) and step == 1


def _through_slices(node) -> Node:
    while isinstance(node, Node) and _is_identity_slice(node):
        node = node.args[0]
    return node


def _shape(node: Node) -> Optional[tuple]:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _same_size(a, b) -> bool:
    return a == b if isinstance(a, int) and isinstance(b, int) else str(a) == str(b)


def _cache_behind(node, query_heads: int) -> Optional[Node]:
    """The ``cat([past, new], 2)`` node ``node`` reads, directly or through ``repeat_kv``."""
    node = _through_slices(node)
    if not isinstance(node, Node):
        return None
    if node.target in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        expand = _through_slices(node.args[0])
        if not (isinstance(expand, Node) and expand.target == aten.expand.default):
            return None
        unsqueeze = _through_slices(expand.args[0])
        if not (isinstance(unsqueeze, Node) and unsqueeze.target == aten.unsqueeze.default and unsqueeze.args[1] == 2):
            return None
        cache = _through_slices(unsqueeze.args[0])
        grouped, out = _shape(expand), _shape(node)
        if grouped is None or out is None or len(grouped) != 5 or len(out) != 4:
            return None
        b, kv, rep, t, d = grouped
        if not (
            isinstance(kv, int)
            and isinstance(rep, int)
            and kv * rep == out[1] == query_heads
            and _same_size(out[0], b)
            and _same_size(out[2], t)
            and _same_size(out[3], d)
        ):
            return None
        node = cache
    if not (isinstance(node, Node) and node.target == _CAT and len(node.args[0]) == 2):
        return None
    dim = node.args[1] if len(node.args) > 1 else 0
    shape = _shape(node)
    return node if shape is not None and len(shape) == 4 and dim in (2, -2) else None


def _returned(node: Node, outputs: set[Node], depth: int = 4) -> bool:
    """``node`` is a graph output, or slices of it are (a sliding-window cache keeps its last W - 1)."""
    return node in outputs or (
        depth > 0
        and any(user.target == aten.slice.Tensor and _returned(user, outputs, depth - 1) for user in node.users)
    )


def _match(node: Node, outputs: set[Node]) -> tuple[Optional[_Match], str]:
    """The fusable pieces of one sdpa node, or None and why not."""
    args = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), node.args))
    args.update(node.kwargs)
    if args.get("dropout_p", 0.0) or args.get("is_causal", False):
        return None, "dropout or is_causal attention"
    q_shape = _shape(args["query"])
    if q_shape is None or len(q_shape) != 4 or not isinstance(q_shape[1], int) or not isinstance(q_shape[3], int):
        return None, "query is not [batch, heads, sequence, head_size] with static heads and head size"
    heads, head_size = q_shape[1], q_shape[3]
    caches = [_cache_behind(args[name], heads) for name in ("key", "value")]  # enable_gqa: the cat itself
    if any(c is None for c in caches):
        return None, "keys/values are not cat([past, new], dim=2) of the KV cache"
    if not all(_returned(c, outputs) for c in caches):
        return None, "the concatenated keys/values are not returned as the present cache"
    k_shape, v_shape = _shape(caches[0]), _shape(caches[1])
    if not (
        isinstance(k_shape[1], int)
        and k_shape[1] == v_shape[1]
        and heads % k_shape[1] == 0
        and k_shape[3] == v_shape[3] == head_size
    ):
        return (
            None,
            f"KV heads {k_shape[1]}/{v_shape[1]} or head sizes {k_shape[3]}/{v_shape[3]} do not fit "
            f"{heads} query heads of size {head_size}",
        )
    new_shapes = [_shape(c.args[0][1]) for c in caches]
    if any(n is None or not _same_size(n[2], q_shape[2]) for n in new_shapes):
        return None, "the new keys/values do not have the query's length (not self-attention over the cache)"
    mask = args.get("attn_mask")
    if mask is None:
        return None, "no attention mask (the fused node is always causal)"
    m_shape = _shape(mask)
    if m_shape is None or len(m_shape) != 4 or m_shape[1] not in (1, heads):
        return None, f"mask shape {m_shape} is not [batch or 1, 1 or heads, sequence, total]"
    scale = args.get("scale")
    return _Match(
        node, args["query"], caches[0], caches[1], mask, float(scale) if scale is not None else head_size**-0.5
    ), ""


def _fuse(graph: Graph, m: _Match, bias: Node) -> None:
    (past_key, new_key), (past_value, new_value) = m.key_cache.args[0], m.value_cache.args[0]
    with graph.inserting_before(m.sdpa):
        fused = call_op(
            graph,
            "kv_cache_attention",
            query=m.query,
            key=new_key,
            value=new_value,
            past_key=past_key,
            past_value=past_value,
            bias=bias,
            scale=m.scale,
        )
        out, present_key, present_value = (graph.call_function(operator.getitem, (fused, i)) for i in range(3))
    fused.meta["nn_module_stack"] = m.sdpa.meta.get("nn_module_stack", {})
    fused.meta["val"] = (m.sdpa.meta.get("val"), m.key_cache.meta.get("val"), m.value_cache.meta.get("val"))
    for node, val in ((out, m.sdpa), (present_key, m.key_cache), (present_value, m.value_cache)):
        node.meta["val"] = val.meta.get("val")
    m.sdpa.replace_all_uses_with(out)
    graph.erase_node(m.sdpa)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for cache, present in ((m.key_cache, present_key), (m.value_cache, present_value)):  # users after the fused node
        cache.replace_all_uses_with(present, delete_user_cb=lambda user, at=order[present]: order[user] > at)


def _additive(graph: Graph, m: _Match) -> Node:
    """The mask as the additive bias the fused node takes (a bool mask: 0 / the dtype's minimum,
    finite so that a fully masked padding row stays finite, as transformers' own sdpa masks)."""
    if m.mask.meta["val"].dtype != torch.bool:
        return m.mask
    dtype = m.query.meta["val"].dtype
    with graph.inserting_before(m.sdpa):  # the first layer reading the mask; later layers share the bias
        zero = graph.call_function(aten.scalar_tensor.default, (0.0,), {"dtype": dtype})
        masked = graph.call_function(aten.scalar_tensor.default, (torch.finfo(dtype).min,), {"dtype": dtype})
        return graph.call_function(aten.where.self, (m.mask, zero, masked))


def _propagate_shapes(gm: GraphModule, example_inputs: tuple[tuple, dict]) -> None:
    """Shapes on every node (``meta["val"]``), from fake tensors run through the graph: a graph
    reloaded from an artifact has none (the safe format stores no node metadata)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._pytree import tree_flatten_spec
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    flat = tree_flatten_spec(example_inputs, gm._in_spec)
    FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(t) if isinstance(t, Tensor) else t for t in flat])


def fuse_kv_cache_attention(gm: GraphModule, example_inputs: Optional[tuple[tuple, dict]] = None) -> list[str]:
    """Replace every fusable cached sdpa of ``gm`` (in place) by ``qc.kv_cache_attention``; notes
    saying how many were fused and why the others were not. ``example_inputs`` (args, kwargs):
    used to recover node shapes when the graph has none."""
    graph = gm.graph
    sdpas = [n for n in graph.nodes if n.op == "call_function" and n.target == _SDPA]
    if example_inputs is not None and any("val" not in n.meta for n in sdpas):
        _propagate_shapes(gm, example_inputs)
    outputs = set(next(n for n in graph.nodes if n.op == "output").all_input_nodes)
    fused, skipped, biases = 0, [], {}
    for node in sdpas:
        match, reason = _match(node, outputs)
        if match is None:
            skipped.append(f"{module_path(node) or node.name}: {reason}")
            continue
        key = (match.mask, match.query.meta["val"].dtype)
        if key not in biases:
            biases[key] = _additive(graph, match)
        _fuse(graph, match, biases[key])
        fused += 1
    graph.eliminate_dead_code()
    gm.recompile()
    if not sdpas:
        return ["plain-op attention: no scaled_dot_product_attention in the graph (the model's eager attention)"]
    notes = [f"{fused} attention layer(s) as com.microsoft GroupQueryAttention"] if fused else []
    return notes + [f"plain-op attention in {s}" for s in skipped]
