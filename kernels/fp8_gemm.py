"""FP8 linear (``qc.fp8_linear``): e4m3 weights with a scale per output channel or per 128 × 128
block, times activations that are e4m3 too (W8A8: per token, per token and 128 inputs, or one
static scale; ``fp8_quant.py`` rounds them) or as they come (W8A16).

W8A8 multiplies the e4m3 tiles on the tensor cores (``tl.dot`` on fp8, fp32 accumulation; Ada and
Hopper) — the products of two e4m3 values are exact, so the sum differs from the plain-torch
reference (dequantize, then an fp32 matmul) only in fp32 rounding. The scales go where they are
constant: per channel and per token in the epilogue; per 128-block (either side) on each K step's
partial product, with ``BLOCK_K`` dividing 128 (DeepSeek-V3's block-scaled GEMM). Triton's e4m3
type needs Ada or later (sm_89+): on older GPUs the host refuses by name and the node runs its
reference. W8A16 widens the weight tile to the activations' dtype. Up to ``DECODE_MAX_M`` rows the K dimension
is split across programs (partial sums added into an fp32 buffer), so a decode step fills the GPU.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from qcompiler.kernels.fp8_quant import quantize_fp8_rows
from qcompiler.kernels.gemm_parts import dot_accumulate, split_k_range, store_output
from qcompiler.kernels.gptq_gemm import DECODE_MAX_M
from qcompiler.kernels.tuning import INTERPRET, Tunable, UnsupportedKernel, check_activation, dot_upcast

__all__ = ["fp8_linear", "fp8_gemm"]

WEIGHT_BLOCK = 128
# how the activations' scales are laid out: none (W8A16), per row, per row and 128 inputs, one static
X_NONE, X_ROW, X_GROUP, X_STATIC = 0, 1, 2, 3


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,
    w_ptr,
    w_scale_ptr,
    x_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    W_BLOCKED: tl.constexpr,
    X_SCALES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = rm < M, rn < N
    k_lo, k_hi = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
    k_blocks = tl.cdiv(K, 128)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask_k = rk < k_hi
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if X_SCALES == 0:  # W8A16: the weight tile in the activations' dtype
            w = w.to(x.dtype)
        if W_BLOCKED or X_SCALES == 2:  # scales change along K: each step's partial product scaled
            part = dot_accumulate(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), x, w, IEEE, UPCAST)
            if W_BLOCKED:  # BLOCK_K divides 128: the tile lies in one block column
                sw = tl.load(w_scale_ptr + (rn // 128) * k_blocks + k0 // 128, mask=mask_n, other=0.0)
                part = part * sw.to(tl.float32)[None, :]
            if X_SCALES == 2:
                part = part * tl.load(x_scale_ptr + rm * k_blocks + k0 // 128, mask=mask_m, other=0.0)[:, None]
            acc += part
        else:
            acc = dot_accumulate(acc, x, w, IEEE, UPCAST)
    if not W_BLOCKED:
        acc = acc * tl.load(w_scale_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if X_SCALES == 1:
        acc = acc * tl.load(x_scale_ptr + rm, mask=mask_m, other=0.0)[:, None]
    elif X_SCALES == 3:
        acc = acc * tl.load(x_scale_ptr)
    store_output(acc, bias_ptr, out_ptr, rm, rn, M, N, pid_k, HAS_BIAS, SPLIT_K)


def _configs(decode: bool) -> list:
    if decode:  # few rows: small tiles split along K fill the SMs; BLOCK_K divides 128 (block scales)
        shapes = [(16, 64, 128, 1, 4, 4), (16, 64, 128, 4, 4, 4), (16, 128, 128, 4, 4, 3), (16, 64, 64, 8, 4, 4),
                  (16, 32, 128, 8, 2, 4), (16, 128, 64, 2, 4, 4)]  # fmt: skip
    else:
        shapes = [(128, 128, 128, 1, 8, 3), (128, 256, 64, 1, 8, 3), (64, 128, 128, 1, 4, 4),
                  (128, 64, 128, 1, 4, 4), (64, 64, 128, 1, 4, 4), (256, 128, 64, 1, 8, 3)]  # fmt: skip
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk}, num_warps=w, num_stages=s)
        for bm, bn, bk, sk, w, s in shapes
    ]


_DECODE = Tunable(
    _fp8_gemm_kernel,
    _configs(True),
    key=["M", "N", "K", "W_BLOCKED", "X_SCALES"],
    reset_to_zero=["out_ptr"],
    interpret_config={"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 2},
)
_PREFILL = Tunable(
    _fp8_gemm_kernel,
    _configs(False),
    key=["N", "K", "W_BLOCKED", "X_SCALES"],
    interpret_config={"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 1},
)


def _e4m3_problem(device: torch.device) -> Optional[str]:
    """Why Triton cannot hold e4m3 tensors on ``device`` (None: sm_89+, or the interpreter)."""
    if INTERPRET or device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= (8, 9):
        return None
    return f"fp8_gemm: e4m3 tensors need an Ada or Hopper GPU (sm_89+); this one is sm_{major}{minor}"


def fp8_gemm(
    x: torch.Tensor,
    x_scales: Optional[torch.Tensor],
    x_layout: int,
    weight_fp8: torch.Tensor,
    weight_scale: torch.Tensor,
    w_blocked: bool,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``x [M, K]`` (e4m3 codes with ``x_scales`` laid out as ``x_layout``, or activations for W8A16)
    times the e4m3 weight ``[N, K]`` with its scales: ``[M, N]`` in ``out_dtype``."""
    M, K = x.shape
    N = weight_fp8.shape[0]
    decode = M <= DECODE_MAX_M
    out = torch.zeros((M, N), dtype=torch.float32, device=x.device) if decode else x.new_empty((M, N), dtype=out_dtype)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
    (_DECODE if decode else _PREFILL)[grid](
        x,
        weight_fp8,
        weight_scale,
        x_scales if x_scales is not None else weight_scale,
        bias if bias is not None else weight_scale,
        out,
        M,
        N,
        K,
        x.stride(0),
        W_BLOCKED=w_blocked,
        X_SCALES=x_layout,
        HAS_BIAS=bias is not None,
        IEEE=x_layout == X_NONE and x.dtype == torch.float32,
        UPCAST=x_layout == X_NONE and dot_upcast(x.dtype),
    )
    return out.to(out_dtype)


def fp8_linear(
    x: torch.Tensor,
    weight_fp8: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    block: int,
    activations: str,
    input_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``qc.fp8_linear`` as kernels (same arguments, same result within fp32 rounding): the
    activations' rounding (``fp8_quant``), then the FP8 GEMM."""
    check_activation("fp8_gemm", x)
    problem = _e4m3_problem(x.device)
    if problem:
        raise UnsupportedKernel(problem)
    if block not in (0, WEIGHT_BLOCK):
        raise UnsupportedKernel(f"fp8_gemm: weight blocks of {block} are not supported (0 or 128)")
    K, N = x.shape[-1], weight_fp8.shape[0]
    rows = x.reshape(-1, K)
    w_scale = weight_scale.float().contiguous() if block else weight_scale.float().reshape(-1).contiguous()
    if activations == "none":
        codes, scales, layout = rows.contiguous(), None, X_NONE
    else:
        codes, scales = quantize_fp8_rows(rows, activations, input_scale)
        layout = {"token": X_ROW, "group": X_GROUP, "static": X_STATIC}[activations]
    y = fp8_gemm(codes, scales, layout, weight_fp8.contiguous(), w_scale, bool(block), bias, x.dtype)
    return y.reshape(*x.shape[:-1], N)
