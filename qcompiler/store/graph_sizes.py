"""A loaded graph's literal sizes, bounded by what its own tensors could need.

An artifact's graph is untrusted data: a re-signed ``graph.json`` can ask an allow-listed op for a
``[10**7, 10**7]`` tensor (``aten.zeros``, ``aten.full``, ``aten.expand`` then a copy) or an
``aten.arange(10**12)``, which fails at the first call with the allocator's error (or, below the
machine's memory, takes all of it). Every list of plain integers among a node's arguments — a size
written into the graph at capture — is checked at load: its product may not pass 16× the largest
tensor the artifact stores, nor 2^30 elements when that is larger (a captured logits tensor is
sequence × vocabulary; on Gemma-3 270M at 2,048 tokens that is 3.2× its embedding table). Sizes
computed at run time from the inputs are not literal and not checked here.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch import fx

from qcompiler.errors import ArtifactError

__all__ = ["check_literal_sizes", "size_bound"]

_FLOOR = 1 << 30


def size_bound(tensors: dict[str, torch.Tensor]) -> int:
    """The most elements one literal size of a graph storing ``tensors`` may ask for."""
    return max(_FLOOR, 16 * max((t.numel() for t in tensors.values()), default=0))


def _int_lists(value) -> Iterator[tuple]:
    """Every list or tuple of plain integers inside ``value`` (nested arguments included)."""
    if isinstance(value, dict):
        value = tuple(value.values())
    if not isinstance(value, (list, tuple)):
        return
    if value and all(type(v) is int for v in value):
        yield tuple(value)
    for v in value:
        if isinstance(v, (list, tuple, dict)):
            yield from _int_lists(v)


def check_literal_sizes(graph: fx.Graph, tensors: dict[str, torch.Tensor]) -> None:
    """ArtifactError naming the first node whose literal size passes :func:`size_bound`."""
    bound = size_bound(tensors)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for size in _int_lists((node.args, node.kwargs)):
            elements = math.prod(v for v in size if v > 0)
            if elements > bound:
                shown = f"a {elements.bit_length()}-bit count of" if elements.bit_length() > 64 else f"{elements}"
                raise ArtifactError(
                    f"graph node {node.name} asks for {shown} elements, more than this artifact's tensors "
                    f"could need ({bound}); the graph file is damaged or was edited"
                )
