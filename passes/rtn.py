"""Round-to-nearest weight quantization: the baseline every quality claim is measured against.

Each weight group is put on its min-max grid (``qcompiler.algorithms.quant_grid``) independently, with no
error feedback. Same grid, groups and storage as GPTQ, so the two differ only in the rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from qcompiler.algorithms.float_grid import FLOAT_FORMATS, float_rtn
from qcompiler.algorithms.gptq import check_spec, rtn_quantize
from qcompiler.ir.graph import LinearLayer
from qcompiler.layouts import ExpertsFormat, LayerQuant
from qcompiler.layouts.float_result import FLOAT_ROW_UNITS, check_float_width, from_float_quant
from qcompiler.layouts.gguf import grid_settings, layer_grid
from qcompiler.layouts.gptq import GPTQ_ROW_UNIT
from qcompiler.layouts.grid_result import from_quant_result
from qcompiler.layouts.nvfp4 import fused_global_amax
from qcompiler.pipeline.weight_quantizer import WeightQuantizer

__all__ = ["RTN", "rtn_layer_quant"]


def rtn_layer_quant(
    layer: LinearLayer,
    W: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool,
    grid: str = "minmax",
    H: Optional[torch.Tensor] = None,
) -> LayerQuant:
    """Round-to-nearest on a grid, stored in the layout that holds it (GPTQ's, or llama.cpp's
    bytes): RTN's layers, and GPTQ's head and its experts that no calibration row reached. An
    "mse" grid weighs each column by ``diag(H)`` when there is an ``H`` (plain squared error without)."""
    if grid in FLOAT_FORMATS:  # the min-max scales compressed-tensors' own RTN fits, bit for bit
        check_float_width(layer, W, grid)
        amax = fused_global_amax(layer) if grid == "nvfp4" else None
        return from_float_quant(layer, grid, float_rtn(W, FLOAT_FORMATS[grid], global_amax=amax), {"bits": bits})
    importance = None if H is None else torch.diagonal(H).float()
    used = layer_grid(layer, W, grid)
    bits_used, group_used = grid_settings(used, bits, group_size)
    res = rtn_quantize(W, bits=bits_used, group_size=group_used, sym=sym, grid=used, importance=importance)
    return from_quant_result(layer, W, res, bits, group_size, grid)


@dataclass(frozen=True)
class RTN(WeightQuantizer):
    """Replaces each linear inside a transformer block with ``qc.quant_linear`` holding its RTN weight."""

    bits: int = 4
    group_size: int = 128
    sym: bool = False
    grid: str = "minmax"  # "mse": each group's range searched for the least error (Hessian-diagonal weighted);
    # "q4_k", "q5_k", "q6_k", "q3_k", "q4_1", "q5_1": llama.cpp's block grids, stored as its bytes (qc.gguf_linear);
    # "fp8" (bits 8, group_size -1), "fp8-block" (8, 128), "nvfp4" (4, 16), "mxfp4" (4, 32): floating-point
    # grids with min-max scales, each in its own layout (symmetric whatever ``sym`` says)

    def __post_init__(self):
        check_spec(self.bits, self.group_size, self.grid, float_grids=True)
        super().__post_init__()

    def quantize_layer(self, layer, W, H):
        """Round-to-nearest on the min-max grid of each group."""
        # With calibration data the report gets each layer's output error on it; without, none.
        return rtn_layer_quant(layer, W, self.bits, self.group_size, self.sym, self.grid, H)

    def row_split_unit(self, layer):
        """Rounding is row by row: any whole packed words of rows solve apart (FP8 blocks: 128
        rows; NVFP4's global scale is the whole tensor's)."""
        return FLOAT_ROW_UNITS[self.grid] if self.grid in FLOAT_ROW_UNITS else GPTQ_ROW_UNIT

    def head_quantizer(self):
        """The head is quantized like the block layers when ``lm_head`` is set."""
        return self.quantize_layer if self.lm_head else None

    def experts_format(self):
        """Experts in the GPTQ layout, each expert rounded like a layer (floating-point grids have
        no experts op yet: their experts stay in full precision, with a note)."""
        return None if self.grid in FLOAT_FORMATS else ExpertsFormat(self.quantize_layer, "RTN")
