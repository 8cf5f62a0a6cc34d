"""A safe, self-contained file format for a (quantized) fx graph: JSON structure + named tensors.

Loading must never execute code from the file, so the graph is not pickled and not stored as
Python source. Each node is written as data — op kind, target, arguments — and on load every
call target is resolved against an allow-list: ``torch.ops.<ns>.<op>.<overload>`` for the
namespaces ``aten`` and ``qc``, and the ``operator`` module's functions. Argument values are
nodes, numbers, strings, None, dtypes, devices, layouts, memory formats and lists/tuples of these.
Tensors (``get_attr`` targets) go to safetensors under their dotted names; tied tensors are stored
once. The call structure (which kwargs the graph takes, what output object it returns) is the
pytree spec, serialized with ``torch.utils._pytree.treespec_dumps``.

torch.export's runtime guard module (``_guards_fn``) is not kept: it only re-checks input shapes.
"""
from __future__ import annotations

import importlib
import json
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

from .errors import QCompilerError
from .graph import get_tensor, set_tensor

__all__ = ["graph_to_data", "graph_from_data", "ArtifactError"]

FORMAT_VERSION = 1
_OP_NAMESPACES = ("aten", "qc")
_LAYOUTS = {str(v): v for v in (torch.strided, torch.sparse_coo, torch.sparse_csr)}
_MEMORY_FORMATS = {str(v): v for v in (torch.contiguous_format, torch.preserve_format, torch.channels_last)}


class ArtifactError(QCompilerError):
    """A saved artifact is missing, damaged, or holds something this version cannot load."""


def _encode(value: Any) -> Any:
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):  # fx's immutable_list is a list
        return {"tuple" if isinstance(value, tuple) else "list": [_encode(v) for v in value]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value)}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value)}
    raise ArtifactError(f"cannot store a graph argument of type {type(value).__name__} ({value!r})")


def _decode(value: Any, nodes: dict[str, fx.Node]) -> Any:
    if not isinstance(value, dict):
        return value
    (kind, payload), = value.items()
    if kind == "node":
        return nodes[payload]
    if kind in ("list", "tuple"):
        items = [_decode(v, nodes) for v in payload]
        return items if kind == "list" else tuple(items)
    if kind == "dtype":
        dtype = getattr(torch, payload, None)
        if not isinstance(dtype, torch.dtype):
            raise ArtifactError(f"unknown dtype {payload!r} in the graph")
        return dtype
    if kind == "device":
        return torch.device(payload)
    table = {"layout": _LAYOUTS, "memory_format": _MEMORY_FORMATS}.get(kind)
    if table is None or payload not in table:
        raise ArtifactError(f"unknown graph argument {value!r}")
    return table[payload]


def _target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"torch.ops.{target.namespace}.{target._schema.name.split('::')[1]}.{target._overloadname}"
    if getattr(operator, getattr(target, "__name__", ""), None) is target:
        return f"operator.{target.__name__}"
    raise ArtifactError(f"cannot store a call to {target!r}: only aten/qc operators and operator.* are allowed")


def _resolve_target(name: str):
    parts = name.split(".")
    if parts[0] == "operator" and len(parts) == 2 and hasattr(operator, parts[1]):
        return getattr(operator, parts[1])
    if len(parts) == 5 and parts[:2] == ["torch", "ops"] and parts[2] in _OP_NAMESPACES:
        try:
            return getattr(getattr(getattr(torch.ops, parts[2]), parts[3]), parts[4])
        except (AttributeError, RuntimeError):
            raise ArtifactError(f"operator {name} does not exist in this torch / qcompiler version") from None
    raise ArtifactError(f"refusing to load call target {name!r}: not an allowed operator")


