"""SpQR (Dettmers et al., ICLR 2024): each linear becomes a dense 3-bit branch plus a sparse fp16 one.

``linear(x)`` → ``add(qc.spqr_dense_linear(x, …), qc.sparse_outlier_linear(x, …))``: both nodes stay
visible to later passes and backends. A mixture-of-experts parameter becomes one
``qc.spqr_experts_linear`` (each expert quantized on its routed rows; docs/methods/spqr.md). The
algorithm is ``qcompiler.algorithms.spqr.spqr_quantize``; with an ``outlier_fraction`` budget the
relative threshold is bisected per layer (log scale) to the smallest τ whose outliers fit the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from torch.fx import GraphModule

from qcompiler.algorithms.packing import pack_cols, pack_rows
from qcompiler.algorithms.spqr import SpQRResult, check_spqr_spec, spqr_quantize
from qcompiler.errors import QuantizationError
from qcompiler.ir.graph import LinearLayer, aten
from qcompiler.ir.op_registry import args_of, call_op
from qcompiler.ir.ops import SPQR_DENSE_TENSORS, to_csr
from qcompiler.ir.tensors import set_tensor
from qcompiler.pipeline.folding import replace_linear
from qcompiler.pipeline.pass_base import GraphProperty
from qcompiler.pipeline.weight_only import (
    ExpertsFormat,
    LayerQuant,
    LayerRewrite,
    check_packable,
    register_rewrite,
    register_row_join,
    same_in_every_range,
)
from qcompiler.pipeline.weight_quantizer import WeightQuantizer

__all__ = ["SpQR", "pack_spqr"]


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


def stored_bits(tensors: dict[str, torch.Tensor]) -> int:
    """Bits of everything per weight, except ``perm`` (per column, like GPTQ's g_idx)."""
    return sum(t.numel() * t.element_size() * 8 for name, t in tensors.items() if name != "perm")


def _top_columns(per_col: torch.Tensor, k: int = 3) -> str:
    """The ``k`` columns holding the most outliers and their shares, from outliers per column."""
    total = int(per_col.sum())
    if total == 0:
        return ""
    top = torch.topk(per_col, min(k, per_col.numel()))
    return ",".join(f"{int(c)}:{int(n) / total:.0%}" for n, c in zip(top.values, top.indices) if n > 0)


@dataclass(frozen=True)
class SpQR(WeightQuantizer):
    """Replaces each block linear with a dense low-bit SpQR op plus a sparse fp16 outlier op, summed."""

    bits: int = 3
    group_size: int = 16
    stat_bits: int = 3
    stat_group_size: int = 16
    outlier_threshold: float = 1.0  # relative τ (ignored when outlier_fraction is set)
    outlier_fraction: Optional[float] = None  # target fraction of weights kept in fp16, per layer
    act_order: bool = True
    damp: float = 0.01
    block_size: int = 128
    true_sequential: bool = True
    ignore: tuple[str, ...] = ()  # module paths kept in full precision: globs, or 're:' + a regex

    requires = frozenset()
    provides = frozenset({GraphProperty.QUANTIZED_WEIGHTS, GraphProperty.OUTLIERS_SPLIT})
    needs_calibration: ClassVar = True
    needs_hessian: ClassVar = True

    def __post_init__(self):
        super().__post_init__()
        if self.stat_bits is None:  # the algorithm allows fp16 statistics; the stored layout does not
            raise QuantizationError(
                "SpQR(stat_bits=None): the SpQR pass stores quantized group statistics; "
                "choose stat_bits 2, 3, 4 or 8 (fp16 statistics exist only in "
                "qcompiler.algorithms.spqr.spqr_quantize)"
            )
        check_spqr_spec(self.bits, self.group_size, self.stat_bits, self.stat_group_size)
        if self.outlier_fraction is not None and not 0 <= self.outlier_fraction < 1:
            raise QuantizationError(f"outlier_fraction must be in [0, 1), got {self.outlier_fraction}")
        if self.outlier_fraction is None and not self.outlier_threshold > 0:
            raise QuantizationError(
                f"outlier_threshold={self.outlier_threshold} selects every weight as an "
                f"outlier; use a positive relative threshold (0.1-1.0 is typical)"
            )

    def _quantize(
        self, W: torch.Tensor, H: torch.Tensor, tau: float, whole: Optional[torch.Tensor] = None
    ) -> SpQRResult:
        return spqr_quantize(
            W,
            H,
            bits=self.bits,
            group_size=self.group_size,
            stat_bits=self.stat_bits,
            stat_group_size=self.stat_group_size,
            outlier_threshold=tau,
            act_order=self.act_order,
            damp=self.damp,
            block_size=self.block_size,
            tau_weight=whole,
        )

    def _within_budget(self, W: torch.Tensor, H: torch.Tensor) -> tuple[SpQRResult, float]:
        """Bisect log τ in [1e-2, 1e3] for the smallest τ whose outlier fraction fits the budget."""
        if self.outlier_fraction == 0:
            return self._quantize(W, H, float("inf")), float("inf")
        lo, hi = math.log(1e-2), math.log(1e3)
        best = self._quantize(W, H, math.exp(hi)), math.exp(hi)
        for _ in range(8):
            mid = (lo + hi) / 2
            res = self._quantize(W, H, math.exp(mid))
            if res.outliers.float().mean().item() <= self.outlier_fraction:
                best, hi = (res, math.exp(mid)), mid
            else:
                lo = mid
        return best

    def row_split_unit(self, layer: LinearLayer) -> Optional[int]:
        """Whole statistic groups of rows in whole packed words; not with an ``outlier_fraction``
        (its τ is searched on the whole layer's outliers)."""
        return None if self.outlier_fraction is not None else math.lcm(32, self.stat_group_size)

    def quantize_row_range(self, layer: LinearLayer, W: torch.Tensor, H: torch.Tensor, start: int, stop: int):
        """Rows ``[start, stop)``, with the whole layer's outlier threshold."""
        return self.quantize_layer(layer, W[start:stop], H, whole=W)

    def quantize_layer(
        self, layer: LinearLayer, W: torch.Tensor, H: torch.Tensor, whole: Optional[torch.Tensor] = None
    ) -> LayerQuant:
        """SpQR on one layer: dense low-bit codes with bi-level statistics plus fp16 outliers.
        ``whole``: the layer's weight when ``W`` is a range of its rows (``quantize_row_range``)."""
        check_packable(layer, W, self.bits)
        if W.shape[1] < self.group_size or W.shape[0] < self.stat_group_size:
            raise QuantizationError(
                f"layer {layer.path} ({W.shape[0]}x{W.shape[1]}) is narrower than one "
                f"group ({self.group_size} columns, {self.stat_group_size} rows)"
            )
        if self.outlier_fraction is None:
            res, tau = self._quantize(W, H, self.outlier_threshold, whole), self.outlier_threshold
        else:
            res, tau = self._within_budget(W, H)
        tensors = pack_spqr(res, self.bits, self.stat_bits)
        figures = {
            "bits": self.bits,
            "bits_per_weight": stored_bits(tensors) / W.numel(),
            "outlier_fraction": res.outliers.float().mean().item(),
            "tau": tau,
            "top_outlier_columns": _top_columns(res.outliers.sum(0)),
            "damp": res.damp,
            "damp_steps": res.damp_steps,
        }
        constants = dict(
            bits=self.bits,
            group_size=self.group_size,
            stat_bits=self.stat_bits,
            stat_group_size=self.stat_group_size,
            out_features=W.shape[0],
        )
        return LayerQuant(res.dequantized, figures, tensors, LayerRewrite("spqr", constants))

    def _no_tokens(self, layer: LinearLayer, W: torch.Tensor, H: None) -> LayerQuant:
        return self.quantize_layer(layer, W, torch.eye(W.shape[1], device=W.device))

    def experts_format(self) -> ExpertsFormat:
        """Experts as one ``qc.spqr_experts_linear``; an expert without tokens gets an identity Hessian."""
        return ExpertsFormat(self._stack_experts, self._no_tokens, "SpQR on an identity Hessian")

    def _stack_experts(self, results: list[LayerQuant]) -> tuple[str, dict, dict]:
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
            dict(
                bits=self.bits,
                group_size=self.group_size,
                stat_bits=self.stat_bits,
                stat_group_size=self.stat_group_size,
            ),
        )


@register_rewrite("spqr")
def _spqr_rewrite(
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


@register_row_join("spqr")
def _join_spqr(parts: list[dict], constants: list[dict]) -> tuple[dict, dict, dict]:
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
    return joined, {**constants[0], "out_features": out_features}, {"top_outlier_columns": _top_columns(per_col)}
