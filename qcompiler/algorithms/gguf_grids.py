"""llama.cpp's block grids, fitted per sub-block: ``Q4_K``, ``Q5_K``, ``Q6_K``, ``Q3_K``, ``Q2_K``, ``Q4_1``,
``Q5_1`` (and ``Q8_0`` / ``Q4_0``, the fallbacks of Q6_K / Q3_K for widths that are not a multiple of 256).

Every one is ``scale · q − offset`` per sub-block (``BlockGrid``). With a free minimum the offset
is a value of its own — unlike qcompiler's affine grid ``s·(q − z)``, whose integer zero point ``z``
puts it on the scale's lattice: ``Q4_1`` / ``Q5_1`` store scale and minimum as fp16 per block of
32 (5 / 6 bits per weight), ``Q4_K`` / ``Q5_K`` as 6-bit integers ``sc``, ``m`` per 32 times fp16
``d``, ``dmin`` per super-block of 256 (4.5 / 5.5 bits per weight; the offset is never negative),
``Q2_K`` 2-bit codes with 4-bit ``sc``, ``m`` per 16 (2.625).
The symmetric types tie the offset to the scale, ``scale·(q − zero)``: ``Q6_K`` (6-bit codes,
signed 8-bit ``sc`` per 16 times fp16 ``d`` per 256: 6.5625 bits per weight), ``Q3_K`` (3-bit
codes, signed 6-bit ``sc`` per 16: 3.4375), ``Q8_0`` / ``Q4_0`` (fp16 ``d`` per 32). Layers on
these grids keep llama.cpp's bytes (``qc.gguf_linear``; ``gguf_bytes`` packs and reads them).

``fit_grid`` chooses the grid the way a calibrated quantizer should: per sub-block, the scale (and
offset) minimizing the importance-weighted rounding error (clipped ranges, each refitted by weighted
least squares on its codes, as llama.cpp's ``make_qkx`` / ``make_qx_quants`` do), then rounded to
the format's storage (K types: the integer ``sc`` (and ``m``) against ``d`` (``dmin``), each then
nudged by ±1 where that lowers its error). GPTQ rounds against exactly that grid
(``sub_block_grid``), so the codes it chooses are the codes llama.cpp runs.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = [
    "GridFormat",
    "FORMATS",
    "GRID_FALLBACK",
    "BlockGrid",
    "fit_grid",
    "sub_block_grid",
    "quantize_codes",
]

SUB_BLOCK = 32  # the free-minimum types' sub-block
# Clipping factors of a sub-block's range: every 0.1 from 1 to 0.5, then ±0.025 and ±0.05 around the best
# (on a 512 x 1024 test matrix: the error of the 21-step search of quant_grid.CLIP_SHRINKS at half its time)
_COARSE = tuple(1.0 - 0.1 * i for i in range(6))
_FINE = (-0.05, -0.025, 0.025, 0.05)


class BlockGrid(NamedTuple):
    """A grid of a ``[rows, cols]`` matrix: sub-block ``j`` of super-block ``b`` has scale
    ``d[:, b]·sc[:, j]`` and offset ``dmin[:, b]·m[:, j]`` (Q4_1: one sub-block per block, sc = m = 1)."""

    d: torch.Tensor  # [rows, super-blocks] float32 holding fp16 values
    dmin: torch.Tensor  # [rows, super-blocks] float32 holding fp16 values
    sc: torch.Tensor  # [rows, sub-blocks] int32
    m: torch.Tensor  # [rows, sub-blocks] int32


class GridFormat(NamedTuple):
    """One llama.cpp block type."""

    name: str  # llama.cpp's: "Q4_K"
    super_block: int  # input columns per stored block
    block_bytes: int
    min_at_most_zero: bool  # the offset is stored unsigned (Q4_K): the grid reaches down to 0
    bits: int  # of each code
    sub_block: int = 32  # input columns sharing one (scale, offset)
    zero: Optional[int] = None  # symmetric types: value = scale·(q − zero), the offset tied to the scale
    sc_range: tuple[int, int] = (0, 63)  # the integer sub-block scales against d (K types)

    @property
    def maxq(self) -> int:
        """The largest code."""
        return 2**self.bits - 1


FORMATS = {
    "q4_k": GridFormat("Q4_K", 256, 144, True, 4),  # fp16 d, fp16 dmin, 12 bytes of 6-bit sc/m, 128 of nibbles
    "q5_k": GridFormat("Q5_K", 256, 176, True, 5),  # as Q4_K, plus 32 bytes of the codes' fifth bits
    "q2_k": GridFormat("Q2_K", 256, 84, True, 2, 16, None, (0, 15)),  # 16 bytes of 4-bit sc|m, 64 of codes, d, dmin
    "q4_1": GridFormat("Q4_1", 32, 20, False, 4),  # fp16 d, fp16 m (= −offset), 16 bytes of nibbles
    "q5_1": GridFormat("Q5_1", 32, 24, False, 5),  # as Q4_1, plus a uint32 of the codes' fifth bits
    # symmetric: value = d·sc·(q − zero), the signed sub-block scales sc against one fp16 d per 256
    "q6_k": GridFormat("Q6_K", 256, 210, False, 6, 16, 32, (-128, 127)),  # 128 + 64 bytes of codes, 16 int8 sc, d
    "q3_k": GridFormat("Q3_K", 256, 110, False, 3, 16, 4, (-32, 31)),  # 32 + 64 bytes of codes, 12 of 6-bit sc, d
    # llama.cpp's own 32-column fallbacks of Q6_K / Q3_K: value = d·(q − zero), d fp16 per 32
    "q8_0": GridFormat("Q8_0", 32, 34, False, 8, 32, 128, (1, 1)),
    "q4_0": GridFormat("Q4_0", 32, 18, False, 4, 32, 8, (1, 1)),
}
BY_NAME = {f.name: f for f in FORMATS.values()}
# A super-block grid's stand-in for a width it cannot hold: the 32-column type with the same code width
# (llama-quantize falls back too: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q3_K and Q2_K -> Q4_0).
GRID_FALLBACK = {"q4_k": "q4_1", "q5_k": "q5_1", "q6_k": "q8_0", "q3_k": "q4_0", "q2_k": "q4_0"}


def sub_block_grid(grid: BlockGrid) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sub-block ``(scale, offset)`` ``[rows, sub-blocks]`` float32, as llama.cpp computes them:
    ``d·sc`` and ``dmin·m`` (exact in float32); a weight is ``scale·q − offset``."""
    per = grid.sc.shape[1] // grid.d.shape[1]
    return grid.d.repeat_interleave(per, 1) * grid.sc.float(), grid.dmin.repeat_interleave(per, 1) * grid.m.float()


