"""An FP8 KV cache: keys and values stored as e4m3 with one calibrated scale per tensor and
attention layer — what vLLM calls the default starting point for serving (``kv_cache_dtype="fp8"``),
with any weight scheme before it.

Each attention (``aten.scaled_dot_product_attention``) reads its keys and values through
``qc.fp8_kv_quant``, whose scale is ``max|k| / 448`` (``max|v| / 448``) over the calibration data —
post-rotary keys, as the cache holds them. Quantizing at the attention's input is what the cache
stores: the op is idempotent, and with a cache the past positions pass through it unchanged. The
scales go to compressed-tensors checkpoints as each attention module's ``k_scale`` / ``v_scale``
under ``kv_cache_scheme`` (docs/formats.md), which vLLM and transformers read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.fx import GraphModule, Node

from qcompiler.errors import QuantizationError
from qcompiler.ir.op_registry import call_op
from qcompiler.ir.tensors import set_tensor
from qcompiler.pipeline.pass_base import GraphProperty, Pass, PassContext
from qcompiler.pipeline.sensitivity import StoredWeights, first_output

__all__ = ["FP8KVCache"]

_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def attention_path(node: Node) -> str:
    """The attention module an sdpa node belongs to (its innermost module), e.g. ``model.layers.0.self_attn``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        raise QuantizationError(f"node {node.name}: no module path to name its k_scale / v_scale by")
    return list(stack.values())[-1][0]


class _KeyValueAmax(StoredWeights):
    """The whole graph, recording max|k| and max|v| at each attention's input."""

    def __init__(self, gm: GraphModule):
        super().__init__(gm)
        self.amax: dict[str, list[float]] = {}
        self.device = torch.device("cpu")  # where the keys were: the scales go there (weights may be on disk)

    def run_node(self, n: Node):
        if n.op == "call_function" and n.target is _SDPA:
            k, v = (self.env[a] for a in n.args[1:3])
            seen = self.amax.setdefault(n.name, [0.0, 0.0])
            seen[0] = max(seen[0], float(k.detach().abs().amax()))
            seen[1] = max(seen[1], float(v.detach().abs().amax()))
            self.device = k.device
        return super().run_node(n)


@dataclass(frozen=True)
class FP8KVCache(Pass):
    """Every attention reads e4m3 keys and values with calibrated per-tensor scales."""

    needs_calibration: ClassVar = True
    provides: ClassVar = frozenset({GraphProperty.FP8_KV_CACHE})
    noop_after: ClassVar = frozenset({GraphProperty.FP8_KV_CACHE})

    def run(self, gm: GraphModule, ctx: PassContext) -> bool:
        """Calibrate each attention's key and value range, then insert the FP8 rounding before it."""
        sdpas = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _SDPA]
        if not sdpas:
            raise QuantizationError("FP8KVCache found no attention (scaled_dot_product_attention) in the graph")
        paths = {n.name: attention_path(n) for n in sdpas}
        if len(set(paths.values())) != len(sdpas):
            raise QuantizationError("FP8KVCache: two attentions share one module; their k/v scales would collide")
        runner = _KeyValueAmax(gm)
        for i, batch in enumerate(ctx.calibration):
            first_output(runner, batch)
            ctx.log(f"FP8KVCache: calibration batch {i + 1}/{len(ctx.calibration)}")
        for node in sdpas:
            path, figures = paths[node.name], {}
            for index, kind, amax in zip((1, 2), ("k", "v"), runner.amax[node.name]):
                scale = torch.tensor([max(amax, 1e-12) / 448.0], dtype=torch.float32, device=runner.device)
                set_tensor(gm, f"{path}.{kind}_scale", scale)
                with gm.graph.inserting_before(node):
                    attr = gm.graph.get_attr(f"{path}.{kind}_scale")
                    quantized = call_op(gm.graph, "fp8_kv_quant", x=node.args[index], scale=attr)
                node.update_arg(index, quantized)
                figures[f"{kind}_scale"] = scale.item()
            ctx.record.layers[path] = figures
        ctx.log(f"FP8KVCache: {len(sdpas)} attentions read an FP8 cache (per-tensor k/v scales)")
        return True
