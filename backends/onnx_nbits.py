"""ONNX Runtime's ``MatMulNBits`` layout, and the export-only ops that compute in it.

``B`` uint8 ``[N, K/block, block·bits/8]`` (first value in the low bits), ``scales``
``[N·K/block]``, uint8-packed integer zero points; a K that is not a multiple of the block pads
the last block. Each op here has a torch reference (tested against the ``qc`` op it replaces) and
is translated to ONNX by ``onnx_export``: ``matmul_nbits`` (one linear), ``experts_matmul_nbits``
(a MoE layer's quantized experts, one MatMulNBits per expert on its rows) and ``experts_matmul``
(full-precision experts).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from qcompiler.algorithms.packing import pack_rows, unpack_cols, unpack_rows
from qcompiler.ir.op_registry import OpSpec, register
from qcompiler.ir.ops import per_expert

__all__ = [
    "to_matmul_nbits_layout",
    "block_zero_codes",
    "dequantize_matmul_nbits",
    "matmul_nbits",
    "experts_matmul_nbits",
    "experts_matmul",
    "gptq_to_nbits",
    "block_size_for",
    "sorted_groups",
]


def _pack_bytes(codes: Tensor, bits: int) -> Tensor:
    """[N, K] codes → uint8 [N, K·bits/8], little-endian bit stream along K."""
    n, k = codes.shape
    pad = (-k) % (32 // bits)
    if pad:
        codes = torch.cat([codes, torch.zeros(n, pad, dtype=codes.dtype)], dim=1)
    words = pack_rows(codes.t().contiguous().long(), bits).t().contiguous()  # [N, K·bits/32] int32
    return words.reshape(-1).view(torch.uint8).reshape(n, -1)[:, : math.ceil(k * bits / 8)]


def _unpack_bytes(data: Tensor, bits: int, k: int) -> Tensor:
    n = data.shape[0]
    pad = (-data.shape[1]) % 4
    data = torch.cat([data, torch.zeros(n, pad, dtype=torch.uint8)], dim=1) if pad else data
    words = data.contiguous().reshape(-1).view(torch.int32).reshape(n, -1).t()
    total = words.shape[0] * 32 // bits
    return unpack_rows(words, bits, total).t()[:, :k]


def to_matmul_nbits_layout(
    codes: Tensor, scales: Tensor, zeros: Tensor, bits: int, block_size: int, float_zeros: bool
) -> dict[str, Tensor]:
    """Codes [N, K] and per-block scales/zeros [N, ceil(K/block)] (columns already in processing
    order). A K that is not a multiple of the block pads the last block with zero codes, as
    MatMulNBits defines (``n_blocks_per_col = ceil(K / block_size)``)."""
    n, k = codes.shape
    blocks = -(-k // block_size)
    if blocks * block_size != k:
        codes = torch.cat([codes, codes.new_zeros(n, blocks * block_size - k)], dim=1)
    b = _pack_bytes(codes, bits).reshape(n, blocks, block_size * bits // 8)
    zp = zeros.float().reshape(-1) if float_zeros else _pack_bytes(zeros.round().to(torch.int64), bits).reshape(-1)
    return {"B": b.contiguous(), "scales": scales.float().reshape(-1).contiguous(), "zero_points": zp.contiguous()}


def dequantize_matmul_nbits(
    B: Tensor, scales: Tensor, zero_points: Tensor, K: int, N: int, bits: int, block_size: int
) -> Tensor:
    """The float32 weight [N, K] that a MatMulNBits node computes with (ORT's definition; the last
    block may be partial)."""
    blocks = -(-K // block_size)
    codes = _unpack_bytes(B.reshape(N, -1), bits, K).float()
    s = scales.float().reshape(N, blocks).repeat_interleave(block_size, dim=1)[:, :K]
    if zero_points.dtype == torch.uint8:
        z = block_zero_codes(zero_points, N, blocks, bits).float()
    else:
        z = zero_points.float().reshape(N, blocks)
    return (codes - z.repeat_interleave(block_size, dim=1)[:, :K]) * s


def block_zero_codes(zero_points: Tensor, N: int, blocks: int, bits: int) -> Tensor:
    """MatMulNBits' packed uint8 zero points → the integer zero point of each block, ``[N, blocks]``."""
    return _unpack_bytes(zero_points.reshape(N, -1), bits, blocks)


