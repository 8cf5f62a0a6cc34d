"""Decode at batch 1, built the way the fast GEMVs are (gemlite's "split-K without a K loop",
Marlin's dequantization): ``y = x · Wᵀ`` for one activation row on the kernel layout.

* **No K loop.** Each program owns one ``BLOCK_K × BLOCK_N`` tile of the weight: one load of its
  packed words (along the columns: coalesced), one multiply, one reduction, one atomic add of its
  ``BLOCK_N`` partial sums straight into the output. A 4096 × 4096 layer is thousands of small
  programs (one or two warps each), enough to keep every SM's loads in flight; there is no loop
  for the compiler to fail to pipeline.
* **Dequantization by magic numbers**, not int → float conversions (slow units): a code OR-ed into
  the mantissa of fp16 1024.0 *is* 1024 + code as an fp16, so one subtraction yields the code
  exactly, and the zero point rides in one fused multiply-add (``c · s + (−z·s)``, ``−z·s`` formed
  once per group and column). fp16 activations dequantize and multiply in fp16 (paired half
  instructions), the sum is fp32. bf16 and fp32 activations take the fp32 magic (2²³): exact, and
  correct under the interpreter too, which cannot compute in bf16.
* **Act-order gathered in the kernel** (each program reads ``x[perm[k]]`` for its rows) instead of a
  host gather into a copy: one launch per linear besides zeroing the output.
* **SpQR's outliers fused**: the programs of a column block share out its outliers and add
  ``x[col] · value`` atomically.

The output is accumulated in the activations' dtype where the GPU has atomics for it (fp16; bf16
from Hopper on), else in fp32 and cast once. The previous kernel (``layout_gemv.py``: a K loop per
column block) stays beside this one until a GPU run (``benchmarks/kernel_speed.py``) has timed
both; the plain-torch twin both are checked against is ``kernel_layout.layout_linear_reference``.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from qcompiler.kernels.gemm_parts import add_fused_outliers, tile_codes, tile_stats
from qcompiler.kernels.kernel_layout import KernelLayout, Outliers, plane_widths, rows_per_word
from qcompiler.kernels.tuning import INTERPRET, Tunable

__all__ = ["decode_gemv", "accumulator_dtype", "DEQUANT_HALF", "DEQUANT_FP32"]

DEQUANT_HALF, DEQUANT_FP32 = 0, 1  # fp16 magic 1024 (codes < 2^10), fp32 magic 2^23


@triton.jit
def _decode_gemv_kernel(
    x_ptr,
    perm_ptr,
    low_ptr,
    high_ptr,
    scales_ptr,
    zeros_ptr,
    bias_ptr,
    out_ptr,
    row_ptr_ptr,
    outlier_rows_ptr,
    outlier_cols_ptr,
    outlier_values_ptr,
    N,
    K,
    BITS: tl.constexpr,
    WIDTH: tl.constexpr,
    PER_WORD: tl.constexpr,
    GROUP: tl.constexpr,
    DEQUANT: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_OUTLIERS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    WORD_ROWS: tl.constexpr = BLOCK_K // PER_WORD
    ri = tl.arange(0, WORD_ROWS)
    rj = tl.arange(0, PER_WORD)
    k0 = pid_k * BLOCK_K
    rk = k0 + ri[:, None] * PER_WORD + rj[None, :]  # [WORD_ROWS, PER_WORD] layout rows
    live_k = rk < K
    if HAS_PERM:
        col = tl.load(perm_ptr + rk, mask=live_k, other=0)
    else:
        col = rk
    codes = tile_codes(low_ptr, high_ptr, k0, rn, mask_n, N, K, BITS, WIDTH, PER_WORD, WORD_ROWS)
    s, z = tile_stats(scales_ptr, zeros_ptr, k0, rn, mask_n, N, K, GROUP, PER_WORD, WORD_ROWS, BLOCK_K)
    if DEQUANT == 0:  # fp16: 1024 + code as an fp16, exact; c·s − z·s in one half FMA
        c = (codes | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True) - 1024.0
        w = c * s.to(tl.float16)[:, None, :] + (-(z * s)).to(tl.float16)[:, None, :]
        x = tl.load(x_ptr + col, mask=live_k, other=0.0).to(tl.float16)
        partial = tl.sum(tl.sum((w * x[:, :, None]).to(tl.float32), axis=1), axis=0)
    else:  # fp32: 2^23 + code as an fp32, exact; (c − z)·s as the reference computes it
        c = (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        w = (c - z[:, None, :]) * s[:, None, :]
        x = tl.load(x_ptr + col, mask=live_k, other=0.0).to(tl.float32)
        partial = tl.sum(tl.sum(w * x[:, :, None], axis=1), axis=0)
    if HAS_BIAS:
        if pid_k == 0:
            partial += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
    tl.atomic_add(out_ptr + rn, partial.to(out_ptr.dtype.element_ty), mask=mask_n)
    if HAS_OUTLIERS:
        add_fused_outliers(
            x_ptr, perm_ptr, out_ptr, row_ptr_ptr, outlier_rows_ptr, outlier_cols_ptr, outlier_values_ptr,
            pid_n, pid_k, tl.num_programs(1), N, HAS_PERM, BLOCK_N,
        )  # fmt: skip


_DECODE = Tunable(
    _decode_gemv_kernel,
    [  # many small programs (1–4 warps) over small K slices: the shapes the fast GEMVs launch
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=1)
        for bn, bk, w in (
            (128, 32, 1),
            (256, 32, 2),
            (64, 64, 1),
            (128, 64, 2),
            (256, 64, 4),
            (64, 128, 2),
            (128, 128, 4),
            (32, 256, 2),
        )
    ],
    key=["N", "K", "BITS", "GROUP", "DEQUANT", "HAS_PERM", "HAS_OUTLIERS"],
    reset_to_zero=["out_ptr"],
    interpret_config={"BLOCK_N": 32, "BLOCK_K": 64},
)


def accumulator_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype partial sums are added into: the activations' where the device has atomic adds for
    it (fp16 everywhere; bf16 on sm_90+, never under the interpreter), else fp32."""
    if dtype == torch.float16:
        return dtype
    if dtype == torch.bfloat16 and not INTERPRET and device.type == "cuda":
        return dtype if _capability(device.index) >= (9, 0) else torch.float32
    return torch.float32


