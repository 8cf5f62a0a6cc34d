"""NVFP4 activations at run time (W4A4): each token's inputs rounded to e2m1 with an e4m3 scale per
16, in units of the calibrated ``input_global_scale`` — the values an FP4 GEMM multiplies, written
out in fp32 (dequantized) for the product to take.

Matches ``layouts.nvfp4.quantize_nvfp4_activations`` bit for bit: the group's stored scale is
``(max|x| / 6) · g`` clamped to 448 and rounded to e4m3 (``fp8_quant.round_e4m3``), its value that
over ``g`` (correctly rounded divisions throughout), each input divided by it and rounded to e2m1
half-to-even on e2m1's steps (½ below 2, 1 below 4, 2 above, saturating at 6); an all-zero group
stays zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qcompiler.kernels.act_quant import round_half_even
from qcompiler.kernels.fp8_quant import round_e4m3
from qcompiler.kernels.tuning import Tunable, check_activation

__all__ = ["quantize_nvfp4_rows", "round_e2m1"]

GROUP = 16


@triton.jit
def round_e2m1(v):
    """fp32 ``v`` rounded to the nearest e2m1 value, ties to even, saturating at ±6 (still fp32)."""
    a = tl.minimum(tl.abs(v), 6.0)  # everything above 6 rounds to 6 either way
    step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
    q = round_half_even(a / step) * step  # a / step < 4
    return tl.where(v < 0, -q, q)


@triton.jit
def _quantize_nvfp4_rows_kernel(x_ptr, global_ptr, out_ptr, K, stride_xm, BLOCK_G: tl.constexpr):
    row, pid = tl.program_id(0), tl.program_id(1)
    g = tl.load(global_ptr).to(tl.float32)
    cols = (pid * BLOCK_G + tl.arange(0, BLOCK_G))[:, None] * 16 + tl.arange(0, 16)[None, :]
    live = cols < K
    v = tl.load(x_ptr + row * stride_xm + cols, mask=live, other=0.0).to(tl.float32)
    stored = round_e4m3(tl.minimum(tl.math.div_rn(tl.max(tl.abs(v), axis=1), 6.0) * g, 448.0))
    scale = tl.math.div_rn(stored, g)[:, None]
    q = round_e2m1(tl.math.div_rn(v, tl.where(scale != 0, scale, 1.0)))
    tl.store(out_ptr + row * K + cols, tl.where(scale != 0, q, 0.0) * scale, mask=live)


_QUANT = Tunable(
    _quantize_nvfp4_rows_kernel,
    [triton.Config({"BLOCK_G": bg}, num_warps=w) for bg, w in ((32, 4), (64, 4), (128, 8))],
    key=["K"],
    interpret_config={"BLOCK_G": 8},
)


def quantize_nvfp4_rows(x: torch.Tensor, input_global_scale: torch.Tensor) -> torch.Tensor:
    """``x`` flattened to rows ``[M, K]`` (K a multiple of 16) on the NVFP4 grid, as fp32 values."""
    check_activation("quantize_nvfp4_rows", x)
    K = x.shape[-1]
    rows = x.reshape(-1, K).contiguous()
    M = rows.shape[0]
    out = torch.empty((M, K), dtype=torch.float32, device=x.device)
    g = input_global_scale.float().reshape(1).contiguous()
    _QUANT[lambda meta: (M, triton.cdiv(K // GROUP, meta["BLOCK_G"]))](rows, g, out, K, rows.stride(0))
    return out
