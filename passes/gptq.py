"""GPTQ: Hessian-based weight rewrite (Frantar et al., ICLR 2023), as a graph pass.

Per linear, choose ``Q`` minimising ``‖WX − QX‖²`` with ``H = 2/n Σ x xᵀ`` from calibration inputs
that already pass through the quantized earlier blocks. The algorithm is the pure function
``qcompiler.algorithms.gptq.gptq_quantize``; this pass only walks the blocks and rewrites nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from qcompiler.algorithms.float_grid import FLOAT_FORMATS
from qcompiler.algorithms.gptq import check_spec, gptq_quantize
from qcompiler.algorithms.gptq_float import gptq_float_quantize
from qcompiler.errors import QuantizationError
from qcompiler.layouts import ExpertsFormat
from qcompiler.layouts.float_result import FLOAT_ROW_UNITS, check_float_width, from_float_quant
from qcompiler.layouts.gguf import grid_settings, layer_grid
from qcompiler.layouts.gptq import GPTQ_ROW_UNIT
from qcompiler.layouts.grid_result import from_quant_result
from qcompiler.layouts.nvfp4 import fused_global_amax
from qcompiler.passes.rtn import rtn_layer_quant
from qcompiler.pipeline.shared_factors import shared_hessian_factor
from qcompiler.pipeline.weight_quantizer import WeightQuantizer

__all__ = ["GPTQ"]


@dataclass(frozen=True)
class GPTQ(WeightQuantizer):
    """Replaces each linear inside a transformer block with ``qc.quant_linear`` holding its GPTQ weight."""

    bits: int = 4
    group_size: int = 128
    sym: bool = False
    # Defaults: the best measured on the bundled models (benchmarks/gptq_defaults.py, docs/methods/gptq.md):
    # act-order with static groups (contiguous groups, no g_idx gather at run time) and the searched grid.
    act_order: bool = True  # process columns by decreasing diag(H)
    static_groups: bool = True  # with act_order: grids fixed up front, groups contiguous
    damp: float = 0.01  # λ = damp · mean(diag H), raised ×10 while H is not PD
    block_size: int = 128  # lazy-batch width
    # each group's range searched for the least 1/[H⁻¹]_jj-weighted error; "minmax": the paper's;
    # "q4_k", "q5_k", "q6_k", "q3_k", "q4_1", "q5_1": llama.cpp's block grids, stored as its bytes (qc.gguf_linear);
    # "fp8" (bits 8, group_size -1), "fp8-block" (8, 128), "nvfp4" (4, 16), "mxfp4" (4, 32): floating-point
    # grids, each cell's scale searched like "mse" (symmetric whatever ``sym`` says), each in its own layout
    grid: str = "mse"

    needs_calibration: ClassVar = True
    needs_hessian: ClassVar = True
    config_version: ClassVar = 2  # 2: the grid field (version 1 artifacts were made with min-max grids)

    def __post_init__(self):
        check_spec(self.bits, self.group_size, self.grid, float_grids=True)
        super().__post_init__()
        if not 0 < self.damp < 1:
            raise QuantizationError(f"damp must be in (0, 1), got {self.damp}")
        if self.block_size < 1:
            raise QuantizationError(f"block_size must be positive, got {self.block_size}")

    @classmethod
    def migrate_config(cls, config: dict, version: int) -> dict:
        """Version 1 had no ``grid``: its artifacts were made on min-max grids."""
        if version == 1:
            return {"grid": "minmax", **config}
        return super().migrate_config(config, version)

    def quantize_layer(self, layer, W, H):
        """GPTQ on one layer, with the factor of its (shared) Hessian computed once."""
        if self.grid in FLOAT_FORMATS:
            check_float_width(layer, W, self.grid)
            res = gptq_float_quantize(
                W,
                H,
                FLOAT_FORMATS[self.grid],
                act_order=self.act_order,
                static_groups=self.static_groups,
                damp=self.damp,
                block_size=self.block_size,
                factor=shared_hessian_factor(H, self.damp, self.act_order),
                global_amax=fused_global_amax(layer) if self.grid == "nvfp4" else None,
            )
            return from_float_quant(layer, self.grid, res, {"bits": self.bits})
        grid = layer_grid(layer, W, self.grid)
        bits, group_size = grid_settings(grid, self.bits, self.group_size)
        res = gptq_quantize(
            W,
            H,
            bits=bits,
            group_size=group_size,
            sym=self.sym,
            act_order=self.act_order,
            static_groups=self.static_groups,
            damp=self.damp,
            block_size=self.block_size,
            factor=shared_hessian_factor(H, self.damp, self.act_order),
            grid=grid,
        )
        return from_quant_result(layer, W, res, self.bits, self.group_size, self.grid)

    def row_split_unit(self, layer):
        """GPTQ's rows are independent given H (one grid per row and group, the sweep row-wise):
        any whole packed words of rows solve apart, bit-identically (tests/test_row_split.py); FP8
        blocks span 128 rows, and NVFP4's global scale is the whole tensor's."""
        return FLOAT_ROW_UNITS[self.grid] if self.grid in FLOAT_ROW_UNITS else GPTQ_ROW_UNIT

    def _rtn(self, layer, W, H):
        """The head and experts no calibration row reached: RTN on the same grid."""
        return rtn_layer_quant(layer, W, self.bits, self.group_size, self.sym, self.grid, H)

    def head_quantizer(self):
        """The head is quantized by RTN on the same grid when ``lm_head`` is set."""
        return self._rtn if self.lm_head else None

    def experts_format(self):
        """Experts in the GPTQ layout; an expert no calibration row reached is quantized by RTN
        (floating-point grids have no experts op yet: their experts stay in full precision)."""
        return None if self.grid in FLOAT_FORMATS else ExpertsFormat(self._rtn, "RTN")
