"""The ``qc`` operator library: quantized computation as typed ops in the graph.

Each op is a ``torch.library`` custom op with a plain-torch reference implementation (what the
eager backend runs and what every kernel is tested against) and a fake implementation so graphs
stay shape-checkable. Backends map these ops to their own kernels; nothing else is rewritten.

``qc.quant_linear`` stores its weight in the GPTQ checkpoint layout (ALGORITHMS.md):
``qweight`` int32 ``[in·bits/32, out]`` packed along the input dim, ``qzeros`` int32
``[groups, out·bits/32]`` holding the real zero points (GPTQ "v2" convention: no −1 offset),
``scales`` fp16 ``[groups, out]``, ``g_idx`` int32 ``[in]`` mapping each input column to its group.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from qcompiler.algorithms.gguf_bytes import dequantize as dequantize_blocks
from qcompiler.algorithms.gguf_grids import FORMATS
from qcompiler.algorithms.hadamard import rotate_last_dim
from qcompiler.algorithms.int8 import quantize_per_token
from qcompiler.algorithms.packing import pack_cols, pack_rows, unpack_cols, unpack_rows
from qcompiler.ir.op_registry import OpSpec, register
from qcompiler.pipeline.pass_base import GraphProperty

__all__ = [
    "GPTQWeight",
    "pack_gptq",
    "dequantize_gptq",
    "quant_linear",
    "int8_matmul",
    "int8_linear",
    "expert_ranges",
    "quant_experts_linear",
    "dequantize_spqr_dense",
    "spqr_group_stats",
    "spqr_dense_linear",
    "sparse_outlier_linear",
    "to_csr",
    "GPTQ_TENSORS",
    "SPQR_DENSE_TENSORS",
    "spqr_experts_linear",
    "expert_csr",
    "per_expert",
    "hadamard",
    "gguf_linear",
    "dequantize_gguf",
    "GGUF_BLOCK_TYPES",
]


class GPTQWeight(NamedTuple):
    """One linear's weight in the GPTQ layout."""

    qweight: Tensor  # int32 [in*bits/32, out]
    qzeros: Tensor  # int32 [groups, out*bits/32], real zero points
    scales: Tensor  # float16 [groups, out]
    g_idx: Tensor  # int32 [in], group of each input column
    bits: int
    group_size: int  # -1: one group per output channel

    @property
    def in_features(self) -> int:
        """Input width of the packed weight."""
        return self.g_idx.numel()

    @property
    def out_features(self) -> int:
        """Output width of the packed weight."""
        return self.scales.shape[1]


GPTQ_TENSORS = GPTQWeight._fields[:4]  # ("qweight", "qzeros", "scales", "g_idx"): the stored tensors, by name


def pack_gptq(codes: Tensor, scales: Tensor, zeros: Tensor, g_idx: Tensor, bits: int, group_size: int) -> GPTQWeight:
    """Pack codes ``[out, in]`` and per-group ``scales``/``zeros`` ``[groups, out]`` into the layout."""
    return GPTQWeight(
        pack_rows(codes.t().contiguous(), bits),
        pack_cols(zeros.round().to(torch.int32), bits),
        scales.to(torch.float16).contiguous(),
        g_idx.to(torch.int32).contiguous(),
        bits,
        group_size,
    )


def dequantize_gptq(qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int) -> Tensor:
    """The float32 weight ``[out, in]`` the packed tensors stand for."""
    n_in, n_out = g_idx.numel(), scales.shape[1]
    codes = unpack_rows(qweight, bits, n_in)  # [in, out]
    zeros = unpack_cols(qzeros, bits, n_out)  # [groups, out]
    g = g_idx.long()
    w_t = (codes - zeros[g]).float() * scales[g].float()  # [in, out]
    return w_t.t()


@torch.library.custom_op("qc::quant_linear", mutates_args=())
def quant_linear(
    x: Tensor,
    qweight: Tensor,
    qzeros: Tensor,
    scales: Tensor,
    g_idx: Tensor,
    bias: Optional[Tensor],
    bits: int,
    group_size: int,
) -> Tensor:
    """Weight-only quantized linear (W{bits}A16/A32): dequantize, then an ordinary matmul."""
    w = dequantize_gptq(qweight, qzeros, scales, g_idx, bits).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


