"""GGUF block formats as qcompiler grids: which quantized layers a GGUF block type holds exactly, and
their bytes in llama.cpp's layout.

``Q8_0`` and ``Q4_0`` are blocks of 32 weights along the input with one fp16 scale ``d`` and
symmetric codes: ``w = d · q`` (``q`` int8) and ``w = d · (q − 8)`` (``q`` in 0..15). That is
qcompiler's symmetric grid with ``group_size=32`` (zero point ``2^(bits−1)``, fp16 scales), so a
layer quantized on it is written code for code: llama.cpp runs the very weights GPTQ measured its
error on. ``Q4_1`` adds an fp16 minimum per block, ``w = d · q + m``: qcompiler's asymmetric 4-bit
grid in groups of 32 (``w = s · (q − z)``) is ``d = s``, ``m = −s · z`` — the codes and ``d`` exactly,
``m`` rounded to fp16 (at most 1/2048 of ``|m|``, under 1 % of one step at ``z ≤ 15``). A layer on
any other grid is re-quantized only when the caller asks (``requantize``), by llama.cpp's own
round-to-nearest (the ``gguf`` package's reference quantizer), never silently.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from qcompiler.algorithms.gptq import groups_in_column_order

__all__ = ["BlockType", "BLOCK_TYPES", "layer_fits", "pack_blocks"]


class BlockType(NamedTuple):
    """A GGUF block type qcompiler writes from its own codes."""

    name: str  # as llama.cpp names it: "Q4_0"
    bits: int  # code width
    block: int  # weights per block (= group_size)
    recipe: str  # the recipe that quantizes onto exactly this grid
    symmetric: bool = True  # no per-block minimum: zero points all 2^(bits-1)


BLOCK_TYPES = {
    "q8_0": BlockType("Q8_0", 8, 32, "gptq-q8_0"),
    "q4_0": BlockType("Q4_0", 4, 32, "gptq-q4_0"),
    "q4_1": BlockType("Q4_1", 4, 32, "gptq-q4_1", symmetric=False),
}


def layer_fits(block: BlockType, bits: int, group_size: int, zeros: torch.Tensor, g_idx: torch.Tensor) -> str | None:
    """Why a ``qc.quant_linear`` layer (``zeros`` ``[groups, out]`` unpacked, ``g_idx`` ``[in]``) is not
    ``block`` code for code, or None when it is."""
    if bits != block.bits or group_size != block.block:
        return f"{bits}-bit groups of {group_size}, not {block.bits}-bit blocks of {block.block}"
    if block.symmetric and not bool((zeros == 2 ** (bits - 1)).all()):
        return f"asymmetric (zero points), while GGUF's {block.name} blocks have none"
    if not groups_in_column_order(g_idx, group_size):
        return "act-order groups (g_idx) out of column order"
    return None


def pack_blocks(
    block: BlockType, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None
) -> np.ndarray:
    """Block bytes ``uint8 [out, in/32 · bytes per block]`` of codes ``[out, in]`` (0..2^bits−1), fp16
    scales ``[out, in/32]`` and (``Q4_1``) integer zero points ``[out, in/32]``, laid out as llama.cpp's
    ``block_q8_0`` / ``block_q4_0`` / ``block_q4_1``."""
    rows, cols = codes.shape
    n = cols // block.block
    d = scales.to(torch.float16).contiguous().view(torch.uint8).view(rows, n, 2)
    if not block.symmetric:  # the block's minimum, d · (0 − z), after d
        m = (-(scales.to(torch.float16).float() * zeros.float())).to(torch.float16).contiguous()
        d = torch.cat([d, m.view(torch.uint8).view(rows, n, 2)], dim=-1)
    c = codes.to(torch.int32).view(rows, n, block.block)
    if block.bits == 8:
        qs = (c - 128).to(torch.int8).view(torch.uint8)  # int8 q = code − 128
    else:  # byte j: element j in the low nibble, element j + 16 in the high one
        c = c.to(torch.uint8)
        qs = c[..., :16] | (c[..., 16:] << 4)
    return torch.cat([d, qs], dim=-1).reshape(rows, -1).numpy()
