"""Round-to-nearest weight quantization: the baseline every quality claim is measured against.

Each weight group is put on its min-max grid (``qcompiler.algorithms.quant_grid``) independently, with no
error feedback. Same grid, groups and storage as GPTQ, so the two differ only in the rounding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch.fx import GraphModule

from qcompiler.algorithms.gptq import check_spec, rtn_quantize
from qcompiler.layer_filter import check_patterns
from qcompiler.pass_base import GraphProperty, Pass, PassContext
from qcompiler.weight_only import gptq_experts, gptq_layer_quant, quantize_block_linears

__all__ = ["RTN"]


@dataclass(frozen=True)
class RTN(Pass):
    """Replaces each linear inside a transformer block with ``qc.quant_linear`` holding its RTN weight."""

    bits: int = 4
    group_size: int = 128
    sym: bool = False
    lm_head: bool = False         # also the output head (RTN), as onnxruntime-genai's int4 builder does
    ignore: tuple[str, ...] = ()  # module paths kept in full precision: globs, or 're:' + a regex

    requires: ClassVar = frozenset()
    provides: ClassVar = frozenset({GraphProperty.QUANTIZED_WEIGHTS})
    noop_after: ClassVar = frozenset({GraphProperty.QUANTIZED_WEIGHTS, GraphProperty.INT8_LOWERED})

    def __post_init__(self):
        check_spec(self.bits, self.group_size)
        object.__setattr__(self, "ignore", check_patterns(self.name, self.ignore))

    def run(self, gm: GraphModule, ctx: PassContext) -> bool:
        # With calibration data the report gets each layer's output error on it; without, none.
        def quantize(layer, W, H):
            res = rtn_quantize(W, bits=self.bits, group_size=self.group_size, sym=self.sym)
            return gptq_layer_quant(layer, W, res, self.bits, self.group_size)
        return quantize_block_linears(gm, ctx, quantize=quantize, true_sequential=False, needs_hessian=False,
                                      head=quantize if self.lm_head else None, ignore=self.ignore,
                                      experts=gptq_experts(quantize))