@torch.library.custom_op("qc::matmul_nbits", mutates_args=())
def matmul_nbits(
    x: Tensor,
    B: Tensor,
    scales: Tensor,
    zero_points: Tensor,
    perm: Optional[Tensor],
    group_corr: Optional[Tensor],
    bias: Optional[Tensor],
    K: int,
    N: int,
    bits: int,
    block_size: int,
) -> Tensor:
    """ORT MatMulNBits semantics (after gathering input columns by ``perm`` when given), plus
    ``(per-block sums of x) @ group_corr`` when zero points were fractional."""
    if perm is not None:
        x = x[..., perm.long()]
    w = dequantize_matmul_nbits(B, scales, zero_points, K, N, bits, block_size).to(x.dtype)
    y = x @ w.t()
    if group_corr is not None:
        y = y + x.reshape(*x.shape[:-1], K // block_size, block_size).sum(-1) @ group_corr.to(x.dtype)
    return y if bias is None else y + bias.to(x.dtype)


@matmul_nbits.register_fake
def _matmul_nbits_fake(x, B, scales, zero_points, perm, group_corr, bias, K, N, bits, block_size):
    return x.new_empty((*x.shape[:-1], N))


def block_size_for(group: int, k: int) -> Optional[int]:
    """The MatMulNBits block (a power of two >= 16) that tiles ``group`` (a shorter last group
    becomes the padded last block); per-channel: 128 (every block of a row has its scale).
    None if no block tiles the group."""
    if group == -1:
        return 128
    for b in (128, 64, 32, 16):
        if group % b == 0:
            return b
    return None


def sorted_groups(g_idx: Tensor) -> Optional[Tensor]:
    """The permutation that makes groups contiguous (None if they already are)."""
    if bool((g_idx[1:] >= g_idx[:-1]).all()):
        return None
    return torch.argsort(g_idx.long(), stable=True)


def gptq_to_nbits(
    qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int, group: int
) -> Optional[tuple]:
    """One GPTQ-layout matrix in MatMulNBits' layout: ``(tensors, perm, K, N, bits, block)``, or
    None when no MatMulNBits block tiles the group."""
    k, n = g_idx.numel(), scales.shape[1]
    block = block_size_for(group, k)
    if block is None:
        return None
    codes = unpack_rows(qweight, bits, k).t()  # [N, K]
    zeros = unpack_cols(qzeros, bits, n).t()  # [N, groups]
    perm = sorted_groups(g_idx)
    order = perm if perm is not None else torch.arange(k)
    g = g_idx.long()[order]
    col_scale = scales.float().t()[:, g]  # [N, K] per column, processing order
    col_zero = zeros[:, g]
    pick = torch.arange(0, k, block)
    out_bits = 4 if bits == 3 else bits
    tensors = to_matmul_nbits_layout(codes[:, order], col_scale[:, pick], col_zero[:, pick], out_bits, block, False)
    return tensors, perm, k, n, out_bits, block


@torch.library.custom_op("qc::experts_matmul_nbits", mutates_args=())
def experts_matmul_nbits(
    x: Tensor,
    offsets: Tensor,
    B: Tensor,
    scales: Tensor,
    zero_points: Tensor,
    perm: Optional[Tensor],
    K: int,
    N: int,
    bits: int,
    block_size: int,
    group_corr: Optional[Tensor] = None,
) -> Tensor:
    """``qc.quant_experts_linear`` (or SpQR experts' dense branch) in MatMulNBits' layout:
    ``matmul_nbits``'s tensors stacked on a leading expert dim (``perm`` [E, K] when any expert has
    act-order groups, ``group_corr`` [E, blocks, N] for SpQR's fractional zeros); rows past the
    last offset stay zero."""
    return per_expert(
        x,
        offsets,
        N,
        lambda rows, e: matmul_nbits(
            rows,
            B[e],
            scales[e],
            zero_points[e],
            None if perm is None else perm[e],
            None if group_corr is None else group_corr[e],
            None,
            K,
            N,
            bits,
            block_size,
        ),
    )


@experts_matmul_nbits.register_fake
def _experts_matmul_nbits_fake(x, offsets, B, scales, zero_points, perm, K, N, bits, block_size, group_corr=None):
    return x.new_empty((x.shape[0], N))


@torch.library.custom_op("qc::experts_matmul", mutates_args=())
def experts_matmul(x: Tensor, offsets: Tensor, weight: Tensor) -> Tensor:
    """A full-precision grouped matmul (transformers' MoE experts): ``weight`` [E, in, out], rows of
    ``x`` sorted by expert, ``offsets`` cumulative row counts; rows past the last offset stay zero."""
    return per_expert(x, offsets, weight.shape[2], lambda rows, e: rows @ weight[e].to(x.dtype))


@experts_matmul.register_fake
def _experts_matmul_fake(x, offsets, weight):
    return x.new_empty((x.shape[0], weight.shape[2]))


register(OpSpec("matmul_nbits", export_only="onnx"))  # export-only layouts (never saved)
register(OpSpec("experts_matmul_nbits", export_only="onnx"))
register(OpSpec("experts_matmul", export_only="onnx"))
