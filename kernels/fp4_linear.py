"""FP4 weight-only linears (``qc.nvfp4_linear`` W4A16, ``qc.mxfp4_linear``) by batch size: the
decode GEMV (``fp4_gemv.py``) up to ``FP4_GEMV_MAX_M`` rows; above it the weight dequantized once
into a workspace in the activations' dtype and one cuBLAS matmul — at prefill sizes the tensor-core
GEMM's throughput, not the weight's bytes, sets the time (what ``layout_dequant.py`` does for GPTQ).

The workspace holds exactly the reference's dequantized weight (``e2m1 · scale`` in fp32, rounded
to the activations' dtype). NVFP4 with FP4 activations (W4A4) is emulated, as vLLM does on GPUs
without FP4 tensor cores (before Blackwell): the inputs rounded to NVFP4 by a kernel, bit for bit
the reference's, then an fp32 matmul with the dequantized weight — the reference's arithmetic.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from qcompiler.kernels.fp4_gemv import fp4_gemv, fp4_tile, load_global_scale
from qcompiler.kernels.nvfp4_quant import quantize_nvfp4_rows
from qcompiler.kernels.tuning import Tunable, check_activation

__all__ = ["nvfp4_linear", "mxfp4_linear", "dequantize_fp4", "FP4_GEMV_MAX_M"]

# Up to this many rows the GEMV (weights read once per row, from L2 after the first) beats
# dequantize + cuBLAS; a guess until benchmarks/kernel_speed.py measures M = 1, 4, 16 on a GPU.
FP4_GEMV_MAX_M = 4


@triton.jit
def _dequantize_fp4_kernel(
    packed_ptr,
    scale_ptr,
    global_ptr,
    out_ptr,
    N,
    K,
    NVFP4: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    pid_n, pid_b = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    tile = (rn < N)[:, None] & (rb < K // 2)[None, :]
    global_scale = load_global_scale(global_ptr, NVFP4)
    w_even, w_odd = fp4_tile(packed_ptr, scale_ptr, global_scale, rn, rb, tile, K, NVFP4, GROUP)
    at = out_ptr + rn[:, None] * K + 2 * rb[None, :]
    tl.store(at, w_even.to(out_ptr.dtype.element_ty), mask=tile)
    tl.store(at + 1, w_odd.to(out_ptr.dtype.element_ty), mask=tile)


_DEQUANTIZE = Tunable(
    _dequantize_fp4_kernel,
    [
        triton.Config({"BLOCK_N": bn, "BLOCK_B": bb}, num_warps=w, num_stages=1)
        for bn, bb, w in ((32, 128, 4), (64, 64, 4), (16, 256, 4), (64, 128, 8))
    ],
    key=["N", "K", "NVFP4", "GROUP"],
    interpret_config={"BLOCK_N": 32, "BLOCK_B": 64},
)


def dequantize_fp4(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: Optional[torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """The FP4 weight ``[out, in]`` in ``dtype`` (NVFP4 when ``global_scale`` is given, else MXFP4)."""
    N, K = packed.shape[0], packed.shape[1] * 2
    out = torch.empty((N, K), dtype=dtype, device=packed.device)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(K // 2, meta["BLOCK_B"]))  # noqa: E731
    _DEQUANTIZE[grid](
        packed,
        scale.view(torch.uint8),
        global_scale if global_scale is not None else out,
        out,
        N,
        K,
        NVFP4=global_scale is not None,
        GROUP=K // scale.shape[1],
    )
    return out


def _fp4_linear(x, packed, scale, global_scale, bias, kernel: str) -> torch.Tensor:
    check_activation(kernel, x)
    K, N = x.shape[-1], packed.shape[0]
    rows = x.reshape(-1, K).contiguous()
    if rows.shape[0] <= FP4_GEMV_MAX_M:
        y = fp4_gemv(rows, packed, scale, global_scale, bias).to(x.dtype)
    else:
        w = dequantize_fp4(packed, scale, global_scale, x.dtype)
        y = F.linear(rows, w, None if bias is None else bias.to(x.dtype))
    return y.reshape(*x.shape[:-1], N)


def nvfp4_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    input_global_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``qc.nvfp4_linear`` as kernels: same arguments, same result within rounding. W4A4 is emulated:
    the inputs rounded to NVFP4 (``nvfp4_quant``), the weight dequantized, the product in fp32."""
    if input_global_scale is not None:
        xq = quantize_nvfp4_rows(x, input_global_scale)
        w = dequantize_fp4(weight_packed, weight_scale, weight_global_scale.float(), torch.float32)
        y = F.linear(xq, w, None if bias is None else bias.float()).to(x.dtype)
        return y.reshape(*x.shape[:-1], weight_packed.shape[0])
    return _fp4_linear(x, weight_packed, weight_scale, weight_global_scale.float(), bias, "nvfp4_gemv")


def mxfp4_linear(
    x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """``qc.mxfp4_linear`` as kernels: same arguments, same result within rounding."""
    return _fp4_linear(x, weight_packed, weight_scale, None, bias, "mxfp4_gemv")
