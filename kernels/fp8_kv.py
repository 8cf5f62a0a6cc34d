"""The FP8 KV cache's rounding (``qc.fp8_kv_quant``): keys or values divided by their calibrated
scale, rounded to e4m3 (``fp8_quant.round_e4m3``: ties to even, saturating), times the scale — in
fp32, then the input's dtype; elementwise, so equal to the reference bit for bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qcompiler.kernels.fp8_quant import round_e4m3
from qcompiler.kernels.tuning import Tunable, check_activation

__all__ = ["fp8_kv_quant"]


@triton.jit
def _fp8_kv_quant_kernel(x_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offsets < n
    scale = tl.load(scale_ptr).to(tl.float32)
    v = tl.load(x_ptr + offsets, mask=live, other=0.0).to(tl.float32)
    y = round_e4m3(tl.math.div_rn(v, scale)) * scale
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=live)


_KV = Tunable(
    _fp8_kv_quant_kernel,
    [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((1024, 4), (4096, 8))],
    key=["n"],
    interpret_config={"BLOCK": 4096},
)


def fp8_kv_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``qc.fp8_kv_quant`` as one elementwise launch (same arguments, same result)."""
    check_activation("fp8_kv_quant", x)
    flat = x.contiguous()
    out = torch.empty_like(flat)
    n = flat.numel()
    _KV[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](flat, scale.float().reshape(1).contiguous(), out, n)
    return out.view(x.shape)
