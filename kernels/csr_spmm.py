"""SpQR's sparse outlier branch (``qc.sparse_outlier_linear``): ``y (+)= x · Sᵀ`` for a CSR matrix S.

One program owns ``BLOCK_N`` output rows of S and ``BLOCK_M`` activation rows; it walks the rows'
non-zeros in lock step (up to the longest row of its block), gathering the activation columns they
name. With ``accumulate=True`` it adds into an existing output — the dense branch's — so SpQR's
``dense + sparse`` needs no separate add pass over the output.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from qcompiler.kernels.tuning import Tunable, check_activation

__all__ = ["csr_linear"]


@triton.jit
def _csr_spmm_kernel(
    x_ptr,
    row_ptr,
    col_idx_ptr,
    values_ptr,
    out_ptr,
    M,
    N,
    stride_xm,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = rm < M, rn < N
    start = tl.load(row_ptr + rn, mask=mask_n, other=0)
    length = tl.load(row_ptr + rn + 1, mask=mask_n, other=0) - start
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in range(0, tl.max(length, axis=0)):
        live = mask_n & (j < length)
        col = tl.load(col_idx_ptr + start + j, mask=live, other=0).to(tl.int32)
        value = tl.load(values_ptr + start + j, mask=live, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + rm[:, None] * stride_xm + col[None, :], mask=mask_m[:, None] & live[None, :], other=0.0)
        acc += xv.to(tl.float32) * value[None, :]
    out_ptrs = out_ptr + rm[:, None] * N + rn[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


_CSR = Tunable(
    _csr_spmm_kernel,
    [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w)
        for bm, bn, w in ((2, 128, 4), (4, 128, 4), (16, 64, 4), (16, 128, 4), (64, 64, 8))
    ],
    key=["M", "N"],
    interpret_config={"BLOCK_M": 16, "BLOCK_N": 128},
    # it may add into ``out``: each timed trial must start from the caller's values, or
    # autotuning a new (M, N) adds the product dozens of times (seen on an H200: inf)
    restore_value=["out_ptr"],
)


def csr_linear(
    x: torch.Tensor,
    row_ptr: torch.Tensor,
    col_idx: torch.Tensor,
    values: torch.Tensor,
    out_features: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``qc.sparse_outlier_linear``; with ``out`` given, the product is added into it in place."""
    check_activation("csr_spmm", x)
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    accumulate = out is not None
    target = (
        out.reshape(M, out_features) if accumulate else torch.empty((M, out_features), dtype=x.dtype, device=x.device)
    )
    if accumulate and not target.is_contiguous():
        raise ValueError("csr_linear: the output to accumulate into must be contiguous")
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(out_features, meta["BLOCK_N"]))  # noqa: E731
    _CSR[grid](x2, row_ptr, col_idx, values, target, M, out_features, x2.stride(0), ACCUMULATE=accumulate)
    return out if accumulate else target.reshape(*x.shape[:-1], out_features)
