"""The uniform quantization grid shared by RTN, GPTQ and SpQR.

Asymmetric: ``q = clamp(round(w/s) + z, 0, 2^b − 1)``, ``s = (max − min)/(2^b − 1)`` over a range
that always contains 0, ``z = round(−min/s)``. Symmetric: ``z = 2^(b−1)``, so the codes stand for
``s·(−2^(b−1) … 2^(b−1) − 1)``, one step longer on one side; ``s = −m/2^(b−1)`` with ``m`` the
row's signed extreme puts that extreme on the longer side, exactly (llama.cpp's Q4_0 rule,
``d = max/−8``): a step of ``max|w|/2^(b−1)`` instead of ``2·max|w|/(2^b − 1)``, and the scale is
negative when the extreme is positive.
Scales are rounded to fp16 *before* codes are chosen, because fp16 is how they are stored: the
codes then reproduce exactly the weights the algorithm measured its error on.

``search_grid`` is the error-minimizing grid: the min-max range shrunk by each of a few factors, and
per row the one whose rounding error, weighted per column by the importance of that input (the
Hessian's diagonal for RTN; ``1/[H⁻¹]_jj``, GPTQ's own cost of a column's error, for GPTQ), is
smallest. Clipping a few large weights buys a finer step for all the others.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = [
    "Grid",
    "fit_grid",
    "search_grid",
    "search_shrinks",
    "fit",
    "quantize",
    "dequantize_codes",
    "fake_quantize",
    "GRID_KINDS",
    "CLIP_SHRINKS",
]


class Grid(NamedTuple):
    """An affine quantization grid: ``value = scale * (code - zero)``."""

    scale: torch.Tensor  # [rows, 1] float32 holding fp16-representable values
    zero: torch.Tensor  # [rows, 1] float32 holding integers in [0, 2^bits)


def fit_grid(w: torch.Tensor, bits: int, sym: bool) -> Grid:
    """Per-row min-max grid for ``w`` ``[rows, cols]``."""
    # amin/amax: no indices (min(dim) was 10x slower)
    return _grid_for_range(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), bits, sym)


def _grid_for_range(
    lo: torch.Tensor, hi: torch.Tensor, bits: int, sym: bool, flip: bool = False, maxq: Optional[torch.Tensor] = None
) -> Grid:
    """The grid covering ``[lo, hi]`` per row (widened to contain 0). Symmetric: the signed extreme on
    the codes' longer side (``flip``: on the shorter one, a candidate the searched grid also tries).
    ``maxq`` (asymmetric only): each row's largest code ``[rows, 1]``, rows of different widths stacked
    (the same values as each row's own ``bits``)."""
    if not sym:
        return _asymmetric(lo, hi, 2**bits - 1 if maxq is None else maxq)
    if maxq is not None:
        raise ValueError("per-row code widths are for asymmetric grids")
    xmin, xmax = lo.clamp(max=0), hi.clamp(min=0)
    extreme = torch.where(xmax >= -xmin, xmax, xmin)
    extreme = torch.where(extreme == 0, torch.ones_like(extreme), extreme)
    scale = (extreme / (-(2 ** (bits - 1)) if not flip else 2 ** (bits - 1))).half().float()
    scale = torch.where(scale != 0, scale, torch.full_like(scale, 2.0**-24))  # fp16 underflow guard
    return Grid(scale, torch.full_like(scale, float(2 ** (bits - 1))))


def _asymmetric(lo: torch.Tensor, hi: torch.Tensor, maxq) -> Grid:
    """The asymmetric grid over ``[min(lo, 0), max(hi, 0)]``; ``maxq`` an int or a per-row tensor."""
    xmin, xmax = lo.clamp(max=0), hi.clamp(min=0)
    empty = (xmin == 0) & (xmax == 0)
    xmin = torch.where(empty, -torch.ones_like(xmin), xmin)
    xmax = torch.where(empty, torch.ones_like(xmax), xmax)
    scale = ((xmax - xmin) / maxq).half().float()
    scale = torch.where(scale > 0, scale, torch.full_like(scale, 2.0**-24))  # fp16 underflow guard
    zero = torch.round(-xmin / scale)
    return Grid(scale, zero.clamp(0, maxq) if isinstance(maxq, int) else zero.clamp_(min=0).minimum(maxq))


def quantize(w: torch.Tensor, grid: Grid, bits: int) -> torch.Tensor:
    """Integer codes of ``w`` on ``grid`` (same shape as ``w``, int32)."""
    return torch.clamp(torch.round(w / grid.scale) + grid.zero, 0, 2**bits - 1).to(torch.int32)


def dequantize_codes(q: torch.Tensor, grid: Grid) -> torch.Tensor:
    """The values that integer codes ``q`` stand for on ``grid``."""
    return grid.scale * (q.float() - grid.zero)


def fake_quantize(w: torch.Tensor, grid: Grid, bits: int) -> torch.Tensor:
    """``w`` rounded onto the grid, in float."""
    return dequantize_codes(quantize(w, grid, bits), grid)


GRID_KINDS = ("minmax", "mse")
# Range factors tried by the "mse" grid: 1 (min-max) down to 0.5 in steps of 0.025. Measured on the bundled
# models (docs/methods/gptq.md): at 3 bits the chosen factor is below 0.8 for a fifth of the groups.
CLIP_SHRINKS = tuple(1.0 - 0.025 * i for i in range(21))


def search_grid(
    w: torch.Tensor, bits: int, sym: bool, importance: Optional[torch.Tensor] = None, shrinks=CLIP_SHRINKS
) -> Grid:
    """Per row, the grid among ``fit_grid(w · p)`` for p in ``shrinks`` whose rounding of ``w`` has the
    least error ``Σ_j importance_j (w_j − ŵ_j)²`` (``importance`` ``[cols]`` or ``[rows, cols]``, ≥ 0;
    None: plain squared error). Never worse than min-max, which is the first candidate."""
    lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    best = _grid_for_range(lo, hi, bits, sym)
    best_err = _row_error(w, best, bits, importance)
    candidates = [(p, False) for p in shrinks[1:]]
    if sym:  # the extreme on either side of the codes' range
        candidates += [(p, True) for p in shrinks]
    for p, flip in candidates:
        grid = _grid_for_range(lo * p, hi * p, bits, sym, flip)
        err = _row_error(w, grid, bits, importance)
        better = err < best_err
        best = Grid(torch.where(better, grid.scale, best.scale), torch.where(better, grid.zero, best.zero))
        best_err = torch.where(better, err, best_err)
    return best


def search_shrinks(
    w: torch.Tensor, bits: int, sym: bool, importance: Optional[torch.Tensor] = None, shrinks=CLIP_SHRINKS
) -> torch.Tensor:
    """Per row, the factor of ``shrinks`` whose grid ``fit_grid(w · p)`` rounds ``w`` with the least
    error (``search_grid``'s criterion, without its flipped symmetric candidates): ``p`` [rows], a
    starting clipping for methods that tune it further (SignRound)."""
    lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    best_p = torch.full_like(lo, float(shrinks[0]))
    best_err = _row_error(w, _grid_for_range(lo * shrinks[0], hi * shrinks[0], bits, sym), bits, importance)
    for p in shrinks[1:]:
        err = _row_error(w, _grid_for_range(lo * p, hi * p, bits, sym), bits, importance)
        best_p = torch.where(err < best_err, torch.full_like(best_p, float(p)), best_p)
        best_err = torch.minimum(err, best_err)
    return best_p.squeeze(1)


def fit(w: torch.Tensor, bits: int, sym: bool, kind: str = "minmax", importance=None) -> Grid:
    """The grid of ``kind`` ("minmax" or "mse", see GRID_KINDS) for ``w``."""
    return fit_grid(w, bits, sym) if kind == "minmax" else search_grid(w, bits, sym, importance)


def _row_error(w: torch.Tensor, grid: Grid, bits: int, importance) -> torch.Tensor:
    # (w/s − clamp(round(w/s) + z, 0, maxq) + z)² s²: one buffer, in place
    d = torch.div(w, grid.scale)
    q = torch.round(d).add_(grid.zero).clamp_(0, 2**bits - 1).sub_(grid.zero)
    d.sub_(q).square_()
    if importance is not None:
        d.mul_(importance)
    return d.sum(dim=1, keepdim=True).mul_(grid.scale.square())
