"""FP8 activations for FP8 weights: W8A8 in the form Hopper and Blackwell GPUs run — each
``qc.fp8_linear`` rounds its input to e4m3 at run time with a dynamic scale per token (compressed-
tensors' FP8-dynamic scheme) or per token and 128 inputs (its FP8-block scheme, DeepSeek-V3's).

It runs after a weight pass on an FP8 grid (``RTN(grid="fp8")``, ``GPTQ(grid="fp8-block")``) and
changes only the nodes' activation setting; a graph with no FP8 linear is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch.fx import GraphModule

from qcompiler.errors import QuantizationError
from qcompiler.ir.op_registry import args_of, call_op, quantized_layer_path, spec_of
from qcompiler.layouts.fp8 import ACTIVATION_GROUP, FP8_ACTIVATIONS
from qcompiler.pipeline.pass_base import GraphProperty, Pass, PassContext

__all__ = ["FP8Activations"]


@dataclass(frozen=True)
class FP8Activations(Pass):
    """Sets every ``qc.fp8_linear``'s activations to dynamic FP8 (``"token"`` or ``"group"``)."""

    strategy: str = "token"  # "token": a scale per token; "group": per token and 128 inputs

    requires: ClassVar = frozenset({GraphProperty.QUANTIZED_WEIGHTS})
    provides: ClassVar = frozenset({GraphProperty.FP8_ACTIVATIONS})

    def __post_init__(self):
        if self.strategy not in FP8_ACTIVATIONS[1:]:
            raise QuantizationError(f"strategy must be one of {FP8_ACTIVATIONS[1:]}, got {self.strategy!r}")

    def run(self, gm: GraphModule, ctx: PassContext) -> bool:
        """Set the activations of each FP8 linear; refuse a graph that has none."""
        nodes = [n for n in gm.graph.nodes if (s := spec_of(n)) is not None and s.name == "fp8_linear"]
        if not nodes:
            raise QuantizationError(
                "FP8Activations found no FP8 linear (qc.fp8_linear) to quantize the inputs of: run a weight pass "
                "on an FP8 grid first, e.g. RTN(bits=8, group_size=-1, grid='fp8')"
            )
        for node in nodes:
            a = args_of(node)
            width = a.tensor(gm, "weight_fp8").shape[1]
            if self.strategy == "group" and width % ACTIVATION_GROUP:
                raise QuantizationError(
                    f"layer {quantized_layer_path(a)}: in_features={width} is not a multiple of "
                    f"{ACTIVATION_GROUP}, which FP8 group activations need; use strategy='token'"
                )
            with gm.graph.inserting_before(node):
                new = call_op(gm.graph, "fp8_linear", **{**a.as_dict(), "activations": self.strategy})
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
        ctx.log(f"FP8Activations: {len(nodes)} FP8 linears take dynamic FP8 inputs per {self.strategy}")
        ctx.record.notes.append(f"{len(nodes)} FP8 linears: activations dynamic e4m3 per {self.strategy}")
        return True
