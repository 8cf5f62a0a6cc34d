"""FP8 activations at run time: each row of ``x`` rounded to e4m3 with a dynamic scale per token
(``"token"``), per token and 128 inputs (``"group"``), or the calibrated static one (``"static"``) —
the codes and scales ``fp8_gemm`` multiplies.

Matches ``layouts.fp8.quantize_fp8_activations`` bit for bit: the scale is ``max|x| / 448`` and the
division ``x / scale`` correctly rounded (``div_rn``); the rounding to e4m3 is done in fp32 arithmetic
(the value's binade from its exponent bits, then round-half-to-even on that binade's 3-bit mantissa
grid, saturating at ±448), so it is the same on every GPU and under the interpreter, whose own
fp32 → fp8 cast drops the carry into the next binade (127.97 became 64).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from qcompiler.kernels.act_quant import ROW_CONFIGS, round_half_even
from qcompiler.kernels.tuning import Tunable, UnsupportedKernel, check_activation

__all__ = ["quantize_fp8_rows", "round_e4m3", "ACTIVATION_GROUP"]

ACTIVATION_GROUP = 128  # inputs per scale of the "group" activations (compressed-tensors' FP8-block)


@triton.jit
def round_e4m3(v):
    """fp32 ``v`` rounded to the nearest e4m3 value, ties to even, saturating at ±448 (still fp32)."""
    a = tl.minimum(tl.abs(v), 448.0)
    exponent = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # subnormals below 2^-6
    step = ((exponent + 124) << 23).to(tl.float32, bitcast=True)  # 2^(exponent − 3): the mantissa's step
    q = round_half_even(a / step) * step  # |a / step| < 16
    return tl.where(v < 0, -q, q)


@triton.jit
def _fp8_scale(amax):
    """``max|x| / 448`` correctly rounded; 1 for an all-zero row or group (its codes are 0 on any scale)."""
    scale = tl.math.div_rn(amax, 448.0)
    return tl.where(scale > 0, scale, 1.0)


@triton.jit
def _quantize_fp8_rows_kernel(
    x_ptr,
    static_scale_ptr,
    q_ptr,
    scale_ptr,
    K,
    stride_xm,
    MODE: tl.constexpr,  # 0: per token, 1: per token and 128 inputs, 2: static
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_xm
    if MODE == 1:  # one group of 128 per step (BLOCK_K is the group)
        groups = tl.cdiv(K, BLOCK_K)
        for g in range(0, groups):
            rk = g * BLOCK_K + tl.arange(0, BLOCK_K)
            v = tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)
            scale = _fp8_scale(tl.max(tl.abs(v), axis=0))
            tl.store(scale_ptr + row * groups + g, scale)
            codes = round_e4m3(tl.math.div_rn(v, scale))
            tl.store(q_ptr + row * K + rk, codes.to(q_ptr.dtype.element_ty), mask=rk < K)
    else:
        if MODE == 2:
            scale = tl.load(static_scale_ptr).to(tl.float32)
        else:
            amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                amax = tl.maximum(amax, tl.abs(tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)))
            scale = _fp8_scale(tl.max(amax, axis=0))
            tl.store(scale_ptr + row, scale)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)
            codes = round_e4m3(tl.math.div_rn(v, scale))
            tl.store(q_ptr + row * K + rk, codes.to(q_ptr.dtype.element_ty), mask=rk < K)


_QUANT = Tunable(_quantize_fp8_rows_kernel, ROW_CONFIGS, key=["K", "MODE"], interpret_config={"BLOCK_K": 256})
_MODES = {"token": 0, "group": 1, "static": 2}


def quantize_fp8_rows(
    x: torch.Tensor, activations: str, input_scale: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes ``[M, K]`` of ``x`` (flattened to rows) and their fp32 scales: ``[M, 1]`` per token,
    ``[M, ⌈K/128⌉]`` per group, the static ``[1]``."""
    check_activation("quantize_fp8_rows", x)
    K = x.shape[-1]
    if activations == "group" and K % ACTIVATION_GROUP:
        raise UnsupportedKernel(f"quantize_fp8_rows: group activations need inputs in multiples of 128, got {K}")
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    columns = K // ACTIVATION_GROUP if activations == "group" else 1
    scales = torch.empty((M, columns), dtype=torch.float32, device=x.device)
    mode = _MODES[activations]
    if mode == 1:  # one program per row, one group per step: the block is the group, never tuned
        _quantize_fp8_rows_kernel[(M,)](x2, scales, q, scales, K, x2.stride(0), MODE=1, BLOCK_K=ACTIVATION_GROUP)
    else:
        static = input_scale.float().reshape(1).contiguous() if mode == 2 else scales
        _QUANT[lambda meta: (M,)](x2, static, q, scales, K, x2.stride(0), MODE=mode)
    return q, (input_scale.float().reshape(1) if mode == 2 else scales)
