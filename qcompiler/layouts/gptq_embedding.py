"""A token-embedding table in the GPTQ layout: ``qc.quant_embedding``.

On today's small models the embedding is most of the parameters (Gemma-3 270M: 63 %, 262,144 x 640),
and a tied output head reads the same table. The table ``[vocabulary, hidden]`` is stored exactly as
``qc.quant_linear`` stores a weight ``[out, in]`` (``layouts/gptq.py``: codes packed along the hidden
dim, fp16 scales and integer zeros per group of ``group_size`` hidden columns, per token), so one set
of stored tensors serves the lookup (this op: the rows of the asked tokens, dequantized) and a tied
head (``qc.quant_linear`` over the same attributes) — the tie is kept, and counted once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qcompiler.algorithms.packing import unpack_cols, unpack_rows
from qcompiler.ir.graph_property import GraphProperty
from qcompiler.ir.op_registry import OpSpec, register
from qcompiler.layouts.gptq import _validate, dequantize_gptq

__all__ = ["quant_embedding", "dequantize_rows", "reference_embedding"]


def dequantize_rows(qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int, ids: Tensor) -> Tensor:
    """Rows ``ids`` (any shape) of the table the packed tensors stand for, float32 ``[*ids.shape,
    hidden]``, unpacking only those tokens' codes (the whole table is never dequantized)."""
    flat = ids.reshape(-1).long()
    n_in, n_out = g_idx.numel(), scales.shape[1]
    codes = unpack_rows(qweight.index_select(1, flat), bits, n_in)  # [hidden, tokens]
    zeros = unpack_cols(qzeros, bits, n_out).index_select(1, flat)  # [groups, tokens]
    g = g_idx.long()
    rows = (codes - zeros[g]).float() * scales.index_select(1, flat)[g].float()
    return rows.t().reshape(*ids.shape, n_in)


@torch.library.custom_op("qc::quant_embedding", mutates_args=())
def quant_embedding(
    ids: Tensor,
    qweight: Tensor,
    qzeros: Tensor,
    scales: Tensor,
    g_idx: Tensor,
    bits: int,
    group_size: int,
    out_dtype: torch.dtype,
) -> Tensor:
    """``embedding(table, ids)`` for a table stored in the GPTQ layout, in ``out_dtype`` (the FP
    table's dtype: what the graph after it expects)."""
    return dequantize_rows(qweight, qzeros, scales, g_idx, bits, ids).to(out_dtype)


@quant_embedding.register_fake
def _quant_embedding_fake(ids, qweight, qzeros, scales, g_idx, bits, group_size, out_dtype):
    return torch.empty((*ids.shape, g_idx.shape[0]), dtype=out_dtype, device=scales.device)


def reference_embedding(qweight, qzeros, scales, g_idx, bits, ids) -> Tensor:
    """The plain twin: the whole table dequantized, then indexed (tests compare the op with it)."""
    return dequantize_gptq(qweight, qzeros, scales, g_idx, bits)[ids.long()]


register(
    OpSpec(
        "quant_embedding",
        storage=("qweight", "qzeros", "scales"),
        # vocabulary x hidden, as qc.quant_linear counts out x in
        weights=lambda a, gm: a.stored_like(gm, "g_idx").numel() * a.stored_like(gm, "scales").shape[-1],
        code_widths=("bits",),
        establishes=frozenset({GraphProperty.QUANTIZED_EMBEDDINGS}),
        validate=_validate,
    )
)
