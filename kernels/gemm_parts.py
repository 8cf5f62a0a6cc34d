"""Pieces shared by the dequantizing GEMM and GEMV kernels: the split-K range, a tile's codes, the dot,
the epilogue, SpQR's fused outliers."""

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


@triton.jit
def tile_codes(low_ptr, high_ptr, k0, rn, mask_n, N, K, BITS: tl.constexpr, WIDTH: tl.constexpr,
               PER_WORD: tl.constexpr, WORD_ROWS: tl.constexpr):  # fmt: skip
    """uint32 codes ``[WORD_ROWS, PER_WORD, BLOCK_N]`` of kernel-layout rows ``k0 …``: each word loaded
    once, its ``PER_WORD`` rows shifted out of it (``k0`` a multiple of 32: whole words of every plane)."""
    ri = tl.arange(0, WORD_ROWS)
    rj = tl.arange(0, PER_WORD)
    plane_rows = tl.cdiv(K, 32) * (32 // PER_WORD)
    word_row = k0 // PER_WORD + ri
    words = tl.load(
        low_ptr + word_row[:, None] * N + rn[None, :], mask=(word_row < plane_rows)[:, None] & mask_n[None, :], other=0
    ).to(tl.uint32, bitcast=True)
    codes = (words[:, None, :] >> (rj * WIDTH).to(tl.uint32)[None, :, None]) & ((1 << WIDTH) - 1)
    if BITS == 3:  # the third bit: a 1-bit plane, 32 rows per word, so two low-plane words per high word
        high_row = k0 // 32 + ri // 2
        high = tl.load(
            high_ptr + high_row[:, None] * N + rn[None, :],
            mask=(high_row < plane_rows // 2)[:, None] & mask_n[None, :],
            other=0,
        ).to(tl.uint32, bitcast=True)
        shift = ((ri % 2)[:, None] * 16 + rj[None, :]).to(tl.uint32)
        codes = codes | (((high[:, None, :] >> shift[:, :, None]) & 1) << 2)
    return codes


@triton.jit
def tile_stats(scales_ptr, zeros_ptr, k0, rn, mask_n, N, K, GROUP: tl.constexpr, PER_WORD: tl.constexpr,
               WORD_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """float32 scales and zeros of the tile at rows ``k0 …``: ``[1, BLOCK_N]`` when the tile lies in one
    group, else ``[WORD_ROWS, BLOCK_N]``, one row per word row (each in one group: ``GROUP`` is a
    multiple of ``PER_WORD``); broadcast over a ``tile_codes`` tile as ``[:, None, :]``."""
    if GROUP % BLOCK_K == 0:
        stat = (k0 // GROUP) * N + rn[None, :]
        stat_mask = mask_n[None, :]
    else:
        first = k0 + tl.arange(0, WORD_ROWS) * PER_WORD
        stat = (first // GROUP)[:, None] * N + rn[None, :]
        stat_mask = (first < K)[:, None] & mask_n[None, :]
    s = tl.load(scales_ptr + stat, mask=stat_mask, other=0.0).to(tl.float32)
    z = tl.load(zeros_ptr + stat, mask=stat_mask, other=0.0).to(tl.float32)
    return s, z


@triton.jit
def add_fused_outliers(x_ptr, perm_ptr, out_ptr, row_ptr_ptr, rows_ptr, cols_ptr, values_ptr, pid_n, pid_k,
                       programs_k, N, HAS_PERM: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """SpQR's outliers of output rows ``pid_n·BLOCK_N …`` shared out among the ``programs_k`` programs of
    that column block: ``out[row] += x[col] · value``, atomically (``col`` a layout row: through
    ``perm`` when the activations are in column order)."""
    start = tl.load(row_ptr_ptr + pid_n * BLOCK_N)
    end = tl.load(row_ptr_ptr + tl.minimum(pid_n * BLOCK_N + BLOCK_N, N))
    share = tl.cdiv(end - start, programs_k)
    lo = start + pid_k * share
    hi = tl.minimum(lo + share, end)
    for c0 in range(lo, hi, 64):
        idx = c0 + tl.arange(0, 64)
        live = idx < hi
        rows = tl.load(rows_ptr + idx, mask=live, other=0)
        cols = tl.load(cols_ptr + idx, mask=live, other=0)
        if HAS_PERM:
            cols = tl.load(perm_ptr + cols, mask=live, other=0)
        value = tl.load(values_ptr + idx, mask=live, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + cols, mask=live, other=0.0).to(tl.float32)
        tl.atomic_add(out_ptr + rows, (xv * value).to(out_ptr.dtype.element_ty), mask=live)
