"""llama.cpp's block grids with a free minimum: ``Q4_K``, ``Q5_K``, ``Q4_1`` and ``Q5_1``.

A weight is ``scale · q − offset`` with ``q`` in 0..15 (5-bit types: 0..31) and a (scale, offset)
pair per sub-block of 32 input columns — unlike qcompiler's affine grid ``s·(q − z)``, whose
integer zero point ``z`` puts the offset on the scale's own lattice. ``Q4_1`` stores both as fp16
per block of 32 (5 bits per weight; its minimum may be positive), ``Q5_1`` likewise with 5-bit
codes (6 bits per weight). ``Q4_K`` stores them as 6-bit integers ``sc``, ``m`` per sub-block
times fp16 ``d``, ``dmin`` per super-block of 256 (4.5 bits per weight; the offset is never
negative, so the grid reaches down to 0); ``Q5_K`` is Q4_K with 5-bit codes (5.5 bits per weight).
Such layers keep llama.cpp's bytes (``qc.gguf_linear``).

``fit_grid`` chooses the grid the way a calibrated quantizer should: per sub-block, the scale and
offset minimizing the importance-weighted rounding error (clipped ranges, each refitted by weighted
least squares on its codes, as llama.cpp's ``make_qkx`` does), then rounded to the format's storage
(K types: the 6-bit pairs against ``d`` / ``dmin``, each pair then nudged by ±1 where that lowers
its error). GPTQ rounds against exactly that grid (``sub_block_grid``), so the codes it chooses
are the codes llama.cpp runs. ``pack`` / ``dequantize`` are llama.cpp's ``block_q4_K``,
``block_q5_K``, ``block_q4_1``, ``block_q5_1`` and their dequantization in its float32 steps (tests
compare them with the ``gguf`` package's reference dequantizers, bit for bit).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = [
    "GridFormat",
    "FORMATS",
    "GRID_FALLBACK",
    "FreeMinGrid",
    "fit_grid",
    "sub_block_grid",
    "quantize_codes",
    "pack",
    "dequantize",
]

SUB_BLOCK = 32
_MAX6 = 63
# Clipping factors of a sub-block's range: every 0.1 from 1 to 0.5, then ±0.025 and ±0.05 around the best
# (on a 512 x 1024 test matrix: the error of the 21-step search of quant_grid.CLIP_SHRINKS at half its time)
_COARSE = tuple(1.0 - 0.1 * i for i in range(6))
_FINE = (-0.05, -0.025, 0.025, 0.05)


class FreeMinGrid(NamedTuple):
    """A grid of a ``[rows, cols]`` matrix: sub-block ``j`` of super-block ``b`` has scale
    ``d[:, b]·sc[:, j]`` and offset ``dmin[:, b]·m[:, j]`` (Q4_1: one sub-block per block, sc = m = 1)."""

    d: torch.Tensor  # [rows, super-blocks] float32 holding fp16 values
    dmin: torch.Tensor  # [rows, super-blocks] float32 holding fp16 values
    sc: torch.Tensor  # [rows, sub-blocks] int32
    m: torch.Tensor  # [rows, sub-blocks] int32


class GridFormat(NamedTuple):
    """One llama.cpp block type with a free minimum."""

    name: str  # llama.cpp's: "Q4_K"
    super_block: int  # input columns per stored block
    block_bytes: int
    min_at_most_zero: bool  # the offset is stored unsigned (Q4_K): the grid reaches down to 0
    bits: int  # of each code

    @property
    def maxq(self) -> int:
        """The largest code."""
        return 2**self.bits - 1


FORMATS = {
    "q4_k": GridFormat("Q4_K", 256, 144, True, 4),  # fp16 d, fp16 dmin, 12 bytes of 6-bit sc/m, 128 of nibbles
    "q5_k": GridFormat("Q5_K", 256, 176, True, 5),  # as Q4_K, plus 32 bytes of the codes' fifth bits
    "q4_1": GridFormat("Q4_1", 32, 20, False, 4),  # fp16 d, fp16 m (= −offset), 16 bytes of nibbles
    "q5_1": GridFormat("Q5_1", 32, 24, False, 5),  # as Q4_1, plus a uint32 of the codes' fifth bits
}
_BY_NAME = {f.name: f for f in FORMATS.values()}
# A super-block grid's stand-in for a width it cannot hold: the 32-column type with the same code width
# (llama-quantize falls back too, one step up for Q4_K: Q4_K -> Q5_0, Q5_K -> Q5_1).
GRID_FALLBACK = {"q4_k": "q4_1", "q5_k": "q5_1"}


def sub_block_grid(grid: FreeMinGrid) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sub-block ``(scale, offset)`` ``[rows, sub-blocks]`` float32, as llama.cpp computes them:
    ``d·sc`` and ``dmin·m`` (exact in float32); a weight is ``scale·q − offset``."""
    per = grid.sc.shape[1] // grid.d.shape[1]
    return grid.d.repeat_interleave(per, 1) * grid.sc.float(), grid.dmin.repeat_interleave(per, 1) * grid.m.float()


