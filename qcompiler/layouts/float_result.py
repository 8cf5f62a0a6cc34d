"""A solve on a floating-point grid (``qcompiler.algorithms.float_grid``: RTN's or GPTQ's) stored in
the layout of its format: ``qc.fp8_linear``, ``qc.nvfp4_linear`` or ``qc.mxfp4_linear``."""

from __future__ import annotations

from torch import Tensor

from qcompiler.algorithms.float_grid import FLOAT_FORMATS, FloatQuant
from qcompiler.ir.graph import LinearLayer
from qcompiler.layouts.base import LayerQuant, UnpackableLayer
from qcompiler.layouts.fp8 import fp8_layer
from qcompiler.layouts.mxfp4 import mxfp4_layer
from qcompiler.layouts.nvfp4 import nvfp4_layer

__all__ = ["from_float_quant", "check_float_width", "FLOAT_ROW_UNITS"]

# rows a layer on each format may be solved apart in (None: whole layers only — NVFP4's global
# scale is the whole tensor's); FP8 blocks span 128 rows
FLOAT_ROW_UNITS = {"fp8": 128, "fp8-block": 128, "nvfp4": None, "mxfp4": 32}


def check_float_width(layer: LinearLayer, W: Tensor, grid: str) -> None:
    """UnpackableLayer (the layer is skipped with a note) when ``W``'s inputs are not whole FP4
    scale groups (NVFP4: 16, MXFP4: 32); FP8 blocks at the edges may be partial."""
    fmt = FLOAT_FORMATS[grid]
    if fmt.element == "e2m1" and W.shape[1] % fmt.group:
        raise UnpackableLayer(
            f"layer {layer.path}: in_features={W.shape[1]} is not a multiple of {fmt.group}, "
            f"which {grid.upper()} needs (one scale per {fmt.group} inputs)"
        )


def from_float_quant(layer: LinearLayer, grid: str, res: FloatQuant, figures: dict) -> LayerQuant:
    """``res`` in the layout of ``grid`` (a name of ``FLOAT_FORMATS``)."""
    figures = {**figures, "grid": grid}
    if grid in ("fp8", "fp8-block"):
        return fp8_layer(layer, res, grid == "fp8-block", figures)
    if grid == "nvfp4":
        return nvfp4_layer(layer, res, figures)
    return mxfp4_layer(layer, res, figures)
