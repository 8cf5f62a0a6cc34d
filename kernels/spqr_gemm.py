"""SpQR's dense branch (``qc.spqr_dense_linear``): small groups with bi-level (quantized) statistics.

Like the GPTQ kernel, but each weight tile's scale and zero are themselves dequantized in the
kernel — their ``stat_bits`` codes times the fp16 (step, minimum) of their run of
``stat_group_size`` output rows — and the packed rows are in act-order, so the activation columns
are gathered through ``perm`` instead of the weights being un-permuted. When groups tile the
``BLOCK_K`` rows evenly (SpQR's 16), statistics are dequantized once per group, not once per row.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from qcompiler.algorithms.packing import SUPPORTED_BITS
from qcompiler.ir.ops import per_expert
from qcompiler.kernels.bitstream import bits_at
from qcompiler.kernels.csr_spmm import csr_linear
from qcompiler.kernels.gemm_parts import dot_accumulate, split_k_range, store_output
from qcompiler.kernels.gptq_gemm import launch_lowbit_gemm, tunable_pair
from qcompiler.kernels.tuning import UnsupportedKernel, check_activation
from qcompiler.layouts.spqr import expert_csr

__all__ = ["spqr_dense_linear", "spqr_experts_linear"]

_MIN_BLOCK_K = 32  # every BLOCK_K tried is a multiple of it, so groups dividing it never straddle tiles


@triton.jit
def _group_stat(codes_ptr, table_ptr, g, rn, mask, N, STAT_BITS: tl.constexpr, STAT_GROUP: tl.constexpr):
    """Second-level dequantization: statistic (row ``g``, column ``rn``) = step · code + minimum."""
    words_per_row = (N * STAT_BITS) // 32
    code = bits_at(
        codes_ptr,
        g[:, None] * words_per_row + ((rn * STAT_BITS) // 32)[None, :],
        1,
        ((rn * STAT_BITS) % 32)[None, :],
        mask,
        STAT_BITS,
    )
    entry = (g[:, None] * (N // STAT_GROUP) + (rn // STAT_GROUP)[None, :]) * 2
    step = tl.load(table_ptr + entry, mask=mask, other=0.0).to(tl.float32)
    minimum = tl.load(table_ptr + entry + 1, mask=mask, other=0.0).to(tl.float32)
    return step * code.to(tl.float32) + minimum


@triton.jit
def _per_row(stat, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """``[BLOCK_K / GROUP_SIZE, BLOCK_N]`` group statistics repeated for each row of their group."""
    per_group: tl.constexpr = BLOCK_K // GROUP_SIZE
    return tl.reshape(tl.broadcast_to(stat[:, None, :], (per_group, GROUP_SIZE, BLOCK_N)), (BLOCK_K, BLOCK_N))


@triton.jit
def _spqr_gemm_kernel(
    x_ptr,
    codes_ptr,
    scale_codes_ptr,
    zero_codes_ptr,
    scale_stats_ptr,
    zero_stats_ptr,
    perm_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    GROUP_TILED: tl.constexpr,
    STAT_BITS: tl.constexpr,
    STAT_GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = rm < M, rn < N
    k_lo, k_hi = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)  # packed (act-order) row index
        mask_k = rk < k_hi
        col = tl.load(perm_ptr + rk, mask=mask_k, other=0)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + col[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        tile_mask = mask_k[:, None] & mask_n[None, :]
        q = bits_at(
            codes_ptr, ((rk * BITS) // 32)[:, None] * N + rn[None, :], N, ((rk * BITS) % 32)[:, None], tile_mask, BITS
        ).to(tl.float32)
        if GROUP_TILED:  # whole groups per tile: dequantize each group's statistics once, then broadcast
            g = k0 // GROUP_SIZE + tl.arange(0, BLOCK_K // GROUP_SIZE)
            g_mask = (g * GROUP_SIZE < k_hi)[:, None] & mask_n[None, :]
            scale = _per_row(
                tl.maximum(
                    _group_stat(scale_codes_ptr, scale_stats_ptr, g, rn, g_mask, N, STAT_BITS, STAT_GROUP), 1e-8
                ),
                BLOCK_K,
                BLOCK_N,
                GROUP_SIZE,
            )
            zero = _per_row(
                _group_stat(zero_codes_ptr, zero_stats_ptr, g, rn, g_mask, N, STAT_BITS, STAT_GROUP),
                BLOCK_K,
                BLOCK_N,
                GROUP_SIZE,
            )
        else:
            g = rk // GROUP_SIZE
            scale = tl.maximum(
                _group_stat(scale_codes_ptr, scale_stats_ptr, g, rn, tile_mask, N, STAT_BITS, STAT_GROUP), 1e-8
            )
            zero = _group_stat(zero_codes_ptr, zero_stats_ptr, g, rn, tile_mask, N, STAT_BITS, STAT_GROUP)
        w = (scale * (q - zero)).to(x.dtype)
        acc = dot_accumulate(acc, x, w, IEEE, UPCAST)
    store_output(acc, bias_ptr, out_ptr, rm, rn, M, N, pid_k, HAS_BIAS, SPLIT_K)


_GEMM = tunable_pair(_spqr_gemm_kernel)


def spqr_dense_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale_codes: torch.Tensor,
    zero_codes: torch.Tensor,
    scale_stats: torch.Tensor,
    zero_stats: torch.Tensor,
    perm: torch.Tensor,
    bias: Optional[torch.Tensor],
    bits: int,
    group_size: int,
    stat_bits: int,
    stat_group_size: int,
) -> torch.Tensor:
    """``qc.spqr_dense_linear`` as one kernel launch."""
    check_activation("spqr_gemm", x)
    for what, b in (("weight", bits), ("statistic", stat_bits)):
        if b not in SUPPORTED_BITS:
            raise UnsupportedKernel(f"spqr_gemm: {b}-bit {what} codes are not supported (supported: {SUPPORTED_BITS})")
    K, N = perm.numel(), scale_stats.shape[1] * stat_group_size
    return launch_lowbit_gemm(
        _GEMM,
        x,
        K,
        N,
        (codes, scale_codes, zero_codes, scale_stats, zero_stats, perm),
        bias,
        (),
        BITS=bits,
        GROUP_SIZE=group_size,
        GROUP_TILED=_MIN_BLOCK_K % group_size == 0,
        STAT_BITS=stat_bits,
        STAT_GROUP=stat_group_size,
    )


def spqr_experts_linear(
    x: torch.Tensor,
    offsets: torch.Tensor,
    codes: torch.Tensor,
    scale_codes: torch.Tensor,
    zero_codes: torch.Tensor,
    scale_stats: torch.Tensor,
    zero_stats: torch.Tensor,
    perm: torch.Tensor,
    row_ptr: torch.Tensor,
    col_idx: torch.Tensor,
    values: torch.Tensor,
    bits: int,
    group_size: int,
    stat_bits: int,
    stat_group_size: int,
) -> torch.Tensor:
    """``qc.spqr_experts_linear``: per expert that received rows, the dense kernel and then the CSR
    kernel accumulating into its output (as the fused single-layer SpQR pair)."""
    n_out = scale_stats.shape[-2] * stat_group_size

    def dense_then_outliers(rows: torch.Tensor, e: int) -> torch.Tensor:
        dense = spqr_dense_linear(
            rows,
            codes[e],
            scale_codes[e],
            zero_codes[e],
            scale_stats[e],
            zero_stats[e],
            perm[e],
            None,
            bits,
            group_size,
            stat_bits,
            stat_group_size,
        )
        return csr_linear(rows, *expert_csr(row_ptr, col_idx, values, e), n_out, out=dense)

    return per_expert(x, offsets, n_out, dense_then_outliers)