def _codes(w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, maxq: int) -> torch.Tensor:
    """Nearest codes of ``w`` ``[..., 32]`` on ``scale·q − offset`` (``[..., 1]``), q in 0..maxq, as
    float; a zero scale gives 0 (dividing by +inf)."""
    divisor = torch.where(scale > 0, scale, torch.full_like(scale, float("inf")))
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


def fit_grid(kind: str, w: torch.Tensor, importance: Optional[torch.Tensor] = None) -> FreeMinGrid:
    """The ``kind`` ("q4_k", "q5_k", "q4_1") grid for ``w`` ``[rows, cols]`` (cols a multiple of its block)
    minimizing the rounding error weighted by ``importance`` (``[cols]`` or ``[rows, cols]``, ≥ 0)."""
    fmt = FORMATS[kind]
    rows, cols = w.shape
    if cols % fmt.super_block:
        raise ValueError(f"{fmt.name} needs a multiple of {fmt.super_block} input columns, got {cols}")
    n_sb, per = cols // fmt.super_block, fmt.super_block // SUB_BLOCK
    sub = w.float().reshape(rows, n_sb, per, SUB_BLOCK)
    imp = None if importance is None else importance.float().expand(rows, cols).reshape(rows, n_sb, per, SUB_BLOCK)
    s, o = _float_grid(sub, imp, fmt.min_at_most_zero, fmt.maxq)  # [rows, n_sb, per, 1]
    if fmt.super_block == SUB_BLOCK:  # Q4_1, Q5_1: stored as fp16 themselves
        ones = torch.ones(rows, n_sb, dtype=torch.int32, device=w.device)
        return FreeMinGrid(s.half().float().reshape(rows, n_sb), o.half().float().reshape(rows, n_sb), ones, ones)
    d = (s.amax(2, keepdim=True) / _MAX6).half().float()
    dmin = (o.amax(2, keepdim=True) / _MAX6).half().float()
    sc, m = _ratio(s, d), _ratio(o, dmin)
    best_err, best_sc, best_m = _error(sub, d * sc, dmin * m, imp, fmt.maxq), sc, m
    for dsc in (-1, 0, 1):  # the rounded pair is not always the best pair: try its neighbours
        for dm in (-1, 0, 1):
            if dsc == dm == 0:
                continue
            c_sc, c_m = (sc + dsc).clamp(0, _MAX6), (m + dm).clamp(0, _MAX6)
            err = _error(sub, d * c_sc, dmin * c_m, imp, fmt.maxq)
            better = err < best_err
            best_sc, best_m = torch.where(better, c_sc, best_sc), torch.where(better, c_m, best_m)
            best_err = torch.where(better, err, best_err)
    return FreeMinGrid(
        d.reshape(rows, n_sb),
        dmin.reshape(rows, n_sb),
        best_sc.reshape(rows, n_sb * per).to(torch.int32),
        best_m.reshape(rows, n_sb * per).to(torch.int32),
    )


