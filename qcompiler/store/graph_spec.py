"""The call structure of an untrusted graph file, and the names fx would put into Python source.

torch.fx generates a ``forward`` from the graph and ``exec``s it. Strings from an artifact reach
that source as node names, input names, tensor names, keyword names, and through the pytree spec
(the signature's argument names and the quoted keys of its keyword dict). Each must be a plain
identifier (tensor names: a dotted path of identifiers and integers), and the spec is checked node
by node against the schema ``torch.utils._pytree.treespec_dumps`` writes before it is rebuilt.
"""

from __future__ import annotations

import importlib
import json
import keyword
import re
from typing import Any

import torch.utils._pytree as pytree
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

from qcompiler.errors import ArtifactError

__all__ = ["short", "is_identifier", "check_identifier", "check_dotted", "checked_spec", "call_structure"]


def short(value: Any) -> str:
    """``value`` as a short printable string for error messages."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_identifier(text: Any) -> bool:
    """A plain Python name (what fx may put into generated source without quoting)."""
    return isinstance(text, str) and text.isidentifier() and not keyword.iskeyword(text) and not text.startswith("__")


def check_identifier(text: Any, what: str) -> str:
    """``text`` if it is a Python identifier, else an ArtifactError naming ``what``."""
    if not is_identifier(text):
        raise ArtifactError(f"refusing to load {what} {short(text)}: not a plain identifier")
    return text


def check_dotted(text: Any, what: str) -> str:
    """``text`` if it is a dotted path of identifiers, else an ArtifactError naming ``what``."""
    if not isinstance(text, str) or not all(is_identifier(p) or re.fullmatch(r"[0-9]+", p) for p in text.split(".")):
        raise ArtifactError(f"refusing to load {what} {short(text)}: not a dotted name of identifiers")
    return text


_CONTAINERS = {"builtins.tuple", "builtins.list", "builtins.dict", "collections.OrderedDict"}
_TYPE_NAME = re.compile(r"transformers(\.[A-Za-z_][A-Za-z0-9_]*)+")


def _output_class(name: str):
    """A transformers ``ModelOutput`` subclass named in the spec (importing only transformers' own,
    installed modules, whose classes pytree must know to rebuild the output object)."""
    import transformers.utils

    if not _TYPE_NAME.fullmatch(name):
        raise ArtifactError(f"refusing output type {short(name)} in the graph's pytree spec")
    module_name, cls_name = name.rsplit(".", 1)
    try:
        cls = getattr(importlib.import_module(module_name), cls_name, None)
    except ImportError:
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, transformers.utils.ModelOutput)):
        raise ArtifactError(
            f"output type {name} in the graph's pytree spec is not a transformers ModelOutput "
            f"in this transformers version"
        )
    return cls


def checked_spec(text: Any, what: str) -> pytree.TreeSpec:
    """Rebuild a pytree spec after checking every field against the schema ``treespec_dumps`` writes:
    known container types, identifier keys, nothing else."""
    try:
        protocol, root = json.loads(text)
    except (TypeError, ValueError):
        raise ArtifactError(f"the graph's {what} spec is not a serialized pytree spec") from None
    if protocol != 1:
        raise ArtifactError(f"the graph's {what} spec has protocol {short(protocol)}; this qcompiler reads 1")

    def walk(node, depth):
        if depth > 32 or not isinstance(node, dict) or set(node) != {"type", "context", "children_spec"}:
            raise ArtifactError(f"malformed {what} spec node {short(node)}")
        kind, context, children = node["type"], node["context"], node["children_spec"]
        if not isinstance(children, list):
            raise ArtifactError(f"malformed {what} spec node {short(node)}")
        if kind is None:
            if context is not None or children:
                raise ArtifactError(f"malformed {what} spec leaf {short(node)}")
            return
        if kind in ("builtins.tuple", "builtins.list"):
            if context != "null":
                raise ArtifactError(f"malformed {what} spec node {short(node)}")
        else:
            if kind not in _CONTAINERS:
                _output_class(kind)
            try:
                keys = json.loads(context)
            except (TypeError, ValueError):
                keys = None
            if not isinstance(keys, list) or len(keys) != len(children) or not all(is_identifier(k) for k in keys):
                raise ArtifactError(f"refusing {what} spec keys {short(context)}: not a list of identifiers")
        for child in children:
            walk(child, depth + 1)

    walk(root, 0)
    try:
        return pytree.treespec_loads(text)
    except Exception as exc:  # pytree raises several types for specs it cannot rebuild
        raise ArtifactError(f"the graph's {what} spec cannot be rebuilt: {exc}") from None


def call_structure(spec: Any, placeholders: list[str]) -> _PyTreeCodeGen:
    """The call structure; its argument names become the generated forward()'s signature, so they
    must be identifiers, and the keyword names must be exactly the input spec's keys."""
    if not isinstance(spec, dict) or set(spec) != {"orig_args", "in_spec", "out_spec"}:
        raise ArtifactError("malformed pytree entry in the graph")
    orig_args = spec["orig_args"]
    if (
        not isinstance(orig_args, list)
        or not all(is_identifier(a) for a in orig_args)
        or len(set(orig_args)) != len(orig_args)
    ):
        raise ArtifactError(f"refusing the pytree spec's arguments {short(orig_args)}: not distinct identifiers")
    in_spec = checked_spec(spec["in_spec"], "input")
    if in_spec.num_leaves != len(placeholders):
        raise ArtifactError(f"the input spec has {in_spec.num_leaves} leaves for {len(placeholders)} inputs")
    if in_spec.type is tuple and in_spec.num_children == 2 and in_spec.child(1).type is dict:
        positional = in_spec.child(0).num_children
        expected = list(in_spec.child(1).context)
        if len(orig_args) != positional + len(expected) or orig_args[positional:] != expected:
            raise ArtifactError(
                f"the pytree spec's arguments {short(orig_args)} are not the graph's inputs "
                f"({positional} positional, then {expected})"
            )
    elif len(orig_args) != in_spec.num_children:
        raise ArtifactError(f"the pytree spec's arguments {short(orig_args)} do not match its input spec")
    return _PyTreeCodeGen(_PyTreeInfo(orig_args, in_spec, checked_spec(spec["out_spec"], "output")))
