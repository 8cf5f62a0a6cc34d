"""RMSNorm and W8A8's activation quantizer in one kernel: the norm's output is never written.

SmoothQuant folds its scales into the RMSNorm's weight, and the linears reading the norm (q/k/v,
gate/up) want only its int8 codes and per-token scales. One program per row: the sum of squares,
then (dynamic scales) the row's largest magnitude, then the codes — the row is read three times
(from cache after the first), the fp16 output never goes to memory. The arithmetic is the captured
graph's: ``r = rsqrt(mean(h²) + eps)`` in fp32, ``(h·r)`` cast to the norm's dtype, times the weight,
cast to the output dtype, times SmoothQuant's ``1/s`` if any, then quantized as ``quantize_rows``
does (correctly rounded division, round-half-even). Only the sum of squares is summed in another
order than torch's, so a code can differ by one where a value sits on a rounding boundary.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from qcompiler.kernels.act_quant import ROW_CONFIGS, int8_codes, row_scale
from qcompiler.kernels.tuning import Tunable, check_activation

__all__ = ["rmsnorm_quantize_rows", "TL_DTYPES"]

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _normalized(h_row, w_ptr, smooth_ptr, rk, K, r, NORM: tl.constexpr, OUT: tl.constexpr, HAS_SMOOTH: tl.constexpr):
    live = rk < K
    y = (tl.load(h_row + rk, mask=live, other=0.0).to(tl.float32) * r).to(NORM).to(tl.float32)
    v = (tl.load(w_ptr + rk, mask=live, other=0.0).to(tl.float32) * y).to(OUT).to(tl.float32)
    if HAS_SMOOTH:
        v = v * tl.load(smooth_ptr + rk, mask=live, other=0.0).to(tl.float32)
    return v


@triton.jit
def _rmsnorm_quantize_kernel(
    h_ptr,
    w_ptr,
    smooth_ptr,
    static_scale_ptr,
    q_ptr,
    scale_ptr,
    K,
    stride_hm,
    eps,
    NORM: tl.constexpr,
    OUT: tl.constexpr,
    HAS_SMOOTH: tl.constexpr,
    STATIC: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    h_row = h_ptr + row * stride_hm
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(h_row + rk, mask=rk < K, other=0.0).to(tl.float32)
        squares += v * v
    mean = tl.math.div_rn(tl.sum(squares, axis=0), K * 1.0)
    r = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean + eps))
    if STATIC:
        scale = tl.load(static_scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            amax = tl.maximum(amax, tl.abs(_normalized(h_row, w_ptr, smooth_ptr, rk, K, r, NORM, OUT, HAS_SMOOTH)))
        scale = row_scale(amax)
        tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        v = _normalized(h_row, w_ptr, smooth_ptr, rk, K, r, NORM, OUT, HAS_SMOOTH)
        tl.store(q_ptr + row * K + rk, int8_codes(v, scale), mask=rk < K)


_NORM_QUANT = Tunable(
    _rmsnorm_quantize_kernel,
    ROW_CONFIGS,
    key=["K"],
    interpret_config={"BLOCK_K": 256},
)


def rmsnorm_quantize_rows(
    h: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    norm_dtype: torch.dtype,
    out_dtype: torch.dtype,
    smooth_inv: Optional[torch.Tensor],
    static_scale: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes ``[M, K]`` of ``rmsnorm(h) · weight (· smooth_inv)`` and their fp32 scales (``[M, 1]``,
    or the static one): ``quantize_rows(norm(h))`` without writing ``norm(h)``."""
    check_activation("rmsnorm_quantize", h)
    K = h.shape[-1]
    rows = h.reshape(-1, K).contiguous()
    M = rows.shape[0]
    q = torch.empty((M, K), dtype=torch.int8, device=h.device)
    scales = torch.empty((M, 1), dtype=torch.float32, device=h.device)
    static = static_scale is not None
    _NORM_QUANT[lambda meta: (M,)](
        rows,
        weight,
        smooth_inv if smooth_inv is not None else weight,
        static_scale if static else scales,
        q,
        scales,
        K,
        rows.stride(0),
        float(eps),
        NORM=TL_DTYPES[norm_dtype],
        OUT=TL_DTYPES[out_dtype],
        HAS_SMOOTH=smooth_inv is not None,
        STATIC=static,
    )
    return q, (static_scale.float().reshape(1) if static else scales)


def rmsnorm_quantize_reference(h, weight, eps, norm_dtype, out_dtype, smooth_inv, static_scale):
    """The plain-torch twin: the captured graph's RMSNorm ops, then ``qc.int8_linear``'s quantizer."""
    from qcompiler.layouts.int8 import quantize_activations

    hf = h.float()
    y = (weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(norm_dtype)).to(out_dtype)
    return quantize_activations(y, static_scale, smooth_inv)
