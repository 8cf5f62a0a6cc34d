"""More than one activation row on the kernel layout: dequantize a ``BLOCK_K × BLOCK_N`` tile in
registers, then ``tl.dot`` on the tensor cores (fp16/bf16; exact fp32 for fp32 activations).

Each row of the tile reads the word holding it and shifts its code out — no word straddling, no
``g_idx`` gather: a tile's statistics are one row when groups are a multiple of ``BLOCK_K``, else
the row's group is ``row // GROUP``. Up to ``DECODE_MAX_M`` rows the K dimension is split across
programs (``gptq_gemm.launch_lowbit_gemm``), so small batches still fill the GPU.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from qcompiler.kernels.gemm_parts import dot_accumulate, split_k_range, store_output
from qcompiler.kernels.gptq_gemm import launch_lowbit_gemm, tunable_pair
from qcompiler.kernels.kernel_layout import KernelLayout, plane_widths, rows_per_word

__all__ = ["layout_gemm"]


@triton.jit
def _layout_gemm_kernel(
    x_ptr,
    low_ptr,
    high_ptr,
    scales_ptr,
    zeros_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    BITS: tl.constexpr,
    WIDTH: tl.constexpr,
    PER_WORD: tl.constexpr,
    GROUP: tl.constexpr,
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
    padded_k = tl.cdiv(K, 32) * 32
    k_lo, k_hi = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask_m[:, None] & (rk < k_hi)[None, :], other=0.0
        )
        in_plane = (rk < padded_k)[:, None] & mask_n[None, :]
        words = tl.load(low_ptr + (rk // PER_WORD)[:, None] * N + rn[None, :], mask=in_plane, other=0)
        shift = ((rk % PER_WORD) * WIDTH).to(tl.uint32)[:, None]
        codes = (words.to(tl.uint32, bitcast=True) >> shift) & ((1 << WIDTH) - 1)
        if BITS == 3:
            high = tl.load(high_ptr + (rk // 32)[:, None] * N + rn[None, :], mask=in_plane, other=0)
            codes = codes | (((high.to(tl.uint32, bitcast=True) >> (rk % 32).to(tl.uint32)[:, None]) & 1) << 2)
        if GROUP % BLOCK_K == 0:
            g = k0 // GROUP
            s = tl.load(scales_ptr + g * N + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            z = tl.load(zeros_ptr + g * N + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        else:
            g = rk // GROUP
            stat_mask = (rk < K)[:, None] & mask_n[None, :]
            s = tl.load(scales_ptr + g[:, None] * N + rn[None, :], mask=stat_mask, other=0.0).to(tl.float32)
            z = tl.load(zeros_ptr + g[:, None] * N + rn[None, :], mask=stat_mask, other=0.0).to(tl.float32)
        w = ((codes.to(tl.float32) - z) * s).to(x.dtype)
        acc = dot_accumulate(acc, x, w, IEEE, UPCAST)
    store_output(acc, bias_ptr, out_ptr, rm, rn, M, N, pid_k, HAS_BIAS, SPLIT_K)


_GEMM = tunable_pair(_layout_gemm_kernel)


def layout_gemm(x: torch.Tensor, layout: KernelLayout, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x [M, K]`` (already in layout row order) times the layout's weight: ``[M, N]`` in x's dtype."""
    return launch_lowbit_gemm(
        _GEMM,
        x,
        layout.in_features,
        layout.out_features,
        (layout.low, layout.high if layout.high is not None else layout.low, layout.scales, layout.zeros),
        bias,
        (),
        BITS=layout.bits,
        WIDTH=plane_widths(layout.bits)[0],
        PER_WORD=rows_per_word(layout.bits),
        GROUP=layout.group_rows,
    )
