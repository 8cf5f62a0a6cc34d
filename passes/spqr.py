"""SpQR (Dettmers et al., ICLR 2024): each linear becomes a dense 3-bit branch plus a sparse fp16 one
(stored in the SpQR layout, ``qcompiler/layouts/spqr.py``).

``linear(x)`` → ``add(qc.spqr_dense_linear(x, …), qc.sparse_outlier_linear(x, …))``: both nodes stay
visible to later passes and backends. A mixture-of-experts parameter becomes one
``qc.spqr_experts_linear`` (each expert quantized on its routed rows; docs/methods/spqr.md). The
algorithm is ``qcompiler.algorithms.spqr.spqr_quantize``; with an ``outlier_fraction`` budget the
relative threshold is bisected per layer (log scale) to the smallest τ whose outliers fit the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch

from qcompiler.algorithms.spqr import SpQRResult, check_spqr_spec, spqr_quantize
from qcompiler.errors import QuantizationError
from qcompiler.ir.graph import LinearLayer
from qcompiler.layouts import ExpertsFormat, LayerQuant, LayerRewrite, check_packable, stored_bits
from qcompiler.layouts.spqr import SPQR, pack_spqr, top_outlier_columns
from qcompiler.pipeline.pass_base import GraphProperty
from qcompiler.pipeline.shared_factors import shared_hessian_factor
from qcompiler.pipeline.weight_quantizer import WeightQuantizer

__all__ = ["SpQR"]


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
    true_sequential: bool = field(default=True, kw_only=True)  # SpQR's default: groups calibrated in turn

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
            factor=shared_hessian_factor(H, self.damp, self.act_order),
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
        return None if self.outlier_fraction is not None else math.lcm(SPQR.row_unit, self.stat_group_size)

    def quantize_row_range(self, layer: LinearLayer, W: torch.Tensor, H: torch.Tensor, start: int, stop: int):
        """Rows ``[start, stop)``, with the whole layer's outlier threshold."""
        return self.quantize_layer(layer, W[start:stop], H, whole=W)

    def quantize_rows(self, layer: LinearLayer, W: torch.Tensor, H: torch.Tensor, rows: torch.Tensor):
        """Rows ``rows`` (whole statistic groups), with the whole layer's outlier threshold."""
        return self.quantize_layer(layer, W.index_select(0, rows), H, whole=W)

    def quantize_layer(
        self, layer: LinearLayer, W: torch.Tensor, H: torch.Tensor, whole: Optional[torch.Tensor] = None
    ) -> LayerQuant:
        """SpQR on one layer: dense low-bit codes with bi-level statistics plus fp16 outliers.
        ``whole``: the layer's weight when ``W`` is a range of its rows (``quantize_row_range``)."""
        self.check_shape(layer, W)
        if self.outlier_fraction is None:
            res, tau = self._quantize(W, H, self.outlier_threshold, whole), self.outlier_threshold
        else:
            res, tau = self._within_budget(W, H)
        return self.layer_quant(W, res, tau)

    def check_shape(self, layer: LinearLayer, W: torch.Tensor) -> None:
        """Refuse a layer the SpQR layout cannot hold, naming it."""
        check_packable(layer, W, self.bits)
        if W.shape[1] < self.group_size or W.shape[0] < self.stat_group_size:
            raise QuantizationError(
                f"layer {layer.path} ({W.shape[0]}x{W.shape[1]}) is narrower than one "
                f"group ({self.group_size} columns, {self.stat_group_size} rows)"
            )

    def layer_quant(self, W: torch.Tensor, res: SpQRResult, tau: float) -> LayerQuant:
        """The stored tensors, figures and rewrite of one solved layer (or rows of one)."""
        tensors = pack_spqr(res, self.bits, self.stat_bits)
        figures = {
            "bits": self.bits,
            "bits_per_weight": stored_bits(tensors) / W.numel(),
            "outlier_fraction": res.outliers.float().mean().item(),
            "tau": tau,
            "top_outlier_columns": top_outlier_columns(res.outliers.sum(0)),
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
        return LayerQuant(res.dequantized, figures, tensors, LayerRewrite(SPQR.name, constants))

    def _no_tokens(self, layer: LinearLayer, W: torch.Tensor, H: None) -> LayerQuant:
        return self.quantize_layer(layer, W, torch.eye(W.shape[1], device=W.device))

    def experts_format(self) -> ExpertsFormat:
        """Experts stacked by the SpQR layout (``qc.spqr_experts_linear``); an expert without tokens gets
        an identity Hessian."""
        return ExpertsFormat(self._no_tokens, "SpQR on an identity Hessian")
