"""The uniform quantization grid shared by RTN, GPTQ and SpQR.

Asymmetric: ``q = clamp(round(w/s) + z, 0, 2^b − 1)``, ``s = (max − min)/(2^b − 1)`` over a range
that always contains 0, ``z = round(−min/s)``. Symmetric: ``z = 2^(b−1)``, range ``±max|w|``.
Scales are rounded to fp16 *before* codes are chosen, because fp16 is how they are stored: the
codes then reproduce exactly the weights the algorithm measured its error on.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Grid", "fit_grid", "quantize", "dequantize_codes", "fake_quantize"]


class Grid(NamedTuple):
    """An affine quantization grid: ``value = scale * (code - zero)``."""

    scale: torch.Tensor  # [rows, 1] float32 holding fp16-representable values
    zero: torch.Tensor  # [rows, 1] float32 holding integers in [0, 2^bits)


def fit_grid(w: torch.Tensor, bits: int, sym: bool) -> Grid:
    """Per-row min-max grid for ``w`` ``[rows, cols]``."""
    maxq = 2**bits - 1
    xmin = w.amin(dim=1, keepdim=True).clamp(max=0)  # amin/amax: no indices (min(dim) was 10x slower)
    xmax = w.amax(dim=1, keepdim=True).clamp(min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = -xmax
    empty = (xmin == 0) & (xmax == 0)
    xmin = torch.where(empty, -torch.ones_like(xmin), xmin)
    xmax = torch.where(empty, torch.ones_like(xmax), xmax)
    scale = ((xmax - xmin) / maxq).half().float()
    scale = torch.where(scale > 0, scale, torch.full_like(scale, 2.0**-24))  # fp16 underflow guard
    if sym:
        zero = torch.full_like(scale, float(2 ** (bits - 1)))
    else:
        zero = torch.round(-xmin / scale).clamp(0, maxq)
    return Grid(scale, zero)


def quantize(w: torch.Tensor, grid: Grid, bits: int) -> torch.Tensor:
    """Integer codes of ``w`` on ``grid`` (same shape as ``w``, int32)."""
    return torch.clamp(torch.round(w / grid.scale) + grid.zero, 0, 2**bits - 1).to(torch.int32)


def dequantize_codes(q: torch.Tensor, grid: Grid) -> torch.Tensor:
    """The values that integer codes ``q`` stand for on ``grid``."""
    return grid.scale * (q.float() - grid.zero)


def fake_quantize(w: torch.Tensor, grid: Grid, bits: int) -> torch.Tensor:
    """``w`` rounded onto the grid, in float."""
    return dequantize_codes(quantize(w, grid, bits), grid)