@quant_linear.register_fake
def _quant_linear_fake(x, qweight, qzeros, scales, g_idx, bias, bits, group_size):
    return x.new_empty((*x.shape[:-1], scales.shape[1]))


def _in_times_out(in_arg: str, out_arg: str) -> Callable:
    """Weights = (input columns recorded in ``in_arg``) x (output channels, last dim of ``out_arg``)."""
    return lambda a, gm: a.stored_like(gm, in_arg).numel() * a.stored_like(gm, out_arg).shape[-1]


_QUANTIZED = frozenset({GraphProperty.QUANTIZED_WEIGHTS})

register(
    OpSpec(
        "quant_linear",
        storage=("qweight", "qzeros", "scales"),
        weights=_in_times_out("g_idx", "scales"),
        code_widths=("bits",),
        establishes=_QUANTIZED,
    )
)


def expert_ranges(offsets: Tensor) -> list[tuple[int, int]]:
    """The ``(start, end)`` rows of each expert, from the cumulative counts ``offsets`` of rows
    sorted by expert (the layout of transformers' grouped matmul)."""
    ends = [int(v) for v in offsets.tolist()]
    return list(zip([0] + ends[:-1], ends))


def per_expert(x: Tensor, offsets: Tensor, n_out: int, rows_times: Callable[[Tensor, int], Tensor]) -> Tensor:
    """A grouped linear over rows sorted by expert: ``rows_times(rows, e)`` for each expert that
    received rows, written into its rows of a ``[rows, n_out]`` output; rows past the last offset
    stay zero. Every experts op's reference, kernel and ONNX-layout twin runs through this one loop."""
    y = x.new_zeros((x.shape[0], n_out))
    for e, (start, end) in enumerate(expert_ranges(offsets)):
        if end > start:
            y[start:end] = rows_times(x[start:end], e)
    return y


@torch.library.custom_op("qc::quant_experts_linear", mutates_args=())
def quant_experts_linear(
    x: Tensor,
    offsets: Tensor,
    qweight: Tensor,
    qzeros: Tensor,
    scales: Tensor,
    g_idx: Tensor,
    bits: int,
    group_size: int,
) -> Tensor:
    """A mixture-of-experts grouped linear with GPTQ-layout experts (``quant_linear``'s tensors
    stacked on a leading expert dim): ``x`` rows are sorted by expert, ``offsets[e]`` is the
    cumulative row count of experts ``0..e``. One expert's weight is dequantized at a time."""
    return per_expert(
        x,
        offsets,
        scales.shape[-1],
        lambda rows, e: F.linear(rows, dequantize_gptq(qweight[e], qzeros[e], scales[e], g_idx[e], bits).to(x.dtype)),
    )


@quant_experts_linear.register_fake
def _quant_experts_linear_fake(x, offsets, qweight, qzeros, scales, g_idx, bits, group_size):
    return x.new_empty((x.shape[0], scales.shape[-1]))


register(
    OpSpec(
        "quant_experts_linear",
        storage=("qweight", "qzeros", "scales"),
        weights=_in_times_out("g_idx", "scales"),  # g_idx [E, in]: E x in x out weights
        code_widths=("bits",),
        establishes=_QUANTIZED,
    )
)


def int8_matmul(xq: Tensor, wq: Tensor) -> Tensor:
    """Exact int8 × int8 → int32 product ``xq @ wq.T`` (int32 accumulation).

    CPU: ``torch._int_mm`` (oneDNN's int8 GEMM; measured 11× faster than an int32 ``@``, which has no
    BLAS path, at 4096×256×768). CUDA's ``_int_mm`` has shape limits, so there float64 is used: exact,
    since every partial sum is an integer below 2^53."""
    if xq.device.type == "cpu":
        return torch._int_mm(xq, wq.t())
    return (xq.double() @ wq.double().t()).to(torch.int32)


