"""Runs a user's list of passes in the user's order, after checking that the list can run at all.

Before anything runs: every item is a pass made as a frozen dataclass, every requirement is met by
the start state or by an earlier pass (else a ``PipelineError`` naming the passes that could
provide it), and passes that need calibration data get some. While running: each pass runs under
its contract (``pass_contract.run_checked``: own record, ``provides`` checked afterwards), the
graph is linted after it (a broken graph is blamed on the pass that broke it), and a failure names
the passes that ran before.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch.fx import GraphModule

from qcompiler.errors import GraphLintError, PassError, PipelineError
from qcompiler.ir.tensors import get_tensor
from qcompiler.pipeline.pass_base import GraphProperty, Pass, PassContext
from qcompiler.pipeline.pass_contract import PostconditionError, check_pass, properties_of, run_checked
from qcompiler.pipeline.pass_registry import registered_passes
from qcompiler.pipeline.report import Report

__all__ = ["PassManager", "PipelineResult"]


class PipelineResult(NamedTuple):
    """The graph the last pass left (passes may return a new one) and what every pass did."""

    graph_module: GraphModule
    report: Report


class PassManager:
    """Validates, then runs, an ordered list of passes."""

    def __init__(self, passes: Sequence[Pass]):
        self.passes = [check_pass(p, f"pipeline item #{i + 1}") for i, p in enumerate(passes)]

    def validate(
        self, *, has_calibration: bool, initial: frozenset[GraphProperty] = frozenset({GraphProperty.CAPTURED})
    ) -> None:
        """Check the whole list before anything runs: requirements, no-op orders, calibration data."""
        have = set(initial)
        for i, p in enumerate(self.passes):
            missing = [r for r in p.requires if r not in have]
            if missing:
                prop = missing[0]
                providers = sorted({c.__name__ for c in registered_passes().values() if prop in c.provides})
                fix = f"add {' or '.join(providers)} before it" if providers else "no known pass provides it"
                raise PipelineError(
                    f"pass #{i + 1} {p.name} requires {prop.name}, which no earlier pass "
                    f"in the pipeline provides; {fix}"
                )
            done = [prop for prop in p.noop_after if prop in have]
            if done:
                earlier = next((q.name for q in self.passes[:i] if done[0] in q.provides), "an earlier pass")
                raise PipelineError(
                    f"pass #{i + 1} {p.name} would change nothing: "
                    f"{earlier} already made the graph "
                    f"{done[0].name} (it rewrites the linear layers {p.name} works on); "
                    f"remove one of them or reorder"
                )
            if p.needs_calibration and not has_calibration:
                raise PipelineError(
                    f"pass #{i + 1} {p.name} needs calibration data: pass calibration=[...] "
                    f"(inputs shaped like example_inputs)"
                )
            have |= p.provides

    def run(self, gm: GraphModule, ctx: PassContext) -> PipelineResult:
        """Validate against the properties ``gm`` already has, then run every pass in order."""
        self.validate(has_calibration=bool(ctx.calibration), initial=properties_of(gm))
        report = Report()
        for i, p in enumerate(self.passes):
            ctx.log(f"pass {i + 1}/{len(self.passes)}: {p!r}")
            ctx.pass_index = i
            try:
                with torch.no_grad():
                    result = run_checked(p, gm, ctx, where=f"pass #{i + 1}")
            except PostconditionError:
                raise
            except Exception as exc:
                before = ", ".join(q.name for q in self.passes[:i]) or "none"
                raise PassError(
                    f"pass #{i + 1} {p.name} failed (passes run before it: {before}): {type(exc).__name__}: {exc}"
                ) from exc
            gm = result.graph_module
            lint_graph(gm, p.name)
            report.passes.append(result.record)
        return PipelineResult(gm, report)


def lint_graph(gm: GraphModule, pass_name: str) -> None:
    """Structural checks after a pass; recompiles the module's code."""
    try:
        gm.graph.lint()
    except Exception as exc:
        raise GraphLintError(f"pass {pass_name} left an invalid graph: {exc}") from exc
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            try:
                get_tensor(gm, node.target)
            except AttributeError:
                raise GraphLintError(
                    f"pass {pass_name} left node {node.name!r} reading attribute {node.target!r}, which does not exist"
                ) from None
        elif node.op == "call_function" and not callable(node.target):
            raise GraphLintError(f"pass {pass_name} left node {node.name!r} with a non-callable target {node.target!r}")
    if not any(n.op == "output" for n in gm.graph.nodes):
        raise GraphLintError(f"pass {pass_name} removed the graph's output node")
    gm.recompile()
