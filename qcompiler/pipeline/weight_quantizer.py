"""``WeightQuantizer``: the base of every pass that rewrites linear weights layer by layer (RTN,
GPTQ, SpQR, and yours).

A subclass is a frozen dataclass that implements :meth:`quantize_layer` — one fp32 weight, and the
Hessian of its inputs when calibrating, to a :class:`LayerQuant` — and inherits the rest: the
block-sequential walk over calibration data (``block_walk.py``), the ``ignore`` filter, the output
head (:meth:`head_quantizer`), mixture-of-experts weights (:meth:`experts_format`), per-block
hooks (:meth:`before_block` / :meth:`after_block`: where a scaling search such as AWQ's runs, with
the block's inputs at hand), the report, and the contract (it provides ``QUANTIZED_WEIGHTS``).
Every weight quantizer takes the base's keyword-only fields — ``ignore``, ``true_sequential``,
``lm_head`` — which the walk reads; keyword-only, so a subclass's own fields keep their positions
(``GPTQ(3, 64)`` is bits and group size). A subclass may redeclare one with another default (SpQR
calibrates sequentially by default), as ``field(default=..., kw_only=True)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, ClassVar, Optional

import torch
from torch.fx import GraphModule

from qcompiler.errors import QuantizationError
from qcompiler.ir.graph import LinearLayer
from qcompiler.layouts import ExpertsFormat, LayerQuant, QuantizeFn
from qcompiler.pipeline.block_walk import quantize_block_linears
from qcompiler.pipeline.layer_filter import check_patterns
from qcompiler.pipeline.pass_base import GraphProperty, Pass, PassContext

if TYPE_CHECKING:
    from qcompiler.calib.calibration import CalibrationEngine, Segment

__all__ = ["WeightQuantizer"]

_BASE_FIELDS = ("ignore", "true_sequential", "lm_head")  # keyword-only: a subclass's own fields keep their positions


@dataclass(frozen=True)
class WeightQuantizer(Pass):
    """Quantizes each linear inside a transformer block with :meth:`quantize_layer`."""

    provides: ClassVar = frozenset({GraphProperty.QUANTIZED_WEIGHTS})
    noop_after: ClassVar = frozenset({GraphProperty.QUANTIZED_WEIGHTS, GraphProperty.INT8_LOWERED})
    needs_hessian: ClassVar[bool] = False  # True: quantize_layer needs H (calibration required)

    # module paths kept in full precision: globs, or 're:' + a regex
    ignore: tuple[str, ...] = field(default=(), kw_only=True)
    # q/k/v, o, gate/up, down calibrated in turn, their inputs re-run between
    true_sequential: bool = field(default=False, kw_only=True)
    # also the output head (it has no block Hessian: head_quantizer says how)
    lm_head: bool = field(default=False, kw_only=True)

    def __post_init__(self):
        plain = [f.name for f in fields(self) if f.name in _BASE_FIELDS and not f.kw_only]
        if plain:
            raise TypeError(
                f"{self.name} redeclares {plain[0]!r} as a positional field (it would come first): "
                f"drop it or declare it as field(default=..., kw_only=True)"
            )
        object.__setattr__(self, "ignore", check_patterns(self.name, self.ignore))
        if self.lm_head and type(self).head_quantizer is WeightQuantizer.head_quantizer:
            raise QuantizationError(
                f"{self.name} does not quantize the output head: lm_head=True is not supported here"
            )

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

    def run(self, gm: GraphModule, ctx: PassContext) -> bool:
        """The block-by-block walk (``block_walk.quantize_block_linears``) with this quantizer."""
        return quantize_block_linears(gm, ctx, self)
