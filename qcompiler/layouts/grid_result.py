"""A GPTQ-family solve (codes on a grid: RTN, GPTQ, AWQ's, SignRound's) stored in the layout that
holds its grid: llama.cpp's block bytes for a llama.cpp grid, the GPTQ layout otherwise."""

from __future__ import annotations

import torch

from qcompiler.algorithms.gptq import QuantResult
from qcompiler.ir.graph import LinearLayer
from qcompiler.layouts.base import LayerQuant
from qcompiler.layouts.gguf import gguf_layer, layer_grid
from qcompiler.layouts.gptq import gptq_layer

__all__ = ["from_quant_result"]


def from_quant_result(
    layer: LinearLayer, W: torch.Tensor, res: QuantResult, bits: int, group_size: int, grid: str = "minmax"
) -> LayerQuant:
    """``res`` as ``qc.quant_linear`` (the GPTQ layout) or, for a llama.cpp grid
    (``gguf_grids.FORMATS``), ``qc.gguf_linear``; ``bits``/``group_size`` are the recipe's."""
    figures = {"bits": bits}
    if res.damp:
        figures.update(damp=res.damp, damp_steps=res.damp_steps)
    if res.gguf_grid is not None:
        return gguf_layer(res, grid, layer_grid(layer, W, grid), figures)
    return gptq_layer(
        layer, res.codes, res.scales, res.zeros, res.g_idx, bits, group_size, res.dequantized, figures, res.damped_error
    )