@functools.lru_cache(maxsize=None)
def _capability(index: Optional[int]) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def decode_gemv(
    x: torch.Tensor, layout: KernelLayout, bias: Optional[torch.Tensor], outliers: Optional[Outliers] = None
) -> torch.Tensor:
    """``x [K]`` (in column order: the layout's ``perm`` is gathered in the kernel) times the layout's
    weight, plus bias and outliers: ``[N]`` in x's dtype."""
    N, K = layout.out_features, layout.in_features
    out = torch.zeros(N, dtype=accumulator_dtype(x.dtype, x.device), device=x.device)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(K, meta["BLOCK_K"]))  # noqa: E731
    sparse = outliers.tensors() if outliers is not None else {}
    _DECODE[grid](
        x,
        layout.perm if layout.perm is not None else layout.low,
        layout.low,
        layout.high if layout.high is not None else layout.low,
        layout.scales,
        layout.zeros,
        bias if bias is not None else layout.scales,
        out,
        sparse.get("row_ptr", layout.low),
        sparse.get("rows", layout.low),
        sparse.get("cols", layout.low),
        sparse.get("values", layout.scales),
        N,
        K,
        BITS=layout.bits,
        WIDTH=plane_widths(layout.bits)[0],
        PER_WORD=rows_per_word(layout.bits),
        GROUP=layout.group_rows,
        DEQUANT=DEQUANT_HALF if x.dtype == torch.float16 else DEQUANT_FP32,
        HAS_PERM=layout.perm is not None,
        HAS_BIAS=bias is not None,
        HAS_OUTLIERS=outliers is not None,
    )
    return out if out.dtype == x.dtype else out.to(x.dtype)
