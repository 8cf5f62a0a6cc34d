"""The first decode GEMV (a K loop per column block), kept beside ``decode_gemv.py`` — the one
``layout_linear`` runs — until a GPU run of ``benchmarks/kernel_speed.py`` has timed both.

Decode at batch 1: ``y = x · Wᵀ`` for one activation row on the kernel layout, a GEMV.

A ``tl.dot`` needs 16 activation rows, so a one-row product through it wastes 15/16 of the work;
this kernel multiplies and sums instead. Each program owns ``BLOCK_N`` output columns and walks
its slice of K a ``BLOCK_K × BLOCK_N`` tile at a time: full-word loads along the columns
(coalesced), each word unpacked by shifts and masks into the ``PER_WORD`` consecutive rows it holds,
dequantized and multiplied with the activations in fp32. ``SPLIT_K`` programs share one column
block (partial sums added atomically into an fp32 output) only when the columns alone cannot fill
the GPU — the autotuner picks it per shape. SpQR's outliers ride along: the programs of a column
block also add the outliers of those output rows (``x[col] · value``, atomically), so dense and
sparse parts are one launch.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from qcompiler.kernels.gemm_parts import add_fused_outliers, split_k_range, tile_codes, tile_stats
from qcompiler.kernels.kernel_layout import KernelLayout, Outliers, plane_widths, rows_per_word
from qcompiler.kernels.tuning import Tunable

__all__ = ["layout_gemv"]


@triton.jit
def _layout_gemv_kernel(
    x_ptr,
    low_ptr,
    high_ptr,
    scales_ptr,
    zeros_ptr,
    bias_ptr,
    out_ptr,
    row_ptr_ptr,
    outlier_rows_ptr,
    outlier_cols_ptr,
    outlier_values_ptr,
    N,
    K,
    BITS: tl.constexpr,
    WIDTH: tl.constexpr,
    PER_WORD: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_OUTLIERS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    WORD_ROWS: tl.constexpr = BLOCK_K // PER_WORD
    ri = tl.arange(0, WORD_ROWS)
    rj = tl.arange(0, PER_WORD)
    k_lo, k_hi = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + ri[:, None] * PER_WORD + rj[None, :]
        x = tl.load(x_ptr + rk, mask=rk < k_hi, other=0.0).to(tl.float32)
        codes = tile_codes(low_ptr, high_ptr, k0, rn, mask_n, N, K, BITS, WIDTH, PER_WORD, WORD_ROWS).to(tl.float32)
        s, z = tile_stats(scales_ptr, zeros_ptr, k0, rn, mask_n, N, K, GROUP, PER_WORD, WORD_ROWS, BLOCK_K)
        w = (codes - z[:, None, :]) * s[:, None, :]
        acc += tl.sum(tl.sum(w * x[:, :, None], axis=1), axis=0)
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
    if HAS_OUTLIERS:  # other programs add outliers into these columns: always atomically
        tl.atomic_add(out_ptr + rn, acc, mask=mask_n)
    elif SPLIT_K == 1:
        tl.store(out_ptr + rn, acc, mask=mask_n)
    else:
        tl.atomic_add(out_ptr + rn, acc, mask=mask_n)
    if HAS_OUTLIERS:  # this column block's outliers, shared out among its SPLIT_K programs
        add_fused_outliers(
            x_ptr, x_ptr, out_ptr, row_ptr_ptr, outlier_rows_ptr, outlier_cols_ptr, outlier_values_ptr,
            pid_n, pid_k, SPLIT_K, N, False, BLOCK_N,
        )  # fmt: skip


_GEMV = Tunable(
    _layout_gemv_kernel,
    [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk}, num_warps=w, num_stages=s)
        for bn, bk, sk, w, s in (
            (64, 128, 1, 4, 3),
            (64, 128, 4, 4, 3),
            (128, 64, 2, 4, 3),
            (128, 128, 8, 8, 2),
            (256, 64, 1, 8, 3),
            (32, 256, 16, 4, 2),
        )
    ],
    key=["N", "K", "BITS", "GROUP", "HAS_OUTLIERS"],
    reset_to_zero=["out_ptr"],
    interpret_config={"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 2},
)


def layout_gemv(
    x: torch.Tensor, layout: KernelLayout, bias: Optional[torch.Tensor], outliers: Optional[Outliers] = None
) -> torch.Tensor:
    """``x [K]`` (already in layout row order) times the layout's weight, plus outliers: fp32 ``[N]``."""
    N, K = layout.out_features, layout.in_features
    out = torch.zeros(N, dtype=torch.float32, device=x.device)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
    sparse = outliers.tensors() if outliers is not None else {}
    _GEMV[grid](
        x,
        layout.low,
        layout.high if layout.high is not None else layout.low,
        layout.scales,
        layout.zeros,
        bias if bias is not None else layout.scales,
        out,
        sparse.get("row_ptr", layout.low),
        sparse.get("rows", layout.low),
        sparse.get("cols", layout.low),
        sparse.get("values", layout.scales),
        N,
        K,
        BITS=layout.bits,
        WIDTH=plane_widths(layout.bits)[0],
        PER_WORD=rows_per_word(layout.bits),
        GROUP=layout.group_rows,
        HAS_BIAS=bias is not None,
        HAS_OUTLIERS=outliers is not None,
    )
    return out
