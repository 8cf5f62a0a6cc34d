"""FP8 activations for FP8 weights: W8A8 in the form Hopper and Blackwell GPUs run — each
``qc.fp8_linear`` rounds its input to e4m3 at run time with a dynamic scale per token (compressed-
tensors' FP8-dynamic scheme), per token and 128 inputs (its FP8-block scheme, DeepSeek-V3's), or
with one static scale per tensor calibrated as ``max|x| / 448`` (its FP8 scheme: no reduction over
the token at run time, the form TensorRT-LLM and vLLM's static FP8 kernels take).

It runs after a weight pass on an FP8 grid (``RTN(grid="fp8")``, ``GPTQ(grid="fp8-block")``) and
changes only the nodes' activation setting; a graph with no FP8 linear is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.fx import GraphModule

from qcompiler.errors import QuantizationError
from qcompiler.ir.node_swap import with_arguments
from qcompiler.ir.op_registry import args_of, quantized_layer_path, spec_of
from qcompiler.ir.tensors import drop_attr_if_unused, set_tensor
from qcompiler.layouts.fp8 import ACTIVATION_GROUP, FP8_ACTIVATIONS
from qcompiler.passes.activation_ranges import input_ranges
from qcompiler.pipeline.pass_base import GraphProperty, Pass, PassContext

__all__ = ["FP8Activations"]


@dataclass(frozen=True)
class FP8Activations(Pass):
    """Sets every ``qc.fp8_linear``'s activations to FP8: dynamic (``"token"``, ``"group"``) or
    calibrated (``"static"``)."""

    strategy: str = "token"  # "token": a scale per token; "group": per token and 128 inputs; "static"

    requires: ClassVar = frozenset({GraphProperty.QUANTIZED_WEIGHTS})
    provides: ClassVar = frozenset({GraphProperty.FP8_ACTIVATIONS})

    def __post_init__(self):
        if self.strategy not in FP8_ACTIVATIONS[1:]:
            raise QuantizationError(f"strategy must be one of {FP8_ACTIVATIONS[1:]}, got {self.strategy!r}")

    @property
    def needs_calibration(self) -> bool:
        """A static scale comes from calibration data; dynamic ones need none."""
        return self.strategy == "static"

    def run(self, gm: GraphModule, ctx: PassContext) -> bool:
        """Set the activations of each FP8 linear; refuse a graph that has none."""
        nodes = [n for n in gm.graph.nodes if (s := spec_of(n)) is not None and s.name == "fp8_linear"]
        if not nodes:
            raise QuantizationError(
                "FP8Activations found no FP8 linear (qc.fp8_linear) to quantize the inputs of: run a weight pass "
                "on an FP8 grid first, e.g. RTN(bits=8, group_size=-1, grid='fp8')"
            )
        ranges, device = input_ranges(gm, ctx, nodes, "FP8Activations") if self.strategy == "static" else ({}, None)
        for node in nodes:
            a = args_of(node)
            path = quantized_layer_path(a)
            width = a.stored_like(gm, "weight_fp8").shape[1]
            if self.strategy == "group" and width % ACTIVATION_GROUP:
                raise QuantizationError(
                    f"layer {path}: in_features={width} is not a multiple of "
                    f"{ACTIVATION_GROUP}, which FP8 group activations need; use strategy='token'"
                )
            input_scale = None
            if self.strategy == "static":
                scale = torch.tensor([max(ranges[node.name], 1e-12) / 448.0], dtype=torch.float32, device=device)
                set_tensor(gm, f"{path}.input_scale", scale)
                ctx.record.layers.setdefault(path, {})["input_scale"] = scale.item()
                input_scale = a.input_scale  # a second run re-calibrates the same tensor
                if input_scale is None:
                    with gm.graph.inserting_before(node):
                        input_scale = gm.graph.get_attr(f"{path}.input_scale")
            with_arguments(gm, node, activations=self.strategy, input_scale=input_scale)
            if a.input_scale is not None and a.input_scale is not input_scale:
                drop_attr_if_unused(gm, a.input_scale)
        how = "a calibrated static scale per tensor" if self.strategy == "static" else f"dynamic per {self.strategy}"
        ctx.log(f"FP8Activations: {len(nodes)} FP8 linears take FP8 inputs, {how}")
        ctx.record.notes.append(f"{len(nodes)} FP8 linears: activations e4m3, {how}")
        return True