@torch.library.custom_op("qc::int8_linear", mutates_args=())
def int8_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Optional[Tensor],
    act_scale: Optional[Tensor],
    smooth_inv: Optional[Tensor],
) -> Tensor:
    """W8A8 linear: int8 weights (per output channel), int8 activations, int32 accumulation.

    ``act_scale`` None: per-token dynamic activation scales; else one static per-tensor scale.
    ``smooth_inv``: SmoothQuant's per-channel ``1/s`` for producers that could not absorb it,
    applied inside the activation quantizer (one multiply, no extra pass over memory).
    """
    return int8_linear_quantized(x, quantize_activations(x, act_scale, smooth_inv), weight, weight_scale, bias)


def quantize_activations(x: Tensor, act_scale: Optional[Tensor], smooth_inv: Optional[Tensor]) -> tuple:
    """``int8_linear``'s first half: int8 codes of ``x`` (times ``smooth_inv``) and their scales —
    per token ``[..., 1]``, or the static one ``[1]``. Linears that share an input can share it."""
    xs = x.float() if smooth_inv is None else x.float() * smooth_inv.float()
    if act_scale is None:
        return quantize_per_token(xs)
    sx = act_scale.float().reshape(1)
    return torch.clamp(torch.round(xs / sx), -127, 127).to(torch.int8), sx


def int8_linear_quantized(
    x: Tensor, quantized: tuple, weight: Tensor, weight_scale: Tensor, bias: Optional[Tensor]
) -> Tensor:
    """``int8_linear``'s second half on :func:`quantize_activations`' output (``x`` gives the dtype)."""
    xq, sx = quantized
    shape = xq.shape
    acc = int8_matmul(xq.reshape(-1, shape[-1]), weight).reshape(*shape[:-1], weight.shape[0])
    y = acc.float() * (sx if sx.numel() == 1 else sx.reshape(*sx.shape[:-1], 1)) * weight_scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@int8_linear.register_fake
def _int8_linear_fake(x, weight, weight_scale, bias, act_scale, smooth_inv):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


register(
    OpSpec(
        "int8_linear",
        storage=("weight", "weight_scale"),
        weights=lambda a, gm: a.stored_like(gm, "weight").numel(),
        establishes=frozenset({GraphProperty.INT8_LOWERED}),
    )
)


def spqr_group_stats(packed: Tensor, table: Tensor, stat_bits: int, stat_group_size: int) -> Tensor:
    """First-level statistics ``[groups, out]`` from their codes and (step, minimum) table."""
    n_out = table.shape[1] * stat_group_size
    c = unpack_cols(packed, stat_bits, n_out).float().reshape(packed.shape[0], -1, stat_group_size)
    return (table[..., :1].float() * c + table[..., 1:].float()).reshape(packed.shape[0], n_out)


def dequantize_spqr_dense(
    codes: Tensor,
    scale_codes: Tensor,
    zero_codes: Tensor,
    scale_stats: Tensor,
    zero_stats: Tensor,
    perm: Tensor,
    bits: int,
    group_size: int,
    stat_bits: int,
    stat_group_size: int,
) -> Tensor:
    """The float32 dense SpQR weight ``[out, in]`` (original column order) from its packed tensors."""
    n_in = perm.numel()
    scales = spqr_group_stats(scale_codes, scale_stats, stat_bits, stat_group_size).clamp(min=1e-8)
    zeros = spqr_group_stats(zero_codes, zero_stats, stat_bits, stat_group_size)
    q = unpack_rows(codes, bits, n_in).float()  # [in (permuted order), out]
    g = torch.arange(n_in, device=q.device) // group_size
    w_perm = scales[g] * (q - zeros[g])  # [in permuted, out]
    w = torch.empty_like(w_perm)
    w[perm.long()] = w_perm
    return w.t()


@torch.library.custom_op("qc::spqr_dense_linear", mutates_args=())
def spqr_dense_linear(
    x: Tensor,
    codes: Tensor,
    scale_codes: Tensor,
    zero_codes: Tensor,
    scale_stats: Tensor,
    zero_stats: Tensor,
    perm: Tensor,
    bias: Optional[Tensor],
    bits: int,
    group_size: int,
    stat_bits: int,
    stat_group_size: int,
) -> Tensor:
    """SpQR's dense low-bit branch: small groups, bi-level quantized statistics, act-order ``perm``."""
    w = dequantize_spqr_dense(
        codes, scale_codes, zero_codes, scale_stats, zero_stats, perm, bits, group_size, stat_bits, stat_group_size
    ).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


