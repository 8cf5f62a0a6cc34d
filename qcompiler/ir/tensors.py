"""Tensor access on a captured graph: the one place passes, the engine and the backends read and
write the weights a ``get_attr`` node names (a streamed weight is read from its checkpoint here)."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

__all__ = ["get_tensor", "set_tensor", "get_raw_tensor", "drop_tensor", "drop_attr_if_unused", "LAZY_META_KEY"]


def get_raw_tensor(gm: GraphModule, target: str):
    """What the dotted ``target`` names in ``gm``, as stored (a streamed weight: its placeholder)."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


LAZY_META_KEY = "qcompiler_lazy"  # gm.meta: where a streamed graph's placeholders come from (lazy_weights.py)


def get_tensor(gm: GraphModule, target: str) -> torch.Tensor:
    """The parameter or buffer a ``get_attr`` target names; a streamed weight's placeholder is read
    from its checkpoint (lazy_weights.py), not kept."""
    obj = get_raw_tensor(gm, target)
    if isinstance(obj, torch.Tensor) and obj.is_meta:
        source = gm.meta.get(LAZY_META_KEY)
        if source is not None and target in source:
            return source.read(target)
    return obj


def drop_tensor(gm: GraphModule, target: str) -> None:
    """Delete the tensor at dotted ``target`` (its ``get_attr`` node must already be gone)."""
    *parent, leaf = target.split(".")
    delattr(get_raw_tensor(gm, ".".join(parent)) if parent else gm, leaf)


def set_tensor(gm: GraphModule, target: str, tensor: torch.Tensor, *, parameter: bool = False) -> None:
    """Store ``tensor`` at dotted ``target`` (creating holder modules), as buffer or parameter."""
    *parents, leaf = target.split(".")
    mod = gm
    for part in parents:
        if not hasattr(mod, part):
            mod.add_module(part, torch.nn.Module())
        mod = getattr(mod, part)
    if hasattr(mod, leaf):
        delattr(mod, leaf)
    if parameter:
        mod.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    else:
        mod.register_buffer(leaf, tensor)


def drop_attr_if_unused(gm: GraphModule, attr_node: Node) -> None:
    """Erase a ``get_attr`` node nobody reads any more, and the tensor it names."""
    if attr_node.users:
        return
    gm.graph.erase_node(attr_node)
    drop_tensor(gm, attr_node.target)