def graph_to_data(gm: fx.GraphModule) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(structure, tensors)``: JSON-ready structure and the tensors it names."""
    nodes, tensors, aliases, kinds, seen = [], {}, {}, {}, {}
    skipped = set()
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target == "_guards_fn":
            skipped.add(node)
            continue
        if node.op == "call_module":
            raise ArtifactError(f"cannot store node {node.name}: calls submodule {node.target!r}")
        entry = {"name": node.name, "op": node.op}
        if node.op == "get_attr":
            tensor = get_tensor(gm, node.target)
            if not isinstance(tensor, torch.Tensor):
                raise ArtifactError(f"get_attr node {node.name} names {node.target!r}, which is not a tensor")
            kinds[node.target] = "parameter" if isinstance(tensor, torch.nn.Parameter) else "buffer"
            key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
            if tensor.numel() and key in seen:
                aliases[node.target] = seen[key]
            else:
                seen[key] = node.target
                tensors[node.target] = tensor.detach().contiguous().cpu()
            entry["target"] = node.target
        elif node.op == "call_function":
            entry["target"] = _target_name(node.target)
        elif node.op == "placeholder":
            entry["target"] = node.target
        if any(a in skipped for a in node.all_input_nodes):
            raise ArtifactError(f"node {node.name} uses the guard module's output")
        entry["args"] = _encode(tuple(node.args))
        entry["kwargs"] = {k: _encode(v) for k, v in node.kwargs.items()}
        nodes.append(entry)
    codegen = gm.graph._codegen
    spec = None
    if isinstance(codegen, _PyTreeCodeGen):
        info = codegen.pytree_info
        spec = {"orig_args": list(info.orig_args), "in_spec": pytree.treespec_dumps(info.in_spec),
                "out_spec": pytree.treespec_dumps(info.out_spec)}
    return {"format_version": FORMAT_VERSION, "nodes": nodes, "pytree": spec, "aliases": aliases,
            "tensor_kinds": kinds}, tensors


def _import_types_of(spec_json: str) -> None:
    """Output classes (e.g. transformers' ModelOutput subclasses) must be imported to be rebuilt."""
    def walk(spec):
        kind = spec.get("type")
        if kind and kind.startswith("transformers."):
            importlib.import_module(kind.rsplit(".", 1)[0])
        for child in spec.get("children_spec", []):
            walk(child)
    walk(json.loads(spec_json)[1])


def graph_from_data(structure: dict, tensors: dict[str, torch.Tensor]) -> fx.GraphModule:
    """Rebuild the GraphModule written by :func:`graph_to_data`."""
    if structure.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"graph format version {structure.get('format_version')!r} is not supported "
                            f"(this qcompiler reads version {FORMAT_VERSION})")
    root = torch.nn.Module()
    for target, kind in structure["tensor_kinds"].items():
        name = structure["aliases"].get(target, target)
        if name not in tensors:
            raise ArtifactError(f"tensor {name!r} is missing from the artifact's weights")
        set_tensor(root, target, tensors[name], parameter=kind == "parameter")
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}
    for entry in structure["nodes"]:
        op, name = entry["op"], entry["name"]
        args = _decode(entry["args"], nodes)
        kwargs = {k: _decode(v, nodes) for k, v in entry["kwargs"].items()}
        if op == "call_function":
            target = _resolve_target(entry["target"])
        elif op in ("placeholder", "get_attr"):
            target = entry["target"]
        elif op == "output":
            target = "output"
        else:
            raise ArtifactError(f"node {name}: unsupported op kind {op!r}")
        node = graph.create_node(op, target, args, kwargs, name=name)  # registers the name in the namespace
        nodes[name] = node
    spec = structure.get("pytree")
    if spec:
        _import_types_of(spec["out_spec"])
        graph.set_codegen(_PyTreeCodeGen(_PyTreeInfo(spec["orig_args"], pytree.treespec_loads(spec["in_spec"]),
                                                     pytree.treespec_loads(spec["out_spec"]))))
    gm = fx.GraphModule(root, graph)
    gm.graph.lint()
    return gm
