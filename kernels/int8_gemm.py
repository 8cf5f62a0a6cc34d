"""W8A8 GEMM (``qc.int8_linear``): int8 × int8 → int32 on tensor cores, rescaled in the epilogue.

Activations are first quantized per token (or with a static per-tensor scale) by
``act_quant.quantize_rows``; the GEMM's epilogue applies ``acc · s_x[m] · s_w[n] + bias`` in fp32 in
the same order as the reference, so results match it exactly up to the final cast.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from qcompiler.kernels.act_quant import quantize_rows
from qcompiler.kernels.tuning import Tunable, check_activation

__all__ = ["int8_linear", "int8_gemm", "int8_linear_quantized"]


@triton.jit
def _int8_gemm_kernel(
    xq_ptr,
    wq_ptr,
    x_scale_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    PER_TOKEN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask_k = rk < K
        a = tl.load(xq_ptr + rm[:, None] * K + rk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0)
        b = tl.load(wq_ptr + rn[None, :] * K + rk[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)  # int8 x int8 accumulates in int32 on the GPU
    if PER_TOKEN:
        sx = tl.load(x_scale_ptr + rm, mask=mask_m, other=0.0)[:, None]
    else:
        sx = tl.load(x_scale_ptr)
    y = acc.to(tl.float32) * sx * tl.load(w_scale_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rm[:, None] * N + rn[None, :], y.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :]
    )


_GEMM = Tunable(
    _int8_gemm_kernel,
    [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in (
            (16, 64, 128, 4, 4),
            (64, 64, 64, 4, 4),
            (128, 128, 64, 8, 3),
            (128, 256, 64, 8, 3),
            (256, 128, 64, 8, 3),
            (64, 128, 128, 4, 4),
        )
    ],
    key=["M", "N", "K"],
    interpret_config={"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128},
)


def int8_gemm(
    xq: torch.Tensor,
    wq: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
    per_token: bool = True,
) -> torch.Tensor:
    """``(xq @ wqᵀ) · x_scale · w_scale + bias`` with int32 accumulation; ``xq`` [M, K], ``wq`` [N, K];
    ``x_scale`` one per row (``per_token``) or a single static one."""
    M, K = xq.shape
    N = wq.shape[0]
    out = torch.empty((M, N), dtype=out_dtype, device=xq.device)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))  # noqa: E731
    _GEMM[grid](
        xq,
        wq,
        x_scale,
        w_scale,
        bias if bias is not None else w_scale,
        out,
        M,
        N,
        K,
        PER_TOKEN=per_token,
        HAS_BIAS=bias is not None,
    )
    return out


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    act_scale: Optional[torch.Tensor],
    smooth_inv: Optional[torch.Tensor],
) -> torch.Tensor:
    """``qc.int8_linear``: quantize the activations (kernel), then the int8 GEMM (kernel)."""
    check_activation("int8_gemm", x)
    xq, sx = quantize_rows(x, smooth_inv, act_scale)
    y = int8_gemm(xq, weight.contiguous(), sx, weight_scale.reshape(-1), bias, x.dtype, act_scale is None)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def int8_linear_quantized(
    x: torch.Tensor, quantized: tuple, weight: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """``int8_linear`` on activations already quantized by ``quantize_rows`` (``(codes [M, K],
    scales [M, 1] or the static [1])``), shared by the linears that read the same input."""
    check_activation("int8_gemm", x)
    xq, sx = quantized
    y = int8_gemm(xq, weight.contiguous(), sx, weight_scale.reshape(-1), bias, x.dtype, sx.dim() == 2)
    return y.reshape(*x.shape[:-1], weight.shape[0])
