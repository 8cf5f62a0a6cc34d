"""SpQR's storage (Dettmers et al., ICLR 2024): a dense low-bit branch with bi-level quantized
group statistics and an act-order permutation (``qc.spqr_dense_linear``), plus a sparse fp16
outlier branch in CSR (``qc.sparse_outlier_linear``) added to its output; experts stacked in one
``qc.spqr_experts_linear`` (docs/methods/spqr.md). Both branches stay visible to later passes and
backends.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx import GraphModule

from qcompiler.algorithms.packing import pack_cols, pack_rows, packed_length, unpack_cols, unpack_rows
from qcompiler.algorithms.spqr import SpQRResult
from qcompiler.ir.graph import LinearLayer, aten
from qcompiler.ir.graph_property import GraphProperty
from qcompiler.ir.node_swap import replace_linear
from qcompiler.ir.op_registry import OpSpec, args_of, call_op, expect_stored, register
from qcompiler.ir.ops import per_expert
from qcompiler.ir.tensors import set_tensor
from qcompiler.layouts.base import LayerQuant, Layout, register_layout, same_in_every_range

__all__ = [
    "SPQR",
    "SPQR_DENSE_TENSORS",
    "pack_spqr",
    "to_csr",
    "expert_csr",
    "spqr_group_stats",
    "dequantize_spqr_dense",
    "spqr_dense_linear",
    "sparse_outlier_linear",
    "spqr_experts_linear",
    "top_outlier_columns",
]

QUANTIZED = frozenset({GraphProperty.QUANTIZED_WEIGHTS})


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


def _validate_dense(a, gm: GraphModule) -> None:
    """The dense branch's stored tensors: a permutation of the input columns, int32 codes and
    statistic codes for its widths, fp16 (step, minimum) tables, shapes that agree."""
    (n_in,) = expect_stored(a, gm, "perm", (torch.int32,))
    groups, runs, pair = expect_stored(a, gm, "scale_stats", (torch.float16,))
    group_size, stat_group = int(a.group_size), int(a.stat_group_size)
    if pair != 2 or group_size < 1 or stat_group < 1 or groups * group_size != n_in:
        raise ValueError(
            f"scale_stats has shape {(groups, runs, pair)}, which {n_in} input columns in groups of {group_size} "
            "with (step, minimum) pairs do not give"
        )
    n_out = runs * stat_group
    expect_stored(a, gm, "zero_stats", (torch.float16,), (groups, runs, 2))
    expect_stored(a, gm, "codes", (torch.int32,), (packed_length(n_in, int(a.bits)), n_out))
    for name in ("scale_codes", "zero_codes"):
        expect_stored(a, gm, name, (torch.int32,), (groups, packed_length(n_out, int(a.stat_bits))))
    perm = a.tensor(gm, "perm").long()
    if n_in and not torch.equal(perm.sort().values, torch.arange(n_in, device=perm.device)):
        raise ValueError(f"perm is not a permutation of the {n_in} input columns")


def _validate_outliers(a, gm: GraphModule) -> None:
    """The CSR outliers: ``out + 1`` non-decreasing int32 row pointers from 0 to the stored count,
    int16 columns that are not negative, fp16 values — a pointer past the values would read outside
    them in a kernel."""
    n_out = int(a.out_features)
    expect_stored(a, gm, "row_ptr", (torch.int32,), (n_out + 1,))
    (nnz,) = expect_stored(a, gm, "values", (torch.float16,))
    expect_stored(a, gm, "col_idx", (torch.int16,), (nnz,))
    row_ptr = a.tensor(gm, "row_ptr").long()
    if int(row_ptr[0]) != 0 or int(row_ptr[-1]) != nnz or bool((row_ptr[1:] < row_ptr[:-1]).any()):
        raise ValueError(f"row_ptr does not run non-decreasing from 0 to the {nnz} stored outliers")
    if nnz and int(a.tensor(gm, "col_idx").min()) < 0:
        raise ValueError("col_idx holds a negative column")


register(
    OpSpec(
        "spqr_dense_linear",
        storage=("codes", "scale_codes", "zero_codes", "scale_stats", "zero_stats"),
        weights=lambda a, gm: (
            a.stored_like(gm, "perm").numel() * a.stored_like(gm, "scale_stats").shape[1] * a.stat_group_size
        ),
        code_widths=("bits", "stat_bits"),
        establishes=QUANTIZED,
        validate=_validate_dense,
    )
)
register(
    OpSpec(
        "sparse_outlier_linear",
        storage=("row_ptr", "col_idx", "values"),  # outliers of a dense branch
        establishes=frozenset({GraphProperty.OUTLIERS_SPLIT}),
        validate=_validate_outliers,
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


def pack_spqr(res: SpQRResult, bits: int, stat_bits: int) -> dict[str, torch.Tensor]:
    """The stored tensors of one SpQR layer (layout in docs/methods/spqr.md)."""
    row_ptr, col_idx, values = to_csr(res.outlier_values, res.outliers)
    return {
        "codes": pack_rows(res.codes.t().contiguous(), bits),
        "scale_codes": pack_cols(res.scale_codes, stat_bits),
        "zero_codes": pack_cols(res.zero_codes, stat_bits),
        "scale_stats": res.scale_stats.contiguous(),
        "zero_stats": res.zero_stats.contiguous(),
        "perm": res.perm.to(torch.int32),
        "row_ptr": row_ptr,
        "col_idx": col_idx,
        "values": values,
    }


def top_outlier_columns(per_col: torch.Tensor, k: int = 3) -> str:
    """The ``k`` columns holding the most outliers and their shares, from outliers per column."""
    total = int(per_col.sum())
    if total == 0:
        return ""
    top = torch.topk(per_col, min(k, per_col.numel()))
    return ",".join(f"{int(c)}:{int(n) / total:.0%}" for n, c in zip(top.values, top.indices) if n > 0)


def _stack_experts(results: list[LayerQuant]) -> tuple[str, dict, dict]:
    """``qc.spqr_experts_linear``: the dense tensors stacked per expert; the outliers of all
    experts in one CSR whose ``row_ptr`` [E, out + 1] points into the shared columns and values."""
    parts = [r.tensors for r in results]
    tensors = {n: torch.stack([t[n] for t in parts]) for n in SPQR_DENSE_TENSORS}
    starts = torch.tensor([0] + [int(t["row_ptr"][-1]) for t in parts]).cumsum(0)
    row_ptr = [t["row_ptr"].long() + int(base) for t, base in zip(parts, starts)]
    tensors["row_ptr"] = torch.stack(row_ptr).to(torch.int32)
    tensors["col_idx"] = torch.cat([t["col_idx"] for t in parts])
    tensors["values"] = torch.cat([t["values"] for t in parts])
    return (
        "spqr_experts_linear",
        tensors,
        {k: v for k, v in results[0].rewrite.constants.items() if k != "out_features"},
    )


def _rewrite(
    gm: GraphModule,
    layer: LinearLayer,
    tensors: dict,
    bits: int,
    group_size: int,
    stat_bits: int,
    stat_group_size: int,
    out_features: int,
) -> None:
    """The dense low-bit op in the linear's place, plus the sparse outlier op added to its output."""
    dense = replace_linear(
        gm,
        layer,
        "spqr_dense_linear",
        {n: tensors[n] for n in SPQR_DENSE_TENSORS},
        lambda x, a: dict(
            x=x,
            **a,
            bias=layer.bias_node,
            bits=bits,
            group_size=group_size,
            stat_bits=stat_bits,
            stat_group_size=stat_group_size,
        ),
    )
    graph = gm.graph
    base = layer.path
    for n in ("row_ptr", "col_idx", "values"):
        set_tensor(gm, f"{base}.{n}", tensors[n])
    users = list(dense.users)
    with graph.inserting_before(dense.next):  # a fixed point keeps creation order
        attrs = {n: graph.get_attr(f"{base}.{n}") for n in ("row_ptr", "col_idx", "values")}
        sparse = call_op(graph, "sparse_outlier_linear", x=args_of(dense).x, **attrs, out_features=out_features)
        total = graph.call_function(aten.add.Tensor, (dense, sparse))
    for node in (sparse, total):
        node.meta.update({k: v for k, v in dense.meta.items() if k in ("nn_module_stack", "val")})
    for user in users:
        user.replace_input_with(dense, total)


