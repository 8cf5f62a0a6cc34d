"""NVFP4 activations for NVFP4 weights: W4A4, the form Blackwell's FP4 tensor cores multiply —
each ``qc.nvfp4_linear`` rounds its input to e2m1 at run time with an e4m3 scale per token and 16
inputs, in units of one calibrated fp32 global scale per tensor (``448 · 6 / max|x|`` over the
calibration data: compressed-tensors' NVFP4 scheme, llm-compressor's and ModelOpt's NVFP4 W4A4).

It runs after a weight pass on the NVFP4 grid (``RTN`` / ``GPTQ(grid="nvfp4")``, rotated or not);
a graph with no NVFP4 linear is refused by name. Layers reading one input (q/k/v, gate/up) see
the same activations, so they get one global scale — the one vLLM keeps when it fuses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.fx import GraphModule

from qcompiler.errors import QuantizationError
from qcompiler.ir.node_swap import with_arguments
from qcompiler.ir.op_registry import args_of, quantized_layer_path, spec_of
from qcompiler.ir.tensors import set_tensor
from qcompiler.passes.activation_ranges import input_ranges
from qcompiler.pipeline.pass_base import GraphProperty, Pass, PassContext

__all__ = ["NVFP4Activations"]


@dataclass(frozen=True)
class NVFP4Activations(Pass):
    """Sets every ``qc.nvfp4_linear``'s inputs to NVFP4 with a calibrated global scale."""

    needs_calibration: ClassVar = True
    requires: ClassVar = frozenset({GraphProperty.QUANTIZED_WEIGHTS})
    provides: ClassVar = frozenset({GraphProperty.FP4_ACTIVATIONS})

    def run(self, gm: GraphModule, ctx: PassContext) -> bool:
        """Calibrate each NVFP4 linear's input range, then give it an ``input_global_scale``."""
        nodes = [n for n in gm.graph.nodes if (s := spec_of(n)) is not None and s.name == "nvfp4_linear"]
        if not nodes:
            raise QuantizationError(
                "NVFP4Activations found no NVFP4 linear (qc.nvfp4_linear) to quantize the inputs of: run a weight "
                "pass on the NVFP4 grid first, e.g. GPTQ(bits=4, group_size=16, grid='nvfp4')"
            )
        ranges, device = input_ranges(gm, ctx, nodes, "NVFP4Activations")
        for node in nodes:
            a = args_of(node)
            path = quantized_layer_path(a)
            amax = max(ranges[node.name], torch.finfo(torch.float32).tiny)
            g = torch.tensor([448.0 * 6.0 / amax], dtype=torch.float32, device=device)
            if not torch.isfinite(g).all():  # inputs below 2^-118 everywhere: any scale rounds them alike
                g = torch.ones_like(g)
            set_tensor(gm, f"{path}.input_global_scale", g)
            ctx.record.layers.setdefault(path, {})["input_global_scale"] = g.item()
            if a.input_global_scale is not None:  # a second run re-calibrates the same tensor
                continue
            with gm.graph.inserting_before(node):
                attr = gm.graph.get_attr(f"{path}.input_global_scale")
            with_arguments(gm, node, input_global_scale=attr)
        ctx.log(f"NVFP4Activations: {len(nodes)} NVFP4 linears take NVFP4 inputs (W4A4)")
        ctx.record.notes.append(f"{len(nodes)} NVFP4 linears: activations e2m1, e4m3 scales per 16, global per tensor")
        return True
