"""GPTQ: Hessian-based weight rewrite (Frantar et al., ICLR 2023), as a graph pass.

Per linear, choose ``Q`` minimising ``‖WX − QX‖²`` with ``H = 2/n Σ x xᵀ`` from calibration inputs
that already pass through the quantized earlier blocks. The algorithm is the pure function
``qcompiler.algorithms.gptq.gptq_quantize``; this pass only walks the blocks and rewrites nodes.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import ClassVar

from torch.fx import GraphModule

from qcompiler.errors import QuantizationError
from qcompiler.algorithms.gptq import check_spec, gptq_quantize, hessian_factor, rtn_quantize
from qcompiler.layer_filter import check_patterns
from qcompiler.pass_base import GraphProperty, Pass, PassContext
from qcompiler.weight_only import gptq_experts, gptq_layer_quant, quantize_block_linears

__all__ = ["GPTQ"]


@dataclass(frozen=True)
class GPTQ(Pass):
    """Replaces each linear inside a transformer block with ``qc.quant_linear`` holding its GPTQ weight."""

    bits: int = 4
    group_size: int = 128
    sym: bool = False
    act_order: bool = False       # process columns by decreasing diag(H)
    static_groups: bool = False   # with act_order: grids fixed up front, groups contiguous
    damp: float = 0.01            # λ = damp · mean(diag H), raised ×10 while H is not PD
    block_size: int = 128         # lazy-batch width
    true_sequential: bool = False  # True: q/k/v, then o, then gate/up, then down, re-running inputs between
    lm_head: bool = False         # also the output head, by RTN on the same grid (it has no block Hessian)
    ignore: tuple[str, ...] = ()  # module paths kept in full precision: globs, or 're:' + a regex

    requires: ClassVar = frozenset()
    provides: ClassVar = frozenset({GraphProperty.QUANTIZED_WEIGHTS})
    noop_after: ClassVar = frozenset({GraphProperty.QUANTIZED_WEIGHTS, GraphProperty.INT8_LOWERED})
    needs_calibration: ClassVar = True

    def __post_init__(self):
        check_spec(self.bits, self.group_size)
        object.__setattr__(self, "ignore", check_patterns(self.name, self.ignore))
        if not 0 < self.damp < 1:
            raise QuantizationError(f"damp must be in (0, 1), got {self.damp}")
        if self.block_size < 1:
            raise QuantizationError(f"block_size must be positive, got {self.block_size}")

    def run(self, gm: GraphModule, ctx: PassContext) -> bool:
        # q/k/v and gate/up get the same Hessian object: one factor for all of them, kept only
        # while that Hessian lives (a down_proj's H and factor, 2 x 67 MB at width 4096, would
        # otherwise stay through the next block's calibration)
        factors: dict[int, object] = {}

        def quantize(layer, W, H):
            if id(H) not in factors:
                factors[id(H)] = hessian_factor(H, self.damp, self.act_order)
                weakref.finalize(H, factors.pop, id(H), None)
            res = gptq_quantize(W, H, bits=self.bits, group_size=self.group_size, sym=self.sym,
                                act_order=self.act_order, static_groups=self.static_groups,
                                damp=self.damp, block_size=self.block_size, factor=factors[id(H)])
            return gptq_layer_quant(layer, W, res, self.bits, self.group_size)
        def head(layer, W, H):
            res = rtn_quantize(W, bits=self.bits, group_size=self.group_size, sym=self.sym)
            return gptq_layer_quant(layer, W, res, self.bits, self.group_size)
        return quantize_block_linears(gm, ctx, quantize=quantize, true_sequential=self.true_sequential,
                                      needs_hessian=True, head=head if self.lm_head else None, ignore=self.ignore,
                                      experts=gptq_experts(head))
