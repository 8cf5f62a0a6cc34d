"""SmoothQuant scale folding (Xiao et al., ICML 2023) as an exact graph rewrite.

Per producer group (the linears that read one tensor): ``s_j = max|X_j|^α / max|W_j|^(1−α)`` from
calibration maxima and the group's weights; ``diag(s)`` is folded into every consumer's weight
columns and ``diag(s)^-1`` into the producer (norm weight/bias, or a linear's output rows), or,
where the producer cannot absorb it, into an explicit per-channel multiply that int8 lowering
fuses into activation quantization. The FP model's outputs do not change. See
``qcompiler.pipeline.smoothing_plan`` for which form each group gets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Union

import torch
from torch.fx import GraphModule

from qcompiler.algorithms.smoothquant import ALPHA_GRID, search_alpha, smoothing_scales
from qcompiler.calib.calibration import CalibrationEngine
from qcompiler.errors import QuantizationError
from qcompiler.ir.graph import LinearLayer, find_linears
from qcompiler.pipeline.folding import fold_channel_scales, insert_pending_multiplies
from qcompiler.pipeline.layer_filter import check_patterns, report_unmatched
from qcompiler.pipeline.pass_base import GraphProperty, Pass, PassContext
from qcompiler.pipeline.smoothing_plan import SmoothingPlan, plan_smoothing

__all__ = ["SmoothQuant"]


@dataclass(frozen=True)
class SmoothQuant(Pass):
    """Folds per-channel smoothing scales into producers and consumer linears (outputs unchanged)."""

    alpha: Union[float, str] = 0.5  # migration strength in [0, 1], or "auto" (per-group search)
    sample_rows: int = 512  # calibration rows kept per group for the "auto" search
    ignore: tuple[str, ...] = ()  # module paths kept in full precision: globs, or 're:' + a regex

    requires: ClassVar = frozenset()
    provides: ClassVar = frozenset({GraphProperty.SMOOTHED})
    noop_after: ClassVar = frozenset({GraphProperty.QUANTIZED_WEIGHTS, GraphProperty.INT8_LOWERED})
    needs_calibration: ClassVar = True

    def __post_init__(self):
        object.__setattr__(self, "ignore", check_patterns(self.name, self.ignore))
        if self.alpha != "auto" and not (isinstance(self.alpha, (int, float)) and 0.0 <= self.alpha <= 1.0):
            raise QuantizationError(f"alpha must be in [0, 1] or 'auto', got {self.alpha!r}")

    def run(self, gm: GraphModule, ctx: PassContext) -> bool:
        """Fold per-channel smoothing scales into each producer group's norm or previous linear."""
        record = ctx.record
        all_layers = find_linears(gm)
        engine = CalibrationEngine.for_pass(gm, ctx)
        changed = False
        pending: list = []  # explicit multiplies go in after calibration (the engine walks a fixed node list)
        for seg in engine.blocks():
            groups = seg.sibling_groups()
            if not groups:
                continue
            plans = [(group, plan_smoothing(group, all_layers, self.ignore)) for group in groups]
            active = [layer for group, plan in plans if plan.form != "none" for layer in group]
            stats = (
                engine.collect(seg, active, hessian=False, keep_rows=self.sample_rows if self.alpha == "auto" else 0)
                if active
                else {}
            )
            for group, plan in plans:
                if plan.form == "none":
                    record.notes.append(f"not smoothed: {', '.join(layer.path for layer in group)}: {plan.reason}")
                    continue
                self._apply(gm, group, plan, stats[group[0].path], record, pending)
                changed = True
        insert_pending_multiplies(gm, pending)
        report_unmatched(self.name, self.ignore, [layer.path for layer in all_layers], record.notes)
        if not changed:
            record.notes.append("no producer group could be smoothed; the graph is unchanged")
        return changed

    def _apply(self, gm: GraphModule, group: list[LinearLayer], plan: SmoothingPlan, st, record, pending: list) -> None:
        act = st.absmax  # on the compute device; the scales found go back to where the weights live
        stored = [layer.weight(gm) for layer in group]  # one read each (a streamed weight comes from disk)
        home = stored[0].device
        weights = [w.detach().float().to(act.device) for w in stored]
        if self.alpha == "auto":
            alpha, err = search_alpha(st.sample, weights, act, ALPHA_GRID)
        else:
            alpha, err = float(self.alpha), None
        wmax = torch.stack([W.abs().amax(dim=0) for W in weights]).amax(dim=0)
        s = smoothing_scales(act, wmax, alpha).to(home)
        fold_channel_scales(gm, group, plan, s, pending)
        figures = {
            "form": plan.form,
            "consumers": ",".join(layer.path.rsplit(".", 1)[-1] for layer in group),
            "alpha": alpha,
            "act_absmax": float(act.max()),
            "s_min": float(s.min()),
            "s_max": float(s.max()),
        }
        if err is not None:
            figures["int8_error"] = err
        # per channel, for `qcompiler report`'s before/after plot (lists stay out of the text report)
        figures["channel_absmax"] = [float(f"{v:.4g}") for v in act.tolist()]
        figures["channel_scale"] = [float(f"{v:.4g}") for v in s.tolist()]
        record.layers[plan.label] = figures
