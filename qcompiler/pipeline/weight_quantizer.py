"""``WeightQuantizer``: the base of every pass that rewrites linear weights layer by layer (RTN,
GPTQ, SpQR, and yours).

A subclass is a frozen dataclass that implements :meth:`quantize_layer` — one fp32 weight, and the
Hessian of its inputs when calibrating, to a :class:`LayerQuant` — and inherits the rest: the
block-sequential walk over calibration data (``block_walk.py``), the ``ignore`` filter, the output
head (:meth:`head_quantizer`), mixture-of-experts weights (:meth:`experts_format`), per-block
hooks (:meth:`before_block` / :meth:`after_block`: where a scaling search such as AWQ's runs, with
the block's inputs at hand), the report, and the contract (it provides ``QUANTIZED_WEIGHTS``).
Fields a subclass may declare and the base reads: ``ignore``, ``true_sequential``, ``lm_head``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional

import torch
from torch.fx import GraphModule

from qcompiler.ir.graph import LinearLayer
from qcompiler.layouts import ExpertsFormat, LayerQuant, QuantizeFn
from qcompiler.pipeline.block_walk import quantize_block_linears
from qcompiler.pipeline.layer_filter import check_patterns
from qcompiler.pipeline.pass_base import GraphProperty, Pass, PassContext

if TYPE_CHECKING:
    from qcompiler.calib.calibration import CalibrationEngine, Segment

__all__ = ["WeightQuantizer"]


@dataclass(frozen=True)
class WeightQuantizer(Pass):
    """Quantizes each linear inside a transformer block with :meth:`quantize_layer`."""

    provides: ClassVar = frozenset({GraphProperty.QUANTIZED_WEIGHTS})
    noop_after: ClassVar = frozenset({GraphProperty.QUANTIZED_WEIGHTS, GraphProperty.INT8_LOWERED})
    needs_hessian: ClassVar[bool] = False  # True: quantize_layer needs H (calibration required)

    def __post_init__(self):
        if hasattr(self, "ignore"):
            object.__setattr__(self, "ignore", check_patterns(self.name, self.ignore))

    def quantize_layer(self, layer: LinearLayer, W: torch.Tensor, H: Optional[torch.Tensor]) -> LayerQuant:
        """The method itself: ``W`` [out, in] fp32 on the compute device, ``H`` [in, in] or None."""
        raise NotImplementedError(f"{self.name} does not implement quantize_layer()")

    def row_split_unit(self, layer: LinearLayer) -> Optional[int]:
        """A multiple of rows this method solves ``layer``'s rows in apart, with the same result as
        the whole layer's (``quantize_row_range``), or None: whole layers only. A run over several
        ranks splits a big layer's rows across ranks where a rank would otherwise wait."""
        return None

    def quantize_row_range(
        self, layer: LinearLayer, W: torch.Tensor, H: Optional[torch.Tensor], start: int, stop: int
    ) -> LayerQuant:
        """Rows ``[start, stop)`` of ``quantize_layer(layer, W, H)``: by default the method on those
        rows alone (right for methods whose rows are independent given ``H``, as GPTQ's are)."""
        return self.quantize_layer(layer, W[start:stop], H)

    def quantize_rows(
        self, layer: LinearLayer, W: torch.Tensor, H: Optional[torch.Tensor], rows: torch.Tensor
    ) -> LayerQuant:
        """Rows ``rows`` (whole ``row_split_unit``s, ascending) of ``quantize_layer(layer, W, H)``: the
        rows ``auto:B`` scores a candidate on (pipeline/sensitivity.py). By default the method on those
        rows alone, as ``quantize_row_range``."""
        return self.quantize_layer(layer, W.index_select(0, rows), H)

    def head_quantizer(self) -> Optional[QuantizeFn]:
        """How the output head is quantized (it has no block Hessian), or None to keep it FP."""
        return None

    def experts_format(self) -> Optional[ExpertsFormat]:
        """How mixture-of-experts weights are stored, or None to keep them FP (with a note)."""
        return None

    def before_block(self, gm: GraphModule, block: "Segment", engine: "CalibrationEngine", ctx: PassContext) -> None:
        """Called with calibration data before a block's layers are solved; ``engine.collect(block,
        layers)`` gives their input statistics, and weights set here are what the solve sees."""

    def after_block(self, gm: GraphModule, block: "Segment", ctx: PassContext) -> None:
        """Called once a block's layers are solved (their dequantized weights are in the graph)."""

    @property
    def replayable(self) -> bool:
        """Whether a block's recorded results are all a resumed run needs (no per-block hooks of its own)."""
        cls = type(self)
        return cls.before_block is WeightQuantizer.before_block and cls.after_block is WeightQuantizer.after_block

    @property
    def ignored(self) -> tuple[str, ...]:
        """Module-path patterns kept in full precision (the ``ignore`` field, if the pass has one)."""
        return getattr(self, "ignore", ())

    @property
    def sequential_groups(self) -> bool:
        """Calibrate q/k/v, o, gate/up, down one group at a time (the ``true_sequential`` field)."""
        return bool(getattr(self, "true_sequential", False))

    def run(self, gm: GraphModule, ctx: PassContext) -> bool:
        """The block-by-block walk (``block_walk.quantize_block_linears``) with this quantizer."""
        return quantize_block_linears(gm, ctx, self)
