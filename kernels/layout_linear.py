"""A quantized linear on the kernel layout: the activations gathered into layout row order once
(act-order), then the GEMV for one row or the dequantizing GEMM for more; SpQR's outliers are
fused into the GEMV, or added into the GEMM's output by the CSR kernel."""

from __future__ import annotations

from typing import Optional

import torch

from qcompiler.ir.ops import per_expert
from qcompiler.kernels.csr_spmm import csr_linear
from qcompiler.kernels.kernel_layout import KernelLayout, Outliers
from qcompiler.kernels.layout_gemm import layout_gemm
from qcompiler.kernels.layout_gemv import layout_gemv
from qcompiler.kernels.tuning import check_activation

__all__ = ["layout_linear", "layout_experts_linear"]


def layout_linear(
    x: torch.Tensor, layout: KernelLayout, bias: Optional[torch.Tensor], outliers: Optional[Outliers] = None
) -> torch.Tensor:
    """``x · Wᵀ (+ bias) (+ outliers)`` for the weight the layout stands for; ``x [..., in]``."""
    check_activation("layout_gemm", x)
    K, N = layout.in_features, layout.out_features
    rows = x.reshape(-1, K)
    if layout.perm is not None:
        rows = rows.index_select(1, layout.perm)
    rows = rows.contiguous()
    if rows.shape[0] == 1:
        y = layout_gemv(rows[0], layout, bias, outliers).to(x.dtype)
    else:
        y = layout_gemm(rows, layout, bias)
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
