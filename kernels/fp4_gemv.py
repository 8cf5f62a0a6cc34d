"""FP4 weights (NVFP4, MXFP4) times a few activation rows: the decode GEMV, and the pieces every FP4
kernel shares — an e2m1 code's value and a group's scale, in fp32 arithmetic.

The stored layout is read as it is (``uint8 [out, in/2]``, input ``2j`` in byte ``j``'s low nibble,
a scale per 16 or 32 inputs along each row): every weight byte is loaded once, row-contiguous, its
two nibbles multiplied with the even and odd activations. A weight is ``e2m1 · scale`` rounded to
the activations' dtype — what the reference op's dequantized matmul multiplies — and the products
are summed in fp32. ``SPLIT_K`` programs share a column block (atomic adds into an fp32 output)
when the columns alone cannot fill the GPU; the autotuner picks it per shape.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from qcompiler.kernels.gemm_parts import split_k_range
from qcompiler.kernels.tuning import Tunable

__all__ = ["fp4_gemv", "fp4_tile", "load_global_scale", "e2m1_value", "e4m3_value", "group_scale"]


@triton.jit
def e2m1_value(code):
    """The fp32 value of 4-bit e2m1 codes (int32): sign in bit 3; magnitudes 0, ½, 1, 1½, 2, 3, 4, 6."""
    magnitude = code & 7
    exponent = magnitude >> 1
    half = (magnitude & 1).to(tl.float32) * 0.5
    power = (1 << tl.maximum(exponent - 1, 0)).to(tl.float32)
    value = tl.where(exponent == 0, half, power * (1.0 + half))
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def e4m3_value(byte):
    """The fp32 value of e4m3 bytes (int32), decoded in arithmetic — no fp8 type, so any GPU runs it:
    ``(8 + m) · 2^(e − 10)``, subnormals ``m · 2^-9``."""
    exponent = (byte >> 3) & 15
    mantissa = (byte & 7).to(tl.float32)
    power = ((tl.maximum(exponent, 1) + 117) << 23).to(tl.float32, bitcast=True)  # 2^(e − 10)
    value = tl.where(exponent == 0, mantissa * 0.001953125, (8.0 + mantissa) * power)
    return tl.where((byte & 128) != 0, -value, value)


@triton.jit
def group_scale(stored, global_scale, NVFP4: tl.constexpr):
    """A group's fp32 scale: NVFP4's e4m3 over the global scale (correctly rounded, as the reference
    divides); MXFP4's e8m0 exponent as ``2^(e − 127)`` built from its bits. The scales' bytes are
    loaded as uint8 for both formats."""
    if NVFP4:
        return tl.math.div_rn(e4m3_value(stored.to(tl.int32)), global_scale)
    e = stored.to(tl.int32)
    return tl.where(e > 0, (e << 23).to(tl.float32, bitcast=True), 5.877471754111438e-39)  # 2^-127: subnormal


@triton.jit
def load_global_scale(global_ptr, NVFP4: tl.constexpr):
    """NVFP4's fp32 global scale (1 for MXFP4, which has none)."""
    global_scale = 1.0
    if NVFP4:
        global_scale = tl.load(global_ptr).to(tl.float32)
    return global_scale


@triton.jit
def fp4_tile(packed_ptr, scale_ptr, global_scale, rn, rb, tile, K, NVFP4: tl.constexpr, GROUP: tl.constexpr):
    """fp32 weights of output rows ``rn`` × stored bytes ``rb`` (masked by ``tile``): the even inputs
    ``2·rb`` (low nibbles) and the odd ones ``2·rb + 1``, each code times its group's scale."""
    byte = tl.load(packed_ptr + rn[:, None] * (K // 2) + rb[None, :], mask=tile, other=0).to(tl.int32)
    stored = tl.load(scale_ptr + rn[:, None] * (K // GROUP) + (2 * rb // GROUP)[None, :], mask=tile, other=0)
    scale = group_scale(stored, global_scale, NVFP4)
    return e2m1_value(byte & 15) * scale, e2m1_value(byte >> 4) * scale


@triton.jit
def _fp4_gemv_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    global_ptr,
    bias_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    NVFP4: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_n, row, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    global_scale = load_global_scale(global_ptr, NVFP4)
    b_lo, b_hi = split_k_range(pid_k, K // 2, BLOCK_B, SPLIT_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    x_row = x_ptr + row * stride_xm
    for b0 in range(b_lo, b_hi, BLOCK_B):
        rb = b0 + tl.arange(0, BLOCK_B)
        mask_b = rb < b_hi
        w_even, w_odd = fp4_tile(
            packed_ptr, scale_ptr, global_scale, rn, rb, mask_n[:, None] & mask_b[None, :], K, NVFP4, GROUP
        )
        x_even = tl.load(x_row + 2 * rb, mask=mask_b, other=0.0)
        x_odd = tl.load(x_row + 2 * rb + 1, mask=mask_b, other=0.0)
        w_even = w_even.to(x_even.dtype).to(tl.float32)  # the reference's weight, in the activations' dtype
        w_odd = w_odd.to(x_even.dtype).to(tl.float32)
        acc += tl.sum(w_even * x_even.to(tl.float32)[None, :] + w_odd * x_odd.to(tl.float32)[None, :], axis=1)
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
    if SPLIT_K == 1:
        tl.store(out_ptr + row * N + rn, acc, mask=mask_n)
    else:
        tl.atomic_add(out_ptr + row * N + rn, acc, mask=mask_n)


_GEMV = Tunable(
    _fp4_gemv_kernel,
    [
        triton.Config({"BLOCK_N": bn, "BLOCK_B": bb, "SPLIT_K": sk}, num_warps=w, num_stages=s)
        for bn, bb, sk, w, s in (
            (16, 128, 1, 4, 3),
            (32, 128, 1, 4, 3),
            (16, 256, 2, 4, 3),
            (32, 64, 4, 4, 3),
            (64, 64, 1, 4, 2),
            (8, 256, 4, 2, 3),
        )
    ],
    key=["N", "K", "NVFP4", "GROUP"],
    reset_to_zero=["out_ptr"],
    interpret_config={"BLOCK_N": 16, "BLOCK_B": 32, "SPLIT_K": 2},
)


def fp4_gemv(
    rows: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
) -> torch.Tensor:
    """``rows [M, K]`` (a few) times the FP4 weight (NVFP4 when ``global_scale`` is given, else
    MXFP4): fp32 ``[M, N]``."""
    M, K = rows.shape
    N = packed.shape[0]
    out = torch.zeros((M, N), dtype=torch.float32, device=rows.device)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), M, meta["SPLIT_K"])  # noqa: E731
    _GEMV[grid](
        rows,
        packed,
        scale.view(torch.uint8),
        global_scale if global_scale is not None else out,
        bias if bias is not None else out,
        out,
        N,
        K,
        rows.stride(0),
        NVFP4=global_scale is not None,
        GROUP=K // scale.shape[1],
        HAS_BIAS=bias is not None,
    )
    return out