@spqr_dense_linear.register_fake
def _spqr_dense_fake(
    x, codes, scale_codes, zero_codes, scale_stats, zero_stats, perm, bias, bits, group_size, stat_bits, stat_group_size
):
    return x.new_empty((*x.shape[:-1], scale_stats.shape[1] * stat_group_size))


@torch.library.custom_op("qc::sparse_outlier_linear", mutates_args=())
def sparse_outlier_linear(x: Tensor, row_ptr: Tensor, col_idx: Tensor, values: Tensor, out_features: int) -> Tensor:
    """``x @ Sᵀ`` for a CSR matrix S (int32 row pointers, int16 columns, fp16 values)."""
    rows = torch.repeat_interleave(torch.arange(out_features, device=x.device), (row_ptr[1:] - row_ptr[:-1]).long())
    contrib = x[..., col_idx.long()] * values.to(x.dtype)  # [..., nnz]
    y = x.new_zeros((*x.shape[:-1], out_features))
    return y.index_add_(-1, rows, contrib)


@sparse_outlier_linear.register_fake
def _sparse_outlier_fake(x, row_ptr, col_idx, values, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def to_csr(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """CSR of the masked entries of ``values`` [out, in], sorted by row then column."""
    if mask.shape[1] > 32768:
        raise ValueError(f"in_features={mask.shape[1]} does not fit 16-bit column indices")
    rows, cols = mask.nonzero(as_tuple=True)
    row_ptr = torch.zeros(mask.shape[0] + 1, dtype=torch.int32, device=mask.device)
    row_ptr[1:] = torch.cumsum(mask.sum(1), 0).to(torch.int32)
    return row_ptr, cols.to(torch.int16), values[rows, cols].to(torch.float16)


register(
    OpSpec(
        "spqr_dense_linear",
        storage=("codes", "scale_codes", "zero_codes", "scale_stats", "zero_stats"),
        weights=lambda a, gm: (
            a.stored_like(gm, "perm").numel() * a.stored_like(gm, "scale_stats").shape[1] * a.stat_group_size
        ),
        code_widths=("bits", "stat_bits"),
        establishes=_QUANTIZED,
    )
)
register(
    OpSpec(
        "sparse_outlier_linear",
        storage=("row_ptr", "col_idx", "values"),  # outliers of a dense branch
        establishes=frozenset({GraphProperty.OUTLIERS_SPLIT}),
    )
)


SPQR_DENSE_TENSORS = ("codes", "scale_codes", "zero_codes", "scale_stats", "zero_stats", "perm")


def expert_csr(row_ptr: Tensor, col_idx: Tensor, values: Tensor, e: int) -> tuple[Tensor, Tensor, Tensor]:
    """Expert ``e``'s own CSR from the experts' shared one: ``row_ptr`` ``[E, out + 1]`` points
    into ``col_idx`` / ``values``, which hold every expert's outliers one expert after another."""
    start, end = int(row_ptr[e, 0]), int(row_ptr[e, -1])
    return row_ptr[e] - row_ptr[e, 0], col_idx[start:end], values[start:end]


@torch.library.custom_op("qc::spqr_experts_linear", mutates_args=())
def spqr_experts_linear(
    x: Tensor,
    offsets: Tensor,
    codes: Tensor,
    scale_codes: Tensor,
    zero_codes: Tensor,
    scale_stats: Tensor,
    zero_stats: Tensor,
    perm: Tensor,
    row_ptr: Tensor,
    col_idx: Tensor,
    values: Tensor,
    bits: int,
    group_size: int,
    stat_bits: int,
    stat_group_size: int,
) -> Tensor:
    """A mixture-of-experts grouped linear with SpQR experts: ``spqr_dense_linear``'s tensors
    stacked on a leading expert dim, plus every expert's outliers in one CSR (:func:`expert_csr`).
    Rows of ``x`` are sorted by expert as in ``quant_experts_linear``."""
    n_out = scale_stats.shape[-2] * stat_group_size

    def dense_plus_outliers(rows: Tensor, e: int) -> Tensor:
        dense = spqr_dense_linear(
            rows,
            codes[e],
            scale_codes[e],
            zero_codes[e],
            scale_stats[e],
            zero_stats[e],
            perm[e],
            None,
            bits,
            group_size,
            stat_bits,
            stat_group_size,
        )
        return dense + sparse_outlier_linear(rows, *expert_csr(row_ptr, col_idx, values, e), n_out)

    return per_expert(x, offsets, n_out, dense_plus_outliers)


@spqr_experts_linear.register_fake
def _spqr_experts_linear_fake(
    x,
    offsets,
    codes,
    scale_codes,
    zero_codes,
    scale_stats,
    zero_stats,
    perm,
    row_ptr,
    col_idx,
    values,
    bits,
    group_size,
    stat_bits,
    stat_group_size,
):
    return x.new_empty((x.shape[0], scale_stats.shape[-2] * stat_group_size))


register(
    OpSpec(
        "spqr_experts_linear",
        storage=("codes", "scale_codes", "zero_codes", "scale_stats", "zero_stats", "row_ptr", "col_idx", "values"),
        weights=lambda a, gm: (
            a.stored_like(gm, "perm").numel() * a.stored_like(gm, "scale_stats").shape[-2] * a.stat_group_size
        ),  # perm [E, in]: E x in x out weights
        code_widths=("bits", "stat_bits"),
        establishes=frozenset({GraphProperty.QUANTIZED_WEIGHTS, GraphProperty.OUTLIERS_SPLIT}),
    )
)


@torch.library.custom_op("qc::hadamard", mutates_args=())
def hadamard(x: Tensor, signs: Tensor, block_size: int) -> Tensor:
    """Online rotation ``x @ R``, ``R = diag(signs) · blockdiag(H_b/√b)`` (QuaRot's online Hadamard:
    the linear after it holds ``W R``, so their product is unchanged). Computed in float32."""
    return rotate_last_dim(x, signs, block_size).to(x.dtype)


@hadamard.register_fake
def _hadamard_fake(x, signs, block_size):
    return torch.empty_like(x)


def _hadamard_setup(ctx, inputs, output):
    _, signs, block_size = inputs
    ctx.save_for_backward(signs)
    ctx.block_size = block_size


def _hadamard_backward(ctx, grad):
    """``∂/∂x = grad · Rᵀ = (grad · blockdiag(H_b/√b)) · diag(signs)`` (H symmetric): for passes
    that tune weights by gradients through a rotated graph (SignRound)."""
    (signs,) = ctx.saved_tensors
    ones = torch.ones_like(signs)
    return (rotate_last_dim(grad, ones, ctx.block_size) * signs.to(grad.device)).to(grad.dtype), None, None


hadamard.register_autograd(_hadamard_backward, setup_context=_hadamard_setup)


register(OpSpec("hadamard"))  # no weights of its own: its signs are part of the FP model, like a norm's


GGUF_BLOCK_TYPES = tuple(f.name for f in FORMATS.values())  # llama.cpp block types qc.gguf_linear holds


def dequantize_gguf(blocks: Tensor, block_type: str, in_features: int) -> Tensor:
    """The float32 weight ``[out, in]`` that llama.cpp block bytes ``[out, ·]`` of ``block_type`` stand for."""
    if block_type not in GGUF_BLOCK_TYPES:
        raise ValueError(f"block_type {block_type!r} is not one qc.gguf_linear holds ({', '.join(GGUF_BLOCK_TYPES)})")
    return dequantize_blocks(block_type, blocks, in_features)


@torch.library.custom_op("qc::gguf_linear", mutates_args=())
def gguf_linear(x: Tensor, blocks: Tensor, bias: Optional[Tensor], block_type: str, in_features: int) -> Tensor:
    """Weight-only linear on llama.cpp's block bytes as they are written to a GGUF file (Q4_K, Q4_1:
    grids whose minima are not integer zero points): dequantize, then an ordinary matmul."""
    w = dequantize_gguf(blocks, block_type, in_features).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


@gguf_linear.register_fake
def _gguf_linear_fake(x, blocks, bias, block_type, in_features):
    return x.new_empty((*x.shape[:-1], blocks.shape[0]))


register(
    OpSpec(
        "gguf_linear",
        storage=("blocks",),
        weights=lambda a, gm: a.stored_like(gm, "blocks").shape[0] * a.in_features,
        establishes=_QUANTIZED,
    )
)
