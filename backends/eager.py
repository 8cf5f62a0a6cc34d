"""The eager backend: runs the graph as is, each ``qc`` op through its plain-torch reference."""

from __future__ import annotations

from torch.fx import GraphModule

__all__ = ["prepare_eager"]


def prepare_eager(gm: GraphModule, example_inputs=None):
    """The GraphModule is already callable like the original model."""
    return gm
