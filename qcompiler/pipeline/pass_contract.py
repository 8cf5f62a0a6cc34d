"""The pass contract, checked: a pass is a frozen dataclass, runs with a fresh record, and what it
``provides`` must hold afterwards.

Each property is witnessed by the ``qc`` ops that establish it (``OpSpec.establishes``): a pass
that claims ``QUANTIZED_WEIGHTS`` must leave more weight-quantized op nodes than it found. A
property no op witnesses (``SMOOTHED``) holds when the pass reports that it changed the graph.
The properties that hold are recorded on the graph (``gm.meta``) and saved in artifacts.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Optional

from torch.fx import GraphModule

from qcompiler.errors import PassError, PipelineError
from qcompiler.ir.op_registry import registered, spec_of
from qcompiler.pipeline.pass_base import GraphProperty, Pass, PassContext, PassRecord, PassResult

__all__ = [
    "check_pass",
    "run_checked",
    "witnesses",
    "properties_of",
    "record_properties",
    "PostconditionError",
    "PROPERTIES_META",
]

PROPERTIES_META = "qcompiler_properties"  # gm.meta key: names of the GraphProperty values that hold


class PostconditionError(PassError):
    """A pass ran but what it ``provides`` does not hold afterwards."""


def check_pass(p: object, where: str) -> Pass:
    """``p`` if it is a qc.Pass made as a frozen dataclass (its fields are its recorded settings)."""
    if not isinstance(p, Pass):
        raise PipelineError(f"{where} is {p!r} ({type(p).__name__}), not a qc.Pass instance")
    params = getattr(type(p), "__dataclass_params__", None)
    if not dataclasses.is_dataclass(p) or params is None or not params.frozen:
        raise PipelineError(
            f"{where} {p.name} is not a frozen dataclass: decorate {type(p).__name__} with "
            f"@dataclass(frozen=True) (its fields are the settings the report and artifacts record)"
        )
    return p


def witnesses(gm: GraphModule) -> collections.Counter:
    """How many nodes of ``gm`` establish each property (from the op specs)."""
    counts: collections.Counter = collections.Counter()
    for node in gm.graph.nodes:
        spec = spec_of(node)
        if spec is not None:
            counts.update(spec.establishes)
    return counts


def properties_of(gm: GraphModule) -> frozenset[GraphProperty]:
    """The properties recorded on ``gm`` (a freshly captured graph: ``CAPTURED``)."""
    names = gm.meta.get(PROPERTIES_META, [GraphProperty.CAPTURED.value])
    return frozenset(GraphProperty(n) for n in names)


def record_properties(gm: GraphModule, props) -> None:
    """Record ``props`` as the properties that hold on ``gm``."""
    gm.meta[PROPERTIES_META] = sorted(p.value for p in props)


def _problem(
    prop: GraphProperty, before: collections.Counter, after: collections.Counter, modified: bool
) -> Optional[str]:
    """Why ``prop`` does not hold after the pass (None: it does)."""
    if any(prop in spec.establishes for spec in registered().values()):
        if after[prop] <= before[prop]:
            return f"it added no node of an op that establishes it (still {before[prop]})"
        return None
    return None if modified else "it reported that it changed nothing"


def run_checked(p: Pass, gm: GraphModule, ctx: PassContext, *, where: str = "pass") -> PassResult:
    """Run ``p`` on ``gm`` with its own record; check what it provides; record the properties.
    ``where`` starts every error (the manager says ``pass #2``)."""
    check_pass(p, where)
    label = f"{where} {p.name}"
    record = PassRecord(name=p.name, config=p.config())
    held, before = properties_of(gm), witnesses(gm)
    start = time.perf_counter()
    out = p.run(gm, dataclasses.replace(ctx, record=record))
    result = out if isinstance(out, PassResult) else PassResult(gm, bool(out), record)
    result.record.modified, result.record.seconds = result.modified, time.perf_counter() - start
    after = witnesses(result.graph_module)
    for prop in sorted(p.provides, key=lambda q: q.value):
        problem = _problem(prop, before, after, result.modified)
        if problem:
            why = f" (its last note: {result.record.notes[-1]})" if result.record.notes else ""
            raise PostconditionError(f"{label} provides {prop.name}, but {problem}{why}")
    # what it provides, and what its new nodes witness (AutoBits' table: QuantizeEmbeddings' op inside it)
    gained = {prop for prop, count in after.items() if count > before[prop]}
    record_properties(result.graph_module, held | p.provides | gained)
    return result
