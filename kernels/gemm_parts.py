"""Pieces shared by the dequantizing GEMM kernels: the split-K range, the dot, the epilogue."""

import triton
import triton.language as tl


@triton.jit
def split_k_range(pid_k, K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """The ``[k_lo, k_hi)`` slice of K that program ``pid_k`` of ``SPLIT_K`` reduces (whole K tiles)."""
    k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    return k_lo, tl.minimum(k_lo + k_per_split, K)


@triton.jit
def dot_accumulate(acc, x, w, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + x @ w``; fp32 tiles in exact fp32 (``ieee``), bf16 widened only where the
    interpreter needs it (``tuning.dot_upcast``)."""
    if UPCAST:
        acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        acc = tl.dot(x, w, acc, input_precision="ieee")
    else:
        acc = tl.dot(x, w, acc)
    return acc


@triton.jit
def store_output(acc, bias_ptr, out_ptr, rm, rn, M, N, pid_k, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """Add the bias (once, by the first K slice) and store, or add atomically into the fp32 buffer
    when K is split across programs."""
    mask_n = rn < N
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rm[:, None] * N + rn[None, :]
    out_mask = (rm < M)[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=out_mask)
