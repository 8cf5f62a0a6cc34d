"""Int8 lowering: each block linear becomes ``qc.int8_linear`` (W8A8, int32 accumulation).

``Y = (s_x · X_q)(s_w · W_q)^T = s_x s_w^T ⊙ (X_q W_q^T)``: weights are int8 per output channel
(``s_w = max|W_row|/127``), activations int8 per token at run time (``dynamic_per_token``, the
paper's O1) or with one scale fixed from calibration (``static_per_tensor``, O3). An explicit
SmoothQuant multiply in front of a linear is fused into the op's activation quantizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.fx import GraphModule

from qcompiler.algorithms.int8 import quantize_weight_per_channel
from qcompiler.calib.calibration import CalibrationEngine
from qcompiler.errors import QuantizationError
from qcompiler.ir.graph import LinearLayer, block_of, find_linears
from qcompiler.ir.node_swap import replace_linear
from qcompiler.pipeline.folding import SMOOTH_META
from qcompiler.pipeline.layer_filter import check_patterns, ignore_reason, report_unmatched
from qcompiler.pipeline.pass_base import GraphProperty, Pass, PassContext

__all__ = ["LowerInt8"]

ACTIVATIONS = ("dynamic_per_token", "static_per_tensor")


@dataclass(frozen=True)
class LowerInt8(Pass):
    """Replaces each block linear with ``qc.int8_linear`` (int8 weights and activations)."""

    activations: str = "dynamic_per_token"
    weights: str = "per_channel"
    ignore: tuple[str, ...] = ()  # module paths kept in full precision: globs, or 're:' + a regex

    requires: ClassVar = frozenset()
    provides: ClassVar = frozenset({GraphProperty.INT8_LOWERED})
    noop_after: ClassVar = frozenset({GraphProperty.QUANTIZED_WEIGHTS, GraphProperty.INT8_LOWERED})

    def __post_init__(self):
        object.__setattr__(self, "ignore", check_patterns(self.name, self.ignore))
        if self.activations not in ACTIVATIONS:
            raise QuantizationError(f"activations must be one of {ACTIVATIONS}, got {self.activations!r}")
        if self.weights != "per_channel":
            raise QuantizationError(f"weights must be 'per_channel', got {self.weights!r}")

    @property
    def needs_calibration(self) -> bool:
        """Static activation scales come from calibration data; dynamic ones need none."""
        return self.activations == "static_per_tensor"

    def run(self, gm: GraphModule, ctx: PassContext) -> bool:
        """Replace each block linear with ``qc.int8_linear`` (int8 weights per channel, int8 activations)."""
        candidates = [layer for layer in find_linears(gm) if block_of(layer.path) is not None]
        report_unmatched(self.name, self.ignore, [layer.path for layer in candidates], ctx.record.notes)
        layers = []
        for layer in candidates:
            why = ignore_reason(layer.path, self.ignore)
            if why:
                ctx.record.notes.append(f"{layer.path}: kept in full precision ({why})")
            else:
                layers.append(layer)
        act_scales: dict[str, float] = {}
        if self.activations == "static_per_tensor":
            engine = CalibrationEngine.for_pass(gm, ctx)
            for seg in engine.blocks():
                if seg.linears:
                    for path, st in engine.collect(seg, seg.linears, hessian=False).items():
                        act_scales[path] = max(float(st.absmax.max()), 1e-8) / 127.0
        for layer in layers:
            self._lower(gm, layer, act_scales.get(layer.path))
        gm.graph.eliminate_dead_code()
        return bool(layers)

    def _lower(self, gm: GraphModule, layer: LinearLayer, act_scale) -> None:
        wq, ws = quantize_weight_per_channel(layer.weight(gm).detach().float())
        tensors = {"weight_int8": wq, "weight_scale": ws}
        if act_scale is not None:
            tensors["act_scale"] = torch.tensor(act_scale)
        x, smooth = layer.input, None
        if SMOOTH_META in x.meta:  # fuse SmoothQuant's explicit 1/s into the quantizer
            x, smooth = x.args[0], x.args[1]
        replace_linear(
            gm,
            layer,
            "int8_linear",
            tensors,
            lambda _x, a: dict(
                x=x,
                weight=a["weight_int8"],
                weight_scale=a["weight_scale"],
                bias=layer.bias_node,
                act_scale=a.get("act_scale"),
                smooth_inv=smooth,
            ),
        )
