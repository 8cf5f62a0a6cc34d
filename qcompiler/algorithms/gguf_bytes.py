"""llama.cpp's block bytes of the ``gguf_grids`` types: ``pack`` writes ``block_q4_K``, ``block_q5_K``,
``block_q6_K``, ``block_q3_K``, ``block_q2_K``, ``block_q4_1``, ``block_q5_1``, ``block_q8_0``,
``block_q4_0`` from codes and a grid; ``dequantize`` reads them back in llama.cpp's float32 steps
(tests compare both with the ``gguf`` package's reference dequantizers, bit for bit).

The symmetric types are read as ``d·sc·q − d·(zero·sc)``: every product there is exact in float32
(fp16 ``d`` has 11 significant bits, ``sc`` at most 8, ``q`` at most 8 with ``sc = 1``), so the value
equals llama.cpp's ``d·sc·(q − zero)`` bit for bit.
"""

from __future__ import annotations

import torch

from qcompiler.algorithms.gguf_grids import BY_NAME, FORMATS, SUB_BLOCK, BlockGrid, GridFormat, sub_block_grid

__all__ = ["pack", "unpack", "dequantize"]


def _half_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).contiguous().view(torch.uint8).view(*x.shape, 2)


def _bit_planes(x: torch.Tensor, shifts: int, step: int = 1) -> torch.Tensor:
    """``Σ_i x[..., i, :] << (step·i)`` over dim −2 (``shifts`` planes), as uint8."""
    weights = torch.arange(0, step * shifts, step, dtype=torch.uint8)[:, None]
    return (x.to(torch.uint8) << weights).sum(-2, dtype=torch.uint8)


def _planes_of(x: torch.Tensor, shifts: int, step: int = 1, mask: int = 1) -> torch.Tensor:
    """Inverse of ``_bit_planes``: ``[..., shifts, n]`` from ``x`` ``[..., n]``."""
    weights = torch.arange(0, step * shifts, step, dtype=torch.uint8)[:, None]
    return (x.unsqueeze(-2) >> weights) & mask


def pack(kind: str, codes: torch.Tensor, grid: BlockGrid) -> torch.Tensor:
    """llama.cpp's block bytes of ``kind``, ``uint8 [rows, blocks · block bytes]``, of codes ``[rows, cols]``."""
    fmt = FORMATS[kind]
    rows, cols = codes.shape
    n_sb = cols // fmt.super_block
    c = codes.to(torch.uint8)
    if fmt.zero is not None:
        return _pack_symmetric(fmt, c, grid, rows, n_sb)
    if fmt.super_block == SUB_BLOCK:  # d, m = −offset, then byte j: weight j (low nibble) and weight j + 16 (high)
        halves = c.view(rows, n_sb, 2, 16)
        qs = (halves[:, :, 0] & 0x0F) | ((halves[:, :, 1] & 0x0F) << 4)
        parts = [_half_bytes(grid.d), _half_bytes(-grid.dmin)]
        if fmt.bits == 5:  # Q5_1: a little-endian uint32 whose bit j is bit 4 of weight j
            parts.append(_bit_planes((c.view(rows, n_sb, 4, 8) >> 4).transpose(-1, -2), 8))
        return torch.cat([*parts, qs], dim=-1).reshape(rows, -1)
    if fmt.name == "Q2_K":  # 16 bytes sc | m << 4, then weight p of half h at bits 2j of qs[32h + p % 32], j = p // 32
        scales = grid.sc.to(torch.uint8).view(rows, n_sb, 16) | (grid.m.to(torch.uint8).view(rows, n_sb, 16) << 4)
        qs = _bit_planes(c.view(rows, n_sb, 2, 4, 32), 4, 2).reshape(rows, n_sb, 64)
        return torch.cat([scales, qs, _half_bytes(grid.d), _half_bytes(grid.dmin)], dim=-1).reshape(rows, -1)
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
    pairs = c.view(rows, n_sb, 4, 2, SUB_BLOCK)
    qs = ((pairs[:, :, :, 0] & 0x0F) | ((pairs[:, :, :, 1] & 0x0F) << 4)).reshape(rows, n_sb, 128)
    parts = [_half_bytes(grid.d), _half_bytes(grid.dmin), scales]
    if fmt.bits == 5:  # Q5_K: byte l of qh holds bit 4 of weight l of sub-block j as its bit j
        parts.append(_bit_planes(c.view(rows, n_sb, 8, SUB_BLOCK) >> 4, 8))
    return torch.cat([*parts, qs], dim=-1).reshape(rows, -1)


