"""Per-token (or static per-tensor) int8 quantization of activations, SmoothQuant's ``1/s`` fused in.

Matches ``qcompiler.algorithms.int8.quantize_per_token`` bit for bit: correctly rounded divisions
(``div_rn``) and round-half-to-even, as ``torch.round`` does.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from qcompiler.kernels.tuning import Tunable, check_activation

__all__ = ["quantize_rows", "round_half_even"]


@triton.jit
def round_half_even(v):
    """fp32 ``v`` (|v| < 2^22) to the nearest integer, ties to even: adding and subtracting 1.5·2^23."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def row_scale(amax):
    """A row's int8 scale from its running maxima ``[BLOCK_K]``: ``max / 127`` correctly rounded, ≥ 1e-8."""
    return tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), 127.0), 1e-8)


@triton.jit
def int8_codes(v, scale):
    """``clamp(round_half_even(v / scale), ±127)`` with a correctly rounded division, as ``torch.round`` does."""
    return tl.minimum(tl.maximum(round_half_even(tl.math.div_rn(v, scale)), -127.0), 127.0).to(tl.int8)


# one program per row, a K tile per step; shared by every row quantizer
ROW_CONFIGS = [triton.Config({"BLOCK_K": bk}, num_warps=w) for bk, w in ((512, 4), (1024, 4), (2048, 8))]


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    smooth_ptr,
    static_scale_ptr,
    q_ptr,
    scale_ptr,
    K,
    stride_xm,
    HAS_SMOOTH: tl.constexpr,
    STATIC: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_xm
    if STATIC:
        scale = tl.load(static_scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)
            if HAS_SMOOTH:
                v = v * tl.load(smooth_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = row_scale(amax)
        tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)
        if HAS_SMOOTH:
            v = v * tl.load(smooth_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * K + rk, int8_codes(v, scale), mask=rk < K)


_QUANT = Tunable(
    _quantize_rows_kernel,
    ROW_CONFIGS,
    key=["K"],
    interpret_config={"BLOCK_K": 256},
)


def quantize_rows(
    x: torch.Tensor, smooth_inv: Optional[torch.Tensor] = None, static_scale: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes ``[M, K]`` of ``x`` (flattened to rows) and their fp32 scales (``[M, 1]``, or the static one)."""
    check_activation("quantize_rows", x)
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    scales = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    static = static_scale is not None
    _QUANT[lambda meta: (M,)](
        x2,
        smooth_inv if smooth_inv is not None else x2,
        static_scale if static else scales,
        q,
        scales,
        K,
        x2.stride(0),
        HAS_SMOOTH=smooth_inv is not None,
        STATIC=static,
    )
    return q, (static_scale.float().reshape(1) if static else scales)
