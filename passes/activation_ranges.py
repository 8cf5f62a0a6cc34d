"""The range of each quantized linear's input over the calibration data: ``max|x|`` at the node,
in the graph as it stands (earlier layers' weights already quantized — the inputs a served model
feeds it), over real tokens only (a padded position's activations are never served).

Static activation scales are made from it: FP8's ``input_scale = max|x| / 448``, NVFP4's
``input_global_scale = 448 · 6 / max|x|``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from qcompiler.errors import QuantizationError
from qcompiler.ir.op_registry import args_of
from qcompiler.pipeline.pass_base import PassContext
from qcompiler.pipeline.sensitivity import StoredWeights, first_output

__all__ = ["input_ranges"]


class _InputAmax(StoredWeights):
    """The whole graph, recording ``max|x|`` of the input ``x`` of each ``qc`` node in ``nodes``."""

    def __init__(self, gm: GraphModule, nodes: list[Node]):
        super().__init__(gm)
        self.watched = {n.name: args_of(n).x for n in nodes}  # each node's input
        self.amax: dict[str, float] = {}
        self.mask: Optional[torch.Tensor] = None  # [batch, tokens]: 1 for a real token
        self.device = torch.device("cpu")  # where the inputs were: the scales go there (weights may be on disk)

    def run_node(self, n: Node):
        if n.name in self.watched:
            x = self.env[self.watched[n.name]].detach()
            self.device = x.device
            if self.mask is not None and x.dim() >= 3 and tuple(x.shape[:2]) == tuple(self.mask.shape):
                x = x[self.mask.bool()]
            if x.numel():
                self.amax[n.name] = max(self.amax.get(n.name, 0.0), float(x.abs().amax()))
        return super().run_node(n)


def input_ranges(
    gm: GraphModule, ctx: PassContext, nodes: list[Node], who: str
) -> tuple[dict[str, float], torch.device]:
    """``{node name: max|x|}`` over ``ctx.calibration`` for each node of ``nodes``, and the device the
    inputs were on (``who``: the pass, for its progress lines and its one-line error when a node
    never saw a real token or saw a non-finite value)."""
    runner = _InputAmax(gm, nodes)
    with torch.no_grad():
        for i, batch in enumerate(ctx.calibration):
            runner.mask = batch[1].get("attention_mask")
            first_output(runner, batch)
            ctx.log(f"{who}: calibration batch {i + 1}/{len(ctx.calibration)}")
    for node in nodes:
        amax = runner.amax.get(node.name)
        if amax is None or not math.isfinite(amax):
            raise QuantizationError(f"{who}: node {node.name}'s input range over the calibration data is {amax}")
    return runner.amax, runner.device