def _pack_symmetric(fmt: GridFormat, c: torch.Tensor, grid: BlockGrid, rows: int, n_sb: int) -> torch.Tensor:
    d = _half_bytes(grid.d)
    if fmt.name == "Q8_0":  # d, 32 × int8 (q − 128)
        return torch.cat([d, (c.view(rows, n_sb, 32) ^ 0x80)], dim=-1).reshape(rows, -1)
    if fmt.name == "Q4_0":  # d, byte j: weight j (low nibble) and weight j + 16 (high)
        halves = c.view(rows, n_sb, 2, 16)
        return torch.cat([d, halves[:, :, 0] | (halves[:, :, 1] << 4)], dim=-1).reshape(rows, -1)
    sc = grid.sc.view(rows, n_sb, 16)
    if fmt.name == "Q6_K":
        # per half of 128: ql byte l = weight l | weight l + 64 << 4, byte l + 32 = weight l + 32 | l + 96;
        # qh byte l = the high 2 bits of weights l, l + 32, l + 64, l + 96 at bits 0, 2, 4, 6
        q = c.view(rows, n_sb, 2, 4, 32)
        low, high = q & 0x0F, q >> 4
        ql = torch.cat([low[:, :, :, 0] | (low[:, :, :, 2] << 4), low[:, :, :, 1] | (low[:, :, :, 3] << 4)], dim=-1)
        qh = _bit_planes(high, 4, 2)
        scales = sc.to(torch.int8).view(torch.uint8)
        return torch.cat([ql.reshape(rows, n_sb, 128), qh.reshape(rows, n_sb, 64), scales, d], dim=-1).reshape(rows, -1)
    # Q3_K: weight p of half h: j = p // 32, r = p % 32; its low 2 bits are bits 2j of qs[32h + r], its
    # third bit is bit 4h + j of hmask[r]; the 16 scales (sc + 32, 6 bits) packed as get_scale_shift reads them
    q = c.view(rows, n_sb, 2, 4, 32)
    qs = _bit_planes(q & 3, 4, 2).reshape(rows, n_sb, 64)
    hmask = _bit_planes((q >> 2).reshape(rows, n_sb, 8, 32), 8)
    l6 = (sc + 32).to(torch.uint8)
    low = (l6[..., :8] & 0x0F) | ((l6[..., 8:] & 0x0F) << 4)
    high = _bit_planes((l6 >> 4).view(rows, n_sb, 4, 4), 4, 2)
    return torch.cat([hmask, qs, low, high, d], dim=-1).reshape(rows, -1)


def _unpack_symmetric(fmt: GridFormat, b: torch.Tensor, rows: int, n_sb: int) -> tuple[torch.Tensor, BlockGrid]:
    """Codes ``[rows, n_sb, super_block]`` and the grid of symmetric blocks ``b`` ``[rows, n_sb, bytes]``."""
    d = b[..., -2:].contiguous().view(torch.float16).float() if fmt.super_block > 32 else None
    if fmt.name == "Q8_0":
        d, q = b[..., :2].contiguous().view(torch.float16).float(), b[..., 2:] ^ 0x80
        sc = torch.ones(rows, n_sb, dtype=torch.int32)
    elif fmt.name == "Q4_0":
        d, qs = b[..., :2].contiguous().view(torch.float16).float(), b[..., 2:].unsqueeze(-2)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-2).reshape(rows, n_sb, 32)
        sc = torch.ones(rows, n_sb, dtype=torch.int32)
    elif fmt.name == "Q6_K":
        ql, qh = b[..., :128].reshape(rows, n_sb, 2, 64), b[..., 128:192].reshape(rows, n_sb, 2, 32)
        low = torch.stack([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], dim=-2)
        q = (low | (_planes_of(qh, 4, 2, 3) << 4)).reshape(rows, n_sb, 256)
        sc = b[..., 192:208].contiguous().view(torch.int8).to(torch.int32).reshape(rows, -1)
    else:  # Q3_K
        hmask, qs = b[..., :32], b[..., 32:96].reshape(rows, n_sb, 2, 32)
        low2 = _planes_of(qs, 4, 2, 3)  # [rows, n_sb, 2, 4, 32]
        third = _planes_of(hmask, 8).reshape(rows, n_sb, 2, 4, 32)
        q = (low2 | (third << 2)).reshape(rows, n_sb, 256)
        low, high = b[..., 96:104], b[..., 104:108]
        l6 = torch.cat([low & 0x0F, low >> 4], dim=-1) | (_planes_of(high, 4, 2, 3).reshape(rows, n_sb, 16) << 4)
        sc = (l6.to(torch.int32) - 32).reshape(rows, -1)
    d = d.reshape(rows, n_sb)
    return q, BlockGrid(d, d, sc, fmt.zero * sc)


