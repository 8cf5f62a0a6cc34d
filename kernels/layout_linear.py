"""A quantized linear on the kernel layout, by batch size: the decode GEMV for one row (act-order
gathered and SpQR's outliers added inside it: one launch); for more rows the activations are
gathered into layout row order once, then the fused dequantizing GEMM up to ``DEQUANT_MIN_M`` rows,
above it a dequantized workspace and cuBLAS (prefill); SpQR's outliers then added by the CSR kernel."""

from __future__ import annotations

from typing import Optional

import torch

from qcompiler.ir.ops import per_expert
from qcompiler.kernels.csr_spmm import csr_linear
from qcompiler.kernels.decode_gemv import decode_gemv
from qcompiler.kernels.kernel_layout import KernelLayout, Outliers
from qcompiler.kernels.layout_dequant import layout_dequant_linear
from qcompiler.kernels.layout_gemm import layout_gemm
from qcompiler.kernels.tuning import check_activation

__all__ = ["layout_linear", "layout_experts_linear", "DEQUANT_MIN_M"]

# From this many rows on, dequantize + cuBLAS instead of the fused GEMM: exllama's and vLLM's GPTQ
# threshold (~50 rows) until benchmarks/kernel_speed.py's crossover rows (fused vs dequant+cuBLAS at
# M = 16, 64, 512) are measured on a GPU here.
DEQUANT_MIN_M = 64


def layout_linear(
    x: torch.Tensor, layout: KernelLayout, bias: Optional[torch.Tensor], outliers: Optional[Outliers] = None
) -> torch.Tensor:
    """``x · Wᵀ (+ bias) (+ outliers)`` for the weight the layout stands for; ``x [..., in]``."""
    check_activation("layout_gemm", x)
    K, N = layout.in_features, layout.out_features
    rows = x.reshape(-1, K)
    if rows.shape[0] == 1:
        return decode_gemv(rows[0].contiguous(), layout, bias, outliers).reshape(*x.shape[:-1], N)
    if layout.perm is not None:
        rows = rows.index_select(1, layout.perm)
    rows = rows.contiguous()
    y = layout_gemm(rows, layout, bias) if rows.shape[0] < DEQUANT_MIN_M else layout_dequant_linear(rows, layout, bias)
    if outliers is not None:
        csr_linear(rows, outliers.row_ptr, outliers.cols, outliers.values, N, out=y)
    return y.reshape(*x.shape[:-1], N)


def layout_experts_linear(
    x: torch.Tensor, offsets: torch.Tensor, layout: KernelLayout, outliers: Optional[Outliers] = None
) -> torch.Tensor:
    """The experts ops on stacked layouts: one launch per expert that received rows (rows sorted by
    expert, ``offsets`` cumulative)."""
    return per_expert(
        x,
        offsets,
        layout.out_features,
        lambda rows, e: layout_linear(rows, layout.expert(e), None, None if outliers is None else outliers.expert(e)),
    )