def _join_rows(parts: list[dict], constants: list[dict]) -> tuple[dict, dict, dict]:
    """Row ranges of one SpQR layer: dense codes and statistics are ``[…, out]`` (statistics packed
    along the outputs in whole words and groups), the outliers' CSR rows follow one another; the
    report's busiest outlier columns are counted from the joined CSR."""
    joined = {n: torch.cat([t[n] for t in parts], dim=1) for n in ("codes", "scale_codes", "zero_codes")}
    joined.update({n: torch.cat([t[n] for t in parts], dim=1) for n in ("scale_stats", "zero_stats")})
    starts = [0]
    for t in parts:
        starts.append(starts[-1] + int(t["row_ptr"][-1]))
    row_ptr = [parts[0]["row_ptr"][:1]] + [t["row_ptr"][1:] + base for t, base in zip(parts, starts)]
    joined["row_ptr"] = torch.cat(row_ptr).to(torch.int32)
    joined["col_idx"] = torch.cat([t["col_idx"] for t in parts])
    joined["values"] = torch.cat([t["values"] for t in parts])
    joined["perm"] = same_in_every_range("perm", parts)
    out_features = sum(c["out_features"] for c in constants)
    n_in = parts[0]["perm"].numel()
    per_col = torch.bincount(joined["col_idx"].long(), minlength=n_in)
    return joined, {**constants[0], "out_features": out_features}, {"top_outlier_columns": top_outlier_columns(per_col)}


SPQR = register_layout(
    Layout(
        "spqr",
        linear_op="spqr_dense_linear",
        ops=("spqr_dense_linear", "sparse_outlier_linear", "spqr_experts_linear"),
        rewrite=_rewrite,
        row_unit=32,  # codes and statistics packed along the outputs in int32 words
        row_join=_join_rows,
        experts_op="spqr_experts_linear",
        experts_stack=_stack_experts,
        description="SpQR: dense low-bit codes with bi-level statistics plus fp16 CSR outliers",
    )
)
