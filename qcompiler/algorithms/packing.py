"""Bit packing of the GPTQ checkpoint layout.

Codes of ``bits`` bits are laid end to end as one little-endian bit stream along a dimension and
cut into int32 words: value ``i`` occupies stream bits ``[i·bits, (i+1)·bits)``. For 2, 4 and 8
bits this is exactly GPTQ's ``qweight``/``qzeros`` packing (32/bits values per word); for 3 bits it
is the AutoGPTQ layout where 32 values fill 3 words and some values straddle two words.
"""

from __future__ import annotations

import math

import torch

__all__ = ["SUPPORTED_BITS", "packed_length", "pack_rows", "unpack_rows", "pack_cols", "unpack_cols"]

SUPPORTED_BITS = (2, 3, 4, 8)


def packed_length(n: int, bits: int) -> int:
    """int32 words needed for ``n`` values; ``n·bits`` must fill whole words."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if (n * bits) % 32:
        raise ValueError(
            f"{n} values of {bits} bits do not fill whole int32 words (need a multiple of {32 // math.gcd(bits, 32)})"
        )
    return n * bits // 32


def _positions(n: int, bits: int, device=None):
    start = torch.arange(n, dtype=torch.int64, device=device) * bits
    return start // 32, start % 32


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes ``[n, cols]`` (values in ``[0, 2^bits)``) into int32 ``[n·bits/32, cols]``."""
    n = codes.shape[0]
    words = packed_length(n, bits)
    if codes.numel():
        smallest, largest = torch.aminmax(codes)
        if smallest < 0 or largest >= (1 << bits):
            raise ValueError(
                f"codes must lie in [0, {1 << bits}) for {bits} bits, got range [{smallest.item()}, {largest.item()}]"
            )
    if 32 % bits == 0:  # 2, 4, 8 bits: whole values per word, OR-ed in int32 (shifts wrap into the sign bit)
        per_word = 32 // bits
        grouped = codes.to(torch.int32).reshape(words, per_word, *codes.shape[1:])
        out = grouped[:, 0].clone(memory_format=torch.contiguous_format)  # canonical strides, never a view of codes
        for k in range(1, per_word):
            out |= grouped[:, k] << (k * bits)
        return out
    c = codes.to(torch.int64)
    word, shift = _positions(n, bits, c.device)
    out = torch.zeros((words + 1, *c.shape[1:]), dtype=torch.int64, device=c.device)
    shape = (-1,) + (1,) * (c.dim() - 1)
    low = (c << shift.view(shape)) & 0xFFFFFFFF
    out.index_add_(0, word, low)
    high = c >> (32 - shift).view(shape)  # the part that spills into the next word (0 if none)
    out.index_add_(0, word + 1, high)
    out = out[:words]
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def unpack_rows(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_rows`: int32 ``[n·bits/32, cols]`` → int32 codes ``[n, cols]``."""
    words = packed_length(n, bits)
    if packed.shape[0] != words:
        raise ValueError(f"packed tensor has {packed.shape[0]} rows, expected {words} for {n} values of {bits} bits")
    if 32 % bits == 0:  # 2, 4, 8 bits: whole values per word, one shift and mask in int32
        per_word = 32 // bits
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
        shifts = shifts.view(1, per_word, *(1,) * (packed.dim() - 1))
        value = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)  # the arithmetic shift's sign bits are masked off
        return value.reshape(n, *packed.shape[1:]).to(torch.int32)
    p = packed.to(torch.int64) & 0xFFFFFFFF
    p = torch.cat([p, torch.zeros_like(p[:1])])  # a zero word after the last, for spills
    word, shift = _positions(n, bits, p.device)
    shape = (-1,) + (1,) * (p.dim() - 1)
    value = (p[word] >> shift.view(shape)) | (p[word + 1] << (32 - shift).view(shape))
    return (value & ((1 << bits) - 1)).to(torch.int32)


def pack_cols(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack along the last dim (``qzeros`` layout): ``[rows, n]`` → ``[rows, n·bits/32]``."""
    return pack_rows(codes.t(), bits).t().contiguous()


def unpack_cols(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The ``n`` codes per row that :func:`pack_cols` packed along the last dim."""
    return unpack_rows(packed.t(), bits, n).t().contiguous()
