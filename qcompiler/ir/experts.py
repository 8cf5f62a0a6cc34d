"""Mixture-of-experts weights: 3-D expert parameters found in the graph, one matrix per expert.

transformers (5.x) stores a MoE layer's experts as 3-D parameters (``mlp.experts.gate_up_proj``
``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``) and runs them as one grouped matmul over the tokens
sorted by expert: ``grouped_mm(x_sorted, weight.transpose(-2, -1), offsets)``, where
``offsets[e]`` is the cumulative number of rows routed to experts ``0..e``. Expert ``e``'s input
rows are therefore ``x_sorted[offsets[e-1]:offsets[e]]``: its Hessian comes from exactly the tokens
the router sent it. Each expert is quantized as its own ``[out, in]`` matrix (reported as
``{path}.{e}``), and the grouped matmul becomes ``qc.quant_experts_linear``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from qcompiler.ir.ops import expert_ranges
from qcompiler.ir.tensors import get_tensor

__all__ = ["ExpertLinear", "find_expert_linears", "grouped_mm_targets", "expert_rows"]

aten = torch.ops.aten


def grouped_mm_targets() -> tuple:
    """The grouped-matmul ops a captured MoE layer uses: transformers' fallback (fp32 / CPU) and
    torch's own ``_grouped_mm`` (bf16 on GPUs)."""
    targets = [aten._grouped_mm.default] if hasattr(aten, "_grouped_mm") else []
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is not None:
        targets.append(fallback.default)
    return tuple(targets)


@dataclass
class ExpertLinear:
    """One 3-D expert parameter and the grouped matmul that reads it."""

    node: Node  # the grouped matmul: (x_sorted, weight[E, in, out], offsets)
    path: str  # the parameter's module path, e.g. "model.layers.0.mlp.experts.down_proj"
    input: Node  # the rows sorted by expert
    offsets: Node  # cumulative rows per expert [E]
    weight_node: Node  # get_attr of the stored parameter
    transposed: bool  # stored as [E, out, in] (read through a transpose) rather than [E, in, out]
    weight_user: Node  # the matmul's weight argument: the transpose, or weight_node itself

    def stored(self, gm: GraphModule) -> torch.Tensor:
        """The stored 3-D expert weight (read from disk when streamed)."""
        return get_tensor(gm, self.weight_node.target)

    def expert_weight(self, stored: torch.Tensor, e: int) -> torch.Tensor:
        """Expert ``e``'s weight as ``[out, in]``."""
        return stored[e] if self.transposed else stored[e].t()

    def expert_path(self, e: int) -> str:
        """The report name of expert ``e``: ``{path}.{e}``."""
        return f"{self.path}.{e}"

    @property
    def num_experts(self) -> int:
        """How many experts the parameter stacks."""
        return self.weight_node.meta["val"].shape[0]

    @property
    def in_features(self) -> int:
        """Input width of one expert matrix."""
        shape = self.weight_node.meta["val"].shape
        return shape[2] if self.transposed else shape[1]

    @property
    def out_features(self) -> int:
        """Output width of one expert matrix."""
        shape = self.weight_node.meta["val"].shape
        return shape[1] if self.transposed else shape[2]


def _is_attr(node) -> bool:
    return isinstance(node, Node) and node.op == "get_attr"


def find_expert_linears(gm: GraphModule) -> list[ExpertLinear]:
    """Every grouped matmul whose weight is a stored 3-D tensor (directly, or through one
    ``transpose(-2, -1)``), in graph order."""
    targets = grouped_mm_targets()
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in targets or len(node.args) < 2:
            continue
        x, w = node.args[0], node.args[1]
        offsets = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
        if not isinstance(offsets, Node):
            continue
        transposed = (
            isinstance(w, Node)
            and w.op == "call_function"
            and w.target is aten.transpose.int
            and sorted(d % 3 for d in w.args[1:3]) == [1, 2]
            and _is_attr(w.args[0])
        )
        weight = w.args[0] if transposed else w
        if not _is_attr(weight):
            continue
        if "val" not in weight.meta:
            weight.meta["val"] = get_tensor(gm, weight.target)
        if weight.meta["val"].dim() != 3:
            continue
        found.append(ExpertLinear(node, weight.target, x, offsets, weight, transposed, w))
    return found


def expert_rows(x: torch.Tensor, offsets: torch.Tensor) -> list[torch.Tensor]:
    """Rows of ``x`` (sorted by expert) that each expert receives."""
    return [x[start:end] for start, end in expert_ranges(offsets)]