def _unpack_free_min(fmt: GridFormat, b: torch.Tensor, rows: int, n_sb: int) -> tuple[torch.Tensor, BlockGrid]:
    """Codes ``[rows, n_sb, super_block]`` and the grid of free-minimum blocks ``b`` ``[rows, n_sb, bytes]``
    (Q4_1 / Q5_1 store the minimum ``m = −offset``: the grid's offset is ``−m``, sc = m = 1)."""
    if fmt.name == "Q2_K":  # 16 bytes sc | m << 4, 64 of codes, d, dmin
        d, dmin = (b[..., i : i + 2].contiguous().view(torch.float16).float() for i in (80, 82))
        sc, m = (b[..., :16] & 0x0F).to(torch.int32), (b[..., :16] >> 4).to(torch.int32)
        q = _planes_of(b[..., 16:80].reshape(rows, n_sb, 2, 32), 4, 2, 3).reshape(rows, n_sb, 256)
    elif fmt.super_block == SUB_BLOCK:  # Q4_1, Q5_1: d, m, (Q5_1: the fifth bits), nibbles
        d, dmin = (
            b[..., 0:2].contiguous().view(torch.float16).float(),
            -b[..., 2:4].contiguous().view(torch.float16).float(),
        )
        qs = b[..., -16:].reshape(rows, n_sb, 1, 16)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(rows, n_sb, 32)
        if fmt.bits == 5:  # bit j of the uint32 (bytes 4-7) is bit 4 of weight j
            q = q | (_planes_of(b[..., 4:8], 8).transpose(-1, -2).reshape(rows, n_sb, 32) << 4)
        sc = m = torch.ones(rows, n_sb, 1, dtype=torch.int32)
    else:  # Q4_K, Q5_K
        d, dmin = (
            b[..., 0:2].contiguous().view(torch.float16).float(),
            b[..., 2:4].contiguous().view(torch.float16).float(),
        )
        low, mins, nibbles = b[..., 4:8], b[..., 8:12], b[..., 12:16]
        sc = torch.cat([low & 0x3F, (nibbles & 0x0F) | ((low >> 6) << 4)], dim=-1).to(torch.int32)
        m = torch.cat([mins & 0x3F, (nibbles >> 4) | ((mins >> 6) << 4)], dim=-1).to(torch.int32)
        qs = b[..., -128:].reshape(rows, n_sb, 4, 1, SUB_BLOCK)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(rows, n_sb, 8, SUB_BLOCK)
        if fmt.bits == 5:  # the fifth bits: bit j of qh byte l belongs to weight l of sub-block j
            q = q | (_planes_of(b[..., 16:48], 8) << 4)
        q = q.reshape(rows, n_sb, 256)
    return q, BlockGrid(d.reshape(rows, n_sb), dmin.reshape(rows, n_sb), sc.reshape(rows, -1), m.reshape(rows, -1))


def unpack(block_type: str, blocks: torch.Tensor, cols: int) -> tuple[torch.Tensor, BlockGrid]:
    """Codes ``[rows, cols]`` (int32) and the grid that llama.cpp bytes of ``block_type`` hold."""
    fmt = BY_NAME[block_type]
    rows, n_sb = blocks.shape[0], cols // fmt.super_block
    b = blocks.reshape(rows, n_sb, fmt.block_bytes)
    q, grid = (_unpack_symmetric if fmt.zero is not None else _unpack_free_min)(fmt, b, rows, n_sb)
    return q.reshape(rows, cols).to(torch.int32), grid


def dequantize(block_type: str, blocks: torch.Tensor, cols: int) -> torch.Tensor:
    """The float32 weight ``[rows, cols]`` that llama.cpp bytes of ``block_type`` (``FORMATS``' names) stand
    for: ``scale·q − offset`` per sub-block, as llama.cpp computes it (``d·sc`` and ``dmin·m`` are exact
    in float32, and Q4_1's ``d·q + m`` is ``d·q − (−m)``)."""
    q, grid = unpack(block_type, blocks, cols)
    scale, offset = sub_block_grid(grid)
    rows = q.shape[0]
    q = q.reshape(rows, scale.shape[1], -1).float()
    return (scale.unsqueeze(-1) * q - offset.unsqueeze(-1)).reshape(rows, cols)
