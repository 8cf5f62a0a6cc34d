"""Prefill on the kernel layout: dequantize the whole weight into a workspace in the activations'
dtype, then one cuBLAS matmul — what exllama and vLLM's GPTQ path do above ~50 rows, where the
tensor-core GEMM's throughput, not the weight's bytes, sets the time and a fused dequantizing
GEMM only adds ALU work to every tile it re-reads.

The dequantization is one pass over the stored bytes (each program a ``BLOCK_K × BLOCK_N`` tile,
words loaded once): ``(code − zero) · scale`` in fp32, the same arithmetic as the plain-torch twin
``kernel_layout.dequantize_layout``, so the workspace equals it bit for bit in fp32.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from qcompiler.kernels.gemm_parts import tile_codes, tile_stats
from qcompiler.kernels.kernel_layout import KernelLayout, plane_widths, rows_per_word
from qcompiler.kernels.tuning import Tunable

__all__ = ["dequantize_to_workspace", "layout_dequant_linear"]


@triton.jit
def _dequantize_kernel(
    low_ptr,
    high_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    N,
    K,
    BITS: tl.constexpr,
    WIDTH: tl.constexpr,
    PER_WORD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    WORD_ROWS: tl.constexpr = BLOCK_K // PER_WORD
    ri = tl.arange(0, WORD_ROWS)
    rj = tl.arange(0, PER_WORD)
    k0 = pid_k * BLOCK_K
    rk = k0 + ri[:, None] * PER_WORD + rj[None, :]
    codes = tile_codes(low_ptr, high_ptr, k0, rn, mask_n, N, K, BITS, WIDTH, PER_WORD, WORD_ROWS).to(tl.float32)
    s, z = tile_stats(scales_ptr, zeros_ptr, k0, rn, mask_n, N, K, GROUP, PER_WORD, WORD_ROWS, BLOCK_K)
    w = (codes - z[:, None, :]) * s[:, None, :]
    live = (rk < K)[:, :, None] & mask_n[None, None, :]
    tl.store(out_ptr + rk[:, :, None] * N + rn[None, None, :], w.to(out_ptr.dtype.element_ty), mask=live)


_DEQUANTIZE = Tunable(
    _dequantize_kernel,
    [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=1)
        for bn, bk, w in ((128, 32, 4), (256, 32, 4), (128, 64, 4), (64, 64, 2))
    ],
    key=["N", "K", "BITS", "GROUP"],
    interpret_config={"BLOCK_N": 32, "BLOCK_K": 64},
)


def dequantize_to_workspace(layout: KernelLayout, dtype: torch.dtype) -> torch.Tensor:
    """The layout's weight as ``[in_features, out_features]`` rows in layout order, in ``dtype``."""
    N, K = layout.out_features, layout.in_features
    out = torch.empty((K, N), dtype=dtype, device=layout.low.device)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(K, meta["BLOCK_K"]))  # noqa: E731
    _DEQUANTIZE[grid](
        layout.low,
        layout.high if layout.high is not None else layout.low,
        layout.scales,
        layout.zeros,
        out,
        N,
        K,
        BITS=layout.bits,
        WIDTH=plane_widths(layout.bits)[0],
        PER_WORD=rows_per_word(layout.bits),
        GROUP=layout.group_rows,
    )
    return out


def layout_dequant_linear(rows: torch.Tensor, layout: KernelLayout, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``rows [M, K]`` (in layout row order) times the layout's weight through a dequantized
    workspace and ``torch.matmul`` (cuBLAS on a GPU): ``[M, N]`` in the rows' dtype."""
    w = dequantize_to_workspace(layout, rows.dtype)
    return rows @ w if bias is None else torch.addmm(bias.to(rows.dtype), rows, w)
