"""Dequantizing GEMM on the GPTQ layout (``qc.quant_linear``): W{2,3,4,8}A16/A32, groups, act-order.

Each program dequantizes a ``BLOCK_K × BLOCK_N`` tile of the packed weight in registers —
codes from the bit stream; zeros and scales read once per tile when the tile lies in one group
(contiguous groups of a multiple of 128, or per-channel), else per row through ``g_idx`` (act-order)
— and multiplies it with the activation tile; the weight is read once, at ``bits`` per weight.
Two variants, chosen by the number of rows ``M``:

* decode (M ≤ 16): split-K — ``SPLIT_K`` programs share the K dimension of one output tile and add
  their partial sums atomically into an fp32 buffer, so a GEMV still fills the GPU;
* prefill: an ordinary tiled GEMM.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import triton
import triton.language as tl

from qcompiler.algorithms.packing import SUPPORTED_BITS
from qcompiler.ir.ops import per_expert
from qcompiler.kernels.bitstream import bits_at
from qcompiler.kernels.gemm_parts import dot_accumulate, split_k_range, store_output
from qcompiler.kernels.tuning import Tunable, UnsupportedKernel, check_activation, dot_upcast

__all__ = ["gptq_linear", "tunable_pair", "launch_lowbit_gemm", "DECODE_MAX_M"]

DECODE_MAX_M = 16
MAX_BLOCK_K = 128  # no config uses a larger K tile, so groups of a multiple of it never split a tile
# id(g_idx) -> {group_size: contiguous?}; checked once per tensor (the check syncs with the GPU),
# forgotten when the tensor is freed (so a reused id never sees a stale answer)
_CONTIGUOUS: dict[int, dict] = {}


def _grouped_size(g_idx: torch.Tensor, group_size: int, K: int):
    """The group size to read statistics once per tile with, or None (act-order or small groups)."""
    if group_size == -1:
        return 1 << 30  # one group: k0 // 2**30 == 0 for every tile
    if group_size % MAX_BLOCK_K:
        return None
    if id(g_idx) not in _CONTIGUOUS:
        _CONTIGUOUS[id(g_idx)] = {}
        weakref.finalize(g_idx, _CONTIGUOUS.pop, id(g_idx), None)
    known = _CONTIGUOUS[id(g_idx)]
    if group_size not in known:
        known[group_size] = bool(torch.equal(g_idx.long(), torch.arange(K, device=g_idx.device) // group_size))
    return group_size if known[group_size] else None


@triton.jit
def _gptq_gemm_kernel(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    g_idx_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    group_size,
    BITS: tl.constexpr,
    GROUPED: tl.constexpr,
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
    zero_word_n = (rn * BITS) // 32  # where output column n's zero point sits in a qzeros row
    zero_shift_n = (rn * BITS) % 32
    zero_row_words = (N * BITS) // 32
    k_lo, k_hi = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask_k = rk < k_hi
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        tile_mask = mask_k[:, None] & mask_n[None, :]
        codes = bits_at(
            qweight_ptr, ((rk * BITS) // 32)[:, None] * N + rn[None, :], N, ((rk * BITS) % 32)[:, None], tile_mask, BITS
        )
        if GROUPED:  # the tile lies in one group: its zeros and scales are one row, read once
            g = k0 // group_size
            zeros = bits_at(qzeros_ptr, g * zero_row_words + zero_word_n, 1, zero_shift_n, mask_n, BITS)[None, :]
            scales = tl.load(scales_ptr + g * N + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        else:  # act-order: each row's group through g_idx
            g = tl.load(g_idx_ptr + rk, mask=mask_k, other=0)
            zeros = bits_at(
                qzeros_ptr,
                g[:, None] * zero_row_words + zero_word_n[None, :],
                1,
                zero_shift_n[None, :],
                tile_mask,
                BITS,
            )
            scales = tl.load(scales_ptr + g[:, None] * N + rn[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        w = ((codes - zeros).to(tl.float32) * scales).to(x.dtype)
        acc = dot_accumulate(acc, x, w, IEEE, UPCAST)
    store_output(acc, bias_ptr, out_ptr, rm, rn, M, N, pid_k, HAS_BIAS, SPLIT_K)


def _decode_configs():
    return [  # nine, not the full product: each config is one more compile per kernel variant on a GPU;
        # the small tiles split 8-16 ways are what fills 132 SMs at M = 2-16 on a 4096-wide layer
        triton.Config({"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk}, num_warps=w, num_stages=3)
        for bn, bk, sk, w in (
            (64, 128, 1, 4),
            (64, 128, 4, 4),
            (64, 64, 8, 4),
            (128, 128, 1, 4),
            (128, 128, 4, 4),
            (128, 64, 8, 4),
            (64, 64, 16, 2),
            (32, 128, 8, 2),
            (64, 32, 16, 2),
        )
    ]


def _prefill_configs():
    shapes = [(64, 64, 32, 4, 4), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4), (128, 128, 32, 8, 3), (64, 64, 64, 4, 3)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in shapes
    ]


def tunable_pair(kernel) -> tuple[Tunable, Tunable]:
    """The (decode, prefill) launchers of a dequantizing GEMM kernel with this file's signature."""
    return (
        Tunable(
            kernel,
            _decode_configs(),
            key=["M", "N", "K"],  # M <= DECODE_MAX_M: few values, each with its own best split
            reset_to_zero=["out_ptr"],
            interpret_config={"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 2},
        ),
        Tunable(
            kernel,
            _prefill_configs(),
            key=["N", "K"],
            interpret_config={"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1},
        ),
    )


def launch_lowbit_gemm(
    pair, x: torch.Tensor, K: int, N: int, weights: tuple, bias, extra: tuple, **meta
) -> torch.Tensor:
    """Run ``kernel(x, *weights, bias, out, M, N, K, stride_xm, *extra, **meta)``: the decode variant
    (split-K into a zeroed fp32 buffer) for up to DECODE_MAX_M rows, else the prefill one."""
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    decode = M <= DECODE_MAX_M
    out = (
        torch.zeros((M, N), dtype=torch.float32, device=x.device)
        if decode
        else torch.empty((M, N), dtype=x.dtype, device=x.device)
    )
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
    pair[0 if decode else 1][grid](
        x2,
        *weights,
        bias if bias is not None else weights[-1],
        out,
        M,
        N,
        K,
        x2.stride(0),
        *extra,
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        UPCAST=dot_upcast(x.dtype),
        **meta,
    )
    return out.to(x.dtype).reshape(*x.shape[:-1], N)


_GEMM = tunable_pair(_gptq_gemm_kernel)


def gptq_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bias: Optional[torch.Tensor],
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """``qc.quant_linear`` as one kernel launch (same arguments, same result within fp rounding)."""
    check_activation("gptq_gemm", x)
    if bits not in SUPPORTED_BITS:
        raise UnsupportedKernel(f"gptq_gemm: {bits}-bit weights are not supported (supported: {SUPPORTED_BITS})")
    K, N = g_idx.numel(), scales.shape[1]
    grouped = _grouped_size(g_idx, group_size, K)
    return launch_lowbit_gemm(
        _GEMM, x, K, N, (qweight, qzeros, scales, g_idx), bias, (grouped or 0,), BITS=bits, GROUPED=grouped is not None
    )


def gptq_experts_linear(
    x: torch.Tensor,
    offsets: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """``qc.quant_experts_linear``: one ``gptq_gemm`` launch per expert that received rows (the rows
    arrive sorted by expert; ``offsets`` are the cumulative counts)."""
    return per_expert(
        x,
        offsets,
        scales.shape[-1],
        lambda rows, e: gptq_linear(rows, qweight[e], qzeros[e], scales[e], g_idx[e], None, bits, group_size),
    )
