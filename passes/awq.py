"""AWQ (Lin et al., MLSys 2024) as a graph pass: activation-aware scales folded in, exactly.

Per producer group (the linears that read one tensor: q/k/v, gate/up, ...), the scales
``s = a^α`` of ``qcompiler.algorithms.awq`` with ``α`` searched for the least quantized output
error at ``bits`` / ``group_size``; ``diag(s)`` is folded into the consumers' weight columns and
``diag(s)⁻¹`` into the producer — the same places SmoothQuant uses (a norm, a previous linear, or an
explicit per-channel multiply: ``qcompiler/pipeline/smoothing_plan.py``). The FP model's output is
unchanged; a weight pass after it (RTN, GPTQ, ...) quantizes the scaled weights: recipes
``awq-w4g128`` (AWQ + RTN) and ``awq-gptq-w4g128`` (AWQ + GPTQ); on the floating-point formats
(``grid="nvfp4"`` / ``"mxfp4"``) ``awq-nvfp4``, ``awq-gptq-nvfp4``, ``awq-mxfp4``, ``awq-gptq-mxfp4``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch.fx import GraphModule

from qcompiler.algorithms.awq import AWQ_ALPHAS, search_awq_scales
from qcompiler.algorithms.gptq import check_spec
from qcompiler.calib.calibration import CalibrationEngine
from qcompiler.errors import QuantizationError
from qcompiler.ir.graph import LinearLayer, find_linears, is_router
from qcompiler.pipeline.folding import fold_channel_scales, insert_pending_multiplies
from qcompiler.pipeline.layer_filter import check_patterns, report_unmatched
from qcompiler.pipeline.pass_base import GraphProperty, Pass, PassContext
from qcompiler.pipeline.smoothing_plan import SmoothingPlan, plan_smoothing

__all__ = ["AWQ"]


@dataclass(frozen=True)
class AWQ(Pass):
    """Folds activation-aware weight scales into producers and consumer linears (outputs unchanged)."""

    bits: int = 4  # the width the scales are searched for (the weight pass after it should match)
    group_size: int = 128
    explicit: bool = True  # allow an explicit x·(1/s) node where no producer can absorb it (post-LN models)
    ignore: tuple[str, ...] = ()  # module paths left unscaled: globs, or 're:' + a regex
    # the grid the scales are searched for: an integer one ("minmax", ...) or a float format ("nvfp4", ...)
    grid: str = "minmax"

    requires: ClassVar = frozenset()
    provides: ClassVar = frozenset({GraphProperty.SMOOTHED})
    noop_after: ClassVar = frozenset({GraphProperty.QUANTIZED_WEIGHTS, GraphProperty.INT8_LOWERED})
    needs_calibration: ClassVar = True

    def __post_init__(self):
        object.__setattr__(self, "ignore", check_patterns(self.name, self.ignore))
        check_spec(self.bits, self.group_size, self.grid, float_grids=True)

    def run(self, gm: GraphModule, ctx: PassContext) -> bool:
        """Search and fold each producer group's scales, block by block on calibration data."""
        if ctx.calibration is None:
            raise QuantizationError("AWQ: calibration data is required (the scales come from activation magnitudes)")
        all_layers = find_linears(gm)
        engine = CalibrationEngine.for_pass(gm, ctx)
        pending: list = []
        changed = False
        for seg in engine.blocks():
            plans = [(group, self._plan(group, all_layers)) for group in seg.sibling_groups() if group]
            active = [layer for group, plan in plans if plan.form != "none" for layer in group]
            stats = engine.collect(seg, active) if active else {}
            for group, plan in plans:
                if plan.form == "none":
                    ctx.record.notes.append(f"not scaled: {', '.join(layer.path for layer in group)}: {plan.reason}")
                    continue
                changed |= self._apply(gm, group, plan, stats[group[0].path].hessian, ctx, pending)
        insert_pending_multiplies(gm, pending)
        report_unmatched(self.name, self.ignore, [layer.path for layer in all_layers], ctx.record.notes)
        if not changed:
            ctx.record.notes.append("no producer group was scaled; the graph is unchanged")
        return changed

    def _plan(self, group: list[LinearLayer], all_layers: list[LinearLayer]) -> SmoothingPlan:
        if all(is_router(layer.path) for layer in group):  # scaling it would only add a multiply
            return SmoothingPlan("none", reason="a mixture-of-experts router, which no weight quantizer quantizes")
        plan = plan_smoothing(group, all_layers, self.ignore)
        if plan.form == "explicit" and not self.explicit:
            return SmoothingPlan("none", reason=f"{plan.reason} (explicit multiplies are off)")
        return plan

    def _apply(self, gm, group, plan: SmoothingPlan, H, ctx: PassContext, pending: list) -> bool:
        stored = [layer.weight(gm) for layer in group]
        home = stored[0].device
        weights = [w.detach().float().to(H.device) for w in stored]
        s, alpha, err, plain = search_awq_scales(weights, H, self.bits, self.group_size, AWQ_ALPHAS, self.grid)
        label = plan.label or group[0].path
        ctx.record.layers[label] = {
            "form": plan.form,
            "consumers": ",".join(layer.path.rsplit(".", 1)[-1] for layer in group),
            "alpha": alpha,
            "rtn_error": plain,
            "scaled_rtn_error": err,
        }
        if alpha == 0:
            return False  # no scaling helps this group: leave its producer as it is
        fold_channel_scales(gm, group, plan, s.to(home), pending)
        ctx.log(f"  {label}: AWQ alpha {alpha:g}, RTN error {plain:.4g} -> {err:.4g}")
        return True