def _codes(w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, maxq: int) -> torch.Tensor:
    """Nearest codes of ``w`` ``[..., 32]`` on ``scale·q − offset`` (``[..., 1]``), q in 0..maxq, as
    float; a zero scale gives 0 (dividing by +inf)."""
    divisor = torch.where(scale != 0, scale, torch.full_like(scale, float("inf")))
    return torch.add(w, offset).div_(divisor).round_().clamp_(0, maxq)


def _error(w, scale, offset, imp, maxq: int) -> torch.Tensor:
    """Importance-weighted squared rounding error per sub-block ``[..., 1]``."""
    e = _codes(w, scale, offset, maxq).mul_(scale).sub_(offset).sub_(w).square_()
    return (e if imp is None else e.mul_(imp)).sum(-1, keepdim=True)


def _least_squares(w, weights, q, min_at_most_zero: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, offset)`` minimizing ``Σ weights (scale·q − offset − w)²`` for fixed codes ``q``
    (``min_at_most_zero``: a positive optimal minimum is replaced by 0 and the scale refitted alone)."""
    sw = weights.sum(-1, keepdim=True)
    sq, sx = (weights * q).sum(-1, keepdim=True), (weights * w).sum(-1, keepdim=True)
    sqq, sqx = (weights * q * q).sum(-1, keepdim=True), (weights * q * w).sum(-1, keepdim=True)
    det = sw * sqq - sq * sq
    ok = det > 0
    safe = torch.where(ok, det, torch.ones_like(det))
    scale = torch.where(ok, (sw * sqx - sq * sx) / safe, torch.zeros_like(det))
    minimum = torch.where(ok, (sqq * sx - sq * sqx) / safe, sx / sw.clamp(min=1e-30))
    if min_at_most_zero:
        pure = minimum > 0
        scale = torch.where(pure, sqx / sqq.clamp(min=1e-30), scale)
        minimum = torch.where(pure, torch.zeros_like(minimum), minimum)
    return scale.clamp(min=0), -minimum


def _float_grid(w: torch.Tensor, imp: Optional[torch.Tensor], min_at_most_zero: bool, maxq: int):
    """Per sub-block (last dim 32) the float ``(scale ≥ 0, offset)`` with the least weighted error:
    each clipped min-max range, and its weighted least-squares refit."""
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    if min_at_most_zero:
        lo = lo.clamp(max=0)
    weights = torch.ones_like(w) if imp is None else imp
    best_s, best_o = ((hi - lo) / maxq).clamp(min=0), -lo
    best_err = _error(w, best_s, best_o, imp, maxq)
    best_p = torch.ones_like(best_err)
    center = (hi + lo) / 2 if not min_at_most_zero else torch.zeros_like(lo)  # what clipping shrinks towards
    for step in (0, 1):  # the coarse factors, then the fine ones around each sub-block's best
        factors = (
            [torch.full_like(best_p, p) for p in _COARSE] if step == 0 else [(best_p + d).clamp(max=1.0) for d in _FINE]
        )
        for p in factors:
            c_lo, c_hi = center + (lo - center) * p, center + (hi - center) * p
            s, o = ((c_hi - c_lo) / maxq).clamp(min=0), -c_lo
            for scale, offset in ((s, o), _least_squares(w, weights, _codes(w, s, o, maxq), min_at_most_zero)):
                err = _error(w, scale, offset, imp, maxq)
                better = err < best_err
                best_s, best_o = torch.where(better, scale, best_s), torch.where(better, offset, best_o)
                best_p = torch.where(better, p, best_p)
                best_err = torch.where(better, err, best_err)
    return best_s, best_o


def _symmetric_float_grid(w: torch.Tensor, imp: Optional[torch.Tensor], zero: int, maxq: int) -> torch.Tensor:
    """Per sub-block the signed scale of ``scale·(q − zero)`` with the least weighted error: the
    signed extreme at either end of the codes, each range clipped and refitted by least squares."""
    extreme = w.gather(-1, w.abs().argmax(-1, keepdim=True))
    weights = torch.ones_like(w) if imp is None else imp
    best_s = -extreme / zero  # the extreme at code 0 (the longer side): llama.cpp's rule
    best_err = _error(w, best_s, zero * best_s, imp, maxq)
    best_p = torch.ones_like(best_err)
    for base in (-extreme / zero, extreme / (maxq - zero)):
        for step in (0, 1):
            factors = (
                [torch.full_like(best_p, p) for p in _COARSE]
                if step == 0
                else [(best_p + d).clamp(max=1.0) for d in _FINE]
            )
            for p in factors:
                s = base * p
                c = _codes(w, s, zero * s, maxq) - zero
                den = (weights * c * c).sum(-1, keepdim=True)
                refit = torch.where(den > 0, (weights * c * w).sum(-1, keepdim=True) / den.clamp(min=1e-30), s)
                for scale in (s, refit):
                    err = _error(w, scale, zero * scale, imp, maxq)
                    better = err < best_err
                    best_s, best_p = torch.where(better, scale, best_s), torch.where(better, p, best_p)
                    best_err = torch.where(better, err, best_err)
    return best_s


def _fit_symmetric(fmt: GridFormat, sub: torch.Tensor, imp: Optional[torch.Tensor]) -> BlockGrid:
    """A symmetric type's grid: float scales, then (K types) signed integers ``sc`` against one fp16
    ``d`` per super-block that maps the largest scale to the range's end, each ``sc`` then nudged by
    ±1 where that lowers its error. The offset is ``zero·scale`` exactly (dmin = d, m = zero·sc)."""
    rows, n_sb, per, _ = sub.shape
    s = _symmetric_float_grid(sub, imp, fmt.zero, fmt.maxq)  # [rows, n_sb, per, 1]
    lo, hi = fmt.sc_range
    if per == 1:  # Q8_0, Q4_0: d itself per block
        d = s.half().float()
        sc = torch.ones_like(d)
    else:
        d = (s.gather(2, s.abs().argmax(2, keepdim=True)) / lo).half().float()
        safe = torch.where(d != 0, d, torch.ones_like(d))
        sc = torch.where(d != 0, torch.round(s / safe).clamp(lo, hi), torch.zeros_like(s))
        best_err = _error(sub, d * sc, fmt.zero * d * sc, imp, fmt.maxq)
        for step in (-1, 1):
            c_sc = (sc + step).clamp(lo, hi)
            err = _error(sub, d * c_sc, fmt.zero * d * c_sc, imp, fmt.maxq)
            better = err < best_err
            sc, best_err = torch.where(better, c_sc, sc), torch.where(better, err, best_err)
    sc = sc.reshape(rows, n_sb * per).to(torch.int32)
    d = d.reshape(rows, n_sb)
    return BlockGrid(d, d.clone(), sc, fmt.zero * sc)


def fit_grid(kind: str, w: torch.Tensor, importance: Optional[torch.Tensor] = None) -> BlockGrid:
    """The ``kind`` (a ``FORMATS`` key) grid for ``w`` ``[rows, cols]`` (cols a multiple of its block)
    minimizing the rounding error weighted by ``importance`` (``[cols]`` or ``[rows, cols]``, ≥ 0)."""
    fmt = FORMATS[kind]
    rows, cols = w.shape
    if cols % fmt.super_block:
        raise ValueError(f"{fmt.name} needs a multiple of {fmt.super_block} input columns, got {cols}")
    n_sb, per, width = cols // fmt.super_block, fmt.super_block // fmt.sub_block, fmt.sub_block
    sub = w.float().reshape(rows, n_sb, per, width)
    imp = None if importance is None else importance.float().expand(rows, cols).reshape(rows, n_sb, per, width)
    if fmt.zero is not None:
        return _fit_symmetric(fmt, sub, imp)
    s, o = _float_grid(sub, imp, fmt.min_at_most_zero, fmt.maxq)  # [rows, n_sb, per, 1]
    if fmt.super_block == SUB_BLOCK:  # Q4_1, Q5_1: stored as fp16 themselves
        ones = torch.ones(rows, n_sb, dtype=torch.int32, device=w.device)
        return BlockGrid(s.half().float().reshape(rows, n_sb), o.half().float().reshape(rows, n_sb), ones, ones)
    top = fmt.sc_range[1]  # the integer scales' and minima's largest value (6 bits; Q2_K: 4)
    d = (s.amax(2, keepdim=True) / top).half().float()
    dmin = (o.amax(2, keepdim=True) / top).half().float()
    sc, m = _ratio(s, d, top), _ratio(o, dmin, top)
    best_err, best_sc, best_m = _error(sub, d * sc, dmin * m, imp, fmt.maxq), sc, m
    for dsc in (-1, 0, 1):  # the rounded pair is not always the best pair: try its neighbours
        for dm in (-1, 0, 1):
            if dsc == dm == 0:
                continue
            c_sc, c_m = (sc + dsc).clamp(0, top), (m + dm).clamp(0, top)
            err = _error(sub, d * c_sc, dmin * c_m, imp, fmt.maxq)
            better = err < best_err
            best_sc, best_m = torch.where(better, c_sc, best_sc), torch.where(better, c_m, best_m)
            best_err = torch.where(better, err, best_err)
    return BlockGrid(
        d.reshape(rows, n_sb),
        dmin.reshape(rows, n_sb),
        best_sc.reshape(rows, n_sb * per).to(torch.int32),
        best_m.reshape(rows, n_sb * per).to(torch.int32),
    )


def _ratio(x: torch.Tensor, unit: torch.Tensor, top: int) -> torch.Tensor:
    """``round(x / unit)`` in 0..top (0 where ``unit`` is 0), as float."""
    safe = torch.where(unit > 0, unit, torch.ones_like(unit))
    return torch.where(unit > 0, torch.round(x / safe).clamp(0, top), torch.zeros_like(x))


def quantize_codes(w: torch.Tensor, grid: BlockGrid, bits: int = 4) -> torch.Tensor:
    """Nearest codes ``[rows, cols]`` (int32, 0..2^bits − 1) of ``w`` on ``grid``."""
    rows, cols = w.shape
    scale, offset = sub_block_grid(grid)
    sub = w.float().reshape(rows, scale.shape[1], cols // scale.shape[1])
    return _codes(sub, scale.unsqueeze(-1), offset.unsqueeze(-1), 2**bits - 1).reshape(rows, cols).to(torch.int32)
