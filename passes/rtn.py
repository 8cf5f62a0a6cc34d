"""Round-to-nearest weight quantization: the baseline every quality claim is measured against.

Each weight group is put on its min-max grid (``qcompiler.algorithms.quant_grid``) independently, with no
error feedback. Same grid, groups and storage as GPTQ, so the two differ only in the rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

from qcompiler.algorithms.gptq import check_spec
from qcompiler.pipeline.weight_only import GPTQ_ROW_UNIT, gptq_experts, rtn_layer_quant
from qcompiler.pipeline.weight_quantizer import WeightQuantizer

__all__ = ["RTN"]


@dataclass(frozen=True)
class RTN(WeightQuantizer):
    """Replaces each linear inside a transformer block with ``qc.quant_linear`` holding its RTN weight."""

    bits: int = 4
    group_size: int = 128
    sym: bool = False
    grid: str = "minmax"  # "mse": each group's range searched for the least error (Hessian-diagonal weighted);
    # "q4_k", "q5_k", "q6_k", "q3_k", "q4_1", "q5_1": llama.cpp's block grids, stored as its bytes (qc.gguf_linear)
    lm_head: bool = False  # also the output head (RTN), as onnxruntime-genai's int4 builder does
    ignore: tuple[str, ...] = ()  # module paths kept in full precision: globs, or 're:' + a regex

    requires = frozenset()
    provides = WeightQuantizer.provides

    def __post_init__(self):
        check_spec(self.bits, self.group_size, self.grid)
        super().__post_init__()

    def quantize_layer(self, layer, W, H):
        """Round-to-nearest on the min-max grid of each group."""
        # With calibration data the report gets each layer's output error on it; without, none.
        return rtn_layer_quant(layer, W, self.bits, self.group_size, self.sym, self.grid, H)

    def row_split_unit(self, layer):
        """Rounding is row by row: any whole packed words of rows solve apart."""
        return GPTQ_ROW_UNIT

    def head_quantizer(self):
        """The head is quantized like the block layers when ``lm_head`` is set."""
        return self.quantize_layer if self.lm_head else None

    def experts_format(self):
        """Experts in the GPTQ layout, each expert rounded like a layer."""
        return gptq_experts(self.quantize_layer)