def _ratio(x: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """``round(x / unit)`` in 0..63 (0 where ``unit`` is 0), as float."""
    safe = torch.where(unit > 0, unit, torch.ones_like(unit))
    return torch.where(unit > 0, torch.round(x / safe).clamp(0, _MAX6), torch.zeros_like(x))


def quantize_codes(w: torch.Tensor, grid: FreeMinGrid, bits: int = 4) -> torch.Tensor:
    """Nearest codes ``[rows, cols]`` (int32, 0..2^bits − 1) of ``w`` on ``grid``."""
    rows, cols = w.shape
    scale, offset = sub_block_grid(grid)
    sub = w.float().reshape(rows, cols // SUB_BLOCK, SUB_BLOCK)
    return _codes(sub, scale.unsqueeze(-1), offset.unsqueeze(-1), 2**bits - 1).reshape(rows, cols).to(torch.int32)


def _half_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).contiguous().view(torch.uint8).view(*x.shape, 2)


def pack(kind: str, codes: torch.Tensor, grid: FreeMinGrid) -> torch.Tensor:
    """llama.cpp's block bytes of ``kind``, ``uint8 [rows, blocks · block bytes]``, of codes ``[rows, cols]``."""
    fmt = FORMATS[kind]
    rows, cols = codes.shape
    n_sb = cols // fmt.super_block
    if fmt.super_block == SUB_BLOCK:  # d, m = −offset, then byte j: weight j (low nibble) and weight j + 16 (high)
        c = codes.to(torch.uint8).view(rows, n_sb, 2, 16)
        qs = (c[:, :, 0] & 0x0F) | ((c[:, :, 1] & 0x0F) << 4)
        parts = [_half_bytes(grid.d), _half_bytes(-grid.dmin)]
        if fmt.bits == 5:  # Q5_1: a little-endian uint32 whose bit j is bit 4 of weight j
            high = (codes.view(rows, n_sb, 4, 8).to(torch.uint8) >> 4) << torch.arange(8, dtype=torch.uint8)
            parts.append(high.sum(-1, dtype=torch.uint8))
        return torch.cat([*parts, qs], dim=-1).reshape(rows, -1)
    sc, m = grid.sc.to(torch.uint8).view(rows, n_sb, 8), grid.m.to(torch.uint8).view(rows, n_sb, 8)
    # bytes 0-3: sc[0:4] with sc[4:8]'s high 2 bits on top; 4-7: m[0:4] with m[4:8]'s; 8-11: the low nibbles
    scales = torch.cat(
        [
            sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
            m[..., :4] | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4),
        ],
        dim=-1,
    )
    # each 64 weights: byte l holds weight l (low nibble) and weight l + 32 (high nibble)
    c = codes.to(torch.uint8).view(rows, n_sb, 4, 2, SUB_BLOCK)
    qs = ((c[:, :, :, 0] & 0x0F) | ((c[:, :, :, 1] & 0x0F) << 4)).reshape(rows, n_sb, 128)
    parts = [_half_bytes(grid.d), _half_bytes(grid.dmin), scales]
    if fmt.bits == 5:  # Q5_K: byte l of qh holds bit 4 of weight l of sub-block j as its bit j
        high = (codes.to(torch.uint8).view(rows, n_sb, 8, SUB_BLOCK) >> 4) << torch.arange(8, dtype=torch.uint8)[
            :, None
        ]
        parts.append(high.sum(2, dtype=torch.uint8))
    return torch.cat([*parts, qs], dim=-1).reshape(rows, -1)


def dequantize(block_type: str, blocks: torch.Tensor, cols: int) -> torch.Tensor:
    """The float32 weight ``[rows, cols]`` that llama.cpp bytes of ``block_type`` (``FORMATS``' names) stand for."""
    fmt = _BY_NAME[block_type]
    rows, n_sb = blocks.shape[0], cols // fmt.super_block
    b = blocks.reshape(rows, n_sb, fmt.block_bytes)
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [rows, n_sb, 1]
    second = b[..., 2:4].contiguous().view(torch.float16).float()
    if fmt.super_block == SUB_BLOCK:  # Q4_1, Q5_1: d · q + m
        qs = b[..., -16:].reshape(rows, n_sb, 1, 16)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(rows, n_sb, 32)
        if fmt.bits == 5:  # bit j of the uint32 (bytes 4-7) is bit 4 of weight j
            qh = b[..., 4:8].reshape(rows, n_sb, 4, 1)
            q = q | ((((qh >> torch.arange(8, dtype=torch.uint8)) & 1) << 4).reshape(rows, n_sb, 32))
        return (d * q.float() + second).reshape(rows, cols)
    low, mins, nibbles = b[..., 4:8], b[..., 8:12], b[..., 12:16]
    sc = torch.cat([low & 0x3F, (nibbles & 0x0F) | ((low >> 6) << 4)], dim=-1)
    m = torch.cat([mins & 0x3F, (nibbles >> 4) | ((mins >> 6) << 4)], dim=-1)
    scale, offset = (d * sc.float()).unsqueeze(-1), (second * m.float()).unsqueeze(-1)  # [rows, n_sb, 8, 1]
    qs = b[..., -128:].reshape(rows, n_sb, 4, 1, SUB_BLOCK)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(rows, n_sb, 8, SUB_BLOCK)
    if fmt.bits == 5:  # the fifth bits: bit j of qh byte l belongs to weight l of sub-block j
        qh = b[..., 16:48].reshape(rows, n_sb, 1, SUB_BLOCK)
        q = q | (((qh >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1) << 4)
    q = q.float()
    return (scale * q - offset).reshape(rows, cols)
