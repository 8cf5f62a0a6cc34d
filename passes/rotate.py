"""Rotations as a graph pass (QuaRot, Ashkboos et al. 2024): the FP model's output is unchanged,
and the weights (and activations) the quantizers see next are incoherent — no channel stands out.

Three rotations, each exact in real arithmetic (``R`` orthogonal: ``(x R)(W R)ᵀ = x Wᵀ``), each
with a randomized Hadamard ``R`` from ``seed`` (``qcompiler/algorithms/hadamard.py``):

1. **residual** — the whole residual stream is carried in a rotated basis ``Q``: each RMSNorm's
   ``γ`` is folded into the linears that read it, then the embeddings become ``E Q``, every
   reader's columns ``W Q``, every writer's rows ``Qᵀ W`` (and bias ``b Q``). Nothing is added at
   run time unless the model adds a non-linear value into the stream (Gemma-2's post-norms get an
   online rotation there). ``residual=None`` rotates when the graph allows it and otherwise says
   why in the report (a LayerNorm, a post-LN model such as BERT); ``True`` makes that an error.
   Tied embeddings are untied (the head now absorbs the final norm).
2. **heads** — each attention's ``v_proj`` rows and ``o_proj`` columns, head by head
   (``qcompiler/pipeline/value_heads.py``).
3. **online** — every other linear of the transformer blocks (``down_proj``; on models without a
   residual rotation also q/k/v and the MLP's first linear) reads ``qc.hadamard(x)`` — one node per
   shared input — and its columns become ``W R``. Clients without that op (transformers, vLLM,
   GPTQModel) cannot run such a graph: ``Rotate(online=False)`` keeps a checkpoint ordinary.

Recipes: ``rotate-gptq-w4g128``, ``rotate-gptq-w3g128``, ``rotate-rtn-w4g128``, ``rotate-w8a8``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from torch.fx import GraphModule, Node

from qcompiler.algorithms.hadamard import block_size, random_signs, rotation_matrix
from qcompiler.ir.graph import LinearLayer, block_of, find_linears, is_router, module_path, source_of
from qcompiler.ir.op_registry import call_op
from qcompiler.ir.tensors import get_tensor, set_tensor
from qcompiler.pipeline.folding import replace_tensor
from qcompiler.pipeline.pass_base import GraphProperty, Pass, PassContext
from qcompiler.pipeline.residual_stream import RotationError, StreamPlan, plan_stream
from qcompiler.pipeline.value_heads import value_output_pairs

__all__ = ["Rotate"]

MIN_BLOCK = 8  # a narrower Hadamard block mixes too few channels to be worth a rotation


def _refuse_silencing_norms(gm: GraphModule, plan: StreamPlan) -> None:
    """RotationError when a norm on the stream has a gain of exactly 0 on some channel (Gemma-3:
    ``1 + γ = 0`` where its massive activations live). Folded into its readers and rotated, every
    later rounding error lands on the channels that norm silences, multiplied by the largest
    activations of the model: measured on Gemma-3 270M, ``rotate-rtn-w4g128`` KL 19.6 against 0.55
    without rotation, and 0.40 with the heads and online rotations alone (docs/methods/rotation.md)."""
    for norm in plan.norms:
        gain = (get_tensor(gm, norm.weight.target).detach().double() + norm.offset).abs()
        silenced = int((gain <= 1e-6 * float(gain.max())).sum())
        if silenced:
            raise RotationError(
                f"{norm.path} multiplies {silenced} channel(s) by 0 (gain 0 … {float(gain.max()):.3g}): folded "
                "into its readers and rotated, quantization error would land on the activations it silences"
            )


@dataclass(frozen=True)
class Rotate(Pass):
    """Randomized Hadamard rotations of the residual stream, the attention heads and the other
    linears' inputs (the FP output is unchanged)."""

    residual: Optional[bool] = None  # None: rotate the stream where the graph allows it (a note otherwise)
    heads: bool = True
    online: bool = True
    seed: int = 0

    requires: ClassVar = frozenset()
    provides: ClassVar = frozenset({GraphProperty.ROTATED})
    noop_after: ClassVar = frozenset({GraphProperty.QUANTIZED_WEIGHTS, GraphProperty.INT8_LOWERED})

    def __post_init__(self):
        if self.residual not in (None, True, False):
            raise ValueError(f"Rotate: residual must be None, True or False, got {self.residual!r}")

    def run(self, gm: GraphModule, ctx: PassContext) -> bool:
        """Rotate, in order: the residual stream, the value/output heads, the remaining inputs."""
        layers = find_linears(gm)
        covered: set[Node] = set()  # linears whose input is already rotated
        notes = ctx.record.notes
        if self.residual is not False:
            try:
                plan = plan_stream(gm, layers)
                _refuse_silencing_norms(gm, plan)
                if plan.added and not self.online:
                    names = ", ".join(operand.name for _, operand in plan.added[:3])
                    raise RotationError(
                        f"values added into the stream ({names}, ...) need online rotations (online=False)"
                    )
            except RotationError as err:
                if self.residual:
                    raise RotationError(f"Rotate(residual=True): {err}") from None
                notes.append(f"residual stream not rotated: {err}")
            else:
                covered |= self._rotate_stream(gm, plan, ctx)
        if self.heads:
            for pair in value_output_pairs(layers):
                self._rotate_heads(gm, pair.value, pair.output, pair.head_dim)
                covered.add(pair.output.node)
                _mark(ctx, pair.output.path, f"heads ({pair.head_dim})")
                _mark(ctx, pair.value.path, f"heads ({pair.head_dim})")
        if self.online:
            self._rotate_inputs(gm, [layer for layer in layers if layer.node not in covered], ctx)
        if not ctx.record.layers:
            notes.append("nothing was rotated: the graph is unchanged")
            return False
        gm.graph.lint()
        gm.recompile()
        return True

    def _signs(self, width: int, salt: int) -> torch.Tensor:
        return random_signs(width, self.seed * 1_000_003 + salt)

    def _rotate_stream(self, gm: GraphModule, plan: StreamPlan, ctx: PassContext) -> set[Node]:
        width = plan.width
        block = block_size(width)
        if block < MIN_BLOCK:
            ctx.record.notes.append(f"residual stream not rotated: width {width} has a Hadamard block of only {block}")
            return set()
        signs = self._signs(width, 0)
        q = rotation_matrix(signs, block)
        readers = {layer.weight_node.target for layer, _ in plan.readers}
        for node, table in plan.embeddings:
            if table.target in readers:  # a tied head: the embedding gets a table of its own
                target = f"{module_path(node) or node.name}.weight"
                set_tensor(gm, target, get_tensor(gm, table.target).detach().clone(), parameter=True)
                with gm.graph.inserting_before(node):
                    own = gm.graph.get_attr(target)
                own.meta["val"] = table.meta.get("val")
                node.update_arg(0, own)
                ctx.record.notes.append(f"{target}: untied from {table.target} (the head absorbs the final norm)")
                _untie_in_config(gm)
                table = own
            replace_tensor(gm, table.target, (get_tensor(gm, table.target).double() @ q))
        for layer, norm in plan.readers:
            w = layer.weight(gm).double()
            if norm is not None:
                w = w * (get_tensor(gm, norm.weight.target).double() + norm.offset)
            _store_weight(gm, layer, w @ q)
            _mark(ctx, layer.path, "residual (input)")
        for norm in plan.norms:
            gamma = get_tensor(gm, norm.weight.target)
            replace_tensor(gm, norm.weight.target, torch.full_like(gamma, 1.0 - norm.offset))
        for layer in plan.writers:
            _store_weight(gm, layer, q.t() @ layer.weight(gm).double())
            if layer.bias_node is not None:
                replace_tensor(gm, layer.bias_node.target, layer.bias(gm).double() @ q)
            _mark(ctx, layer.path, "residual (output)")
        for i, (add, operand) in enumerate(plan.added):
            online = _insert_hadamard(gm, operand, add, f"{module_path(add) or add.name}.residual{i}", signs, block)
            add.replace_input_with(operand, online)
        ctx.record.notes.append(
            f"residual stream rotated (width {width}, Hadamard blocks of {block}): {len(plan.embeddings)} "
            f"embedding(s), {len(plan.readers)} readers, {len(plan.writers)} writers, {len(plan.norms)} norms folded"
            + (f", {len(plan.added)} online rotations of added values" if plan.added else "")
        )
        return {layer.node for layer, _ in plan.readers}

    def _rotate_heads(self, gm: GraphModule, v: LinearLayer, o: LinearLayer, head_dim: int) -> None:
        r = rotation_matrix(self._signs(head_dim, 1), block_size(head_dim))
        w_v = v.weight(gm).double()
        heads_v = w_v.shape[0] // head_dim
        _store_weight(gm, v, torch.block_diag(*([r.t()] * heads_v)) @ w_v)
        if v.bias_node is not None:
            b = v.bias(gm).double().reshape(heads_v, head_dim) @ r
            replace_tensor(gm, v.bias_node.target, b.reshape(-1))
        w_o = o.weight(gm).double()
        _store_weight(gm, o, w_o @ torch.block_diag(*([r] * (w_o.shape[1] // head_dim))))

    def _rotate_inputs(self, gm: GraphModule, layers: list[LinearLayer], ctx: PassContext) -> None:
        by_input: dict[Node, list[LinearLayer]] = {}
        for layer in layers:
            if block_of(layer.path) is not None and not is_router(layer.path):
                by_input.setdefault(source_of(layer.input), []).append(layer)
        for i, (src, group) in enumerate(by_input.items()):
            width = group[0].in_features
            block = block_size(width)
            if block < MIN_BLOCK:
                ctx.record.notes.append(f"{group[0].path}: input width {width} has a Hadamard block of only {block}")
                continue
            signs = self._signs(width, 2 + i)
            r = rotation_matrix(signs, block)
            online = _insert_hadamard(gm, group[0].input, group[0].node, f"{group[0].path}.hadamard", signs, block)
            for layer in group:
                _store_weight(gm, layer, layer.weight(gm).double() @ r)
                layer.node.replace_input_with(layer.input, online)
                _mark(ctx, layer.path, f"online ({block})")


def _untie_in_config(gm: GraphModule) -> None:
    """Exports write the captured config: it must not tell clients to tie the two tables again."""
    info = gm.meta.get("qcompiler")
    config = getattr(info, "model_config", None)
    if config:
        config["tie_word_embeddings"] = False
        if isinstance(config.get("text_config"), dict):
            config["text_config"]["tie_word_embeddings"] = False


def _mark(ctx: PassContext, path: str, what: str) -> None:
    entry = ctx.record.layers.setdefault(path, {})
    entry["rotation"] = f"{entry['rotation']} + {what}" if "rotation" in entry else what


def _store_weight(gm: GraphModule, layer: LinearLayer, w: torch.Tensor) -> None:
    """Store ``w`` (``[out, in]``) as ``layer``'s weight, in its own layout and dtype."""
    replace_tensor(gm, layer.weight_node.target, w.t() if layer.transposed else w)


def _insert_hadamard(gm: GraphModule, x: Node, consumer: Node, label: str, signs, block: int) -> Node:
    """``qc.hadamard(x)`` just before ``consumer`` (and in its block, for block-wise calibration)."""
    set_tensor(gm, f"{label}_signs", signs)
    with gm.graph.inserting_before(consumer):
        attr = gm.graph.get_attr(f"{label}_signs")
        node = call_op(gm.graph, "hadamard", x=x, signs=attr, block_size=block)
    node.meta.update({k: v for k, v in consumer.meta.items() if k in ("nn_module_stack", "stack_trace")})
    if "val" in x.meta:
        node.meta["val"] = x.meta["val"]
    return node
