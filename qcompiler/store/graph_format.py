"""A safe, self-contained file format for a (quantized) fx graph: JSON structure + named tensors.

Loading must never execute code from the file, so the graph is not pickled and not stored as
Python source. Each node is written as data — op kind, target, arguments — and on load every
call target is resolved against an allow-list: ``torch.ops.<ns>.<op>.<overload>`` for the
namespaces ``aten`` and ``qc`` (minus file-system ops), transformers' MoE grouped matmul, and pure
``operator`` arithmetic and indexing. Argument values are nodes, numbers, strings, None, dtypes,
devices, layouts, memory
formats and lists/tuples of these. Tensors (``get_attr`` targets) go to safetensors under their
dotted names; tied tensors are stored once. The call structure (which kwargs the graph takes, what
output object it returns) is the pytree spec, serialized with ``torch.utils._pytree.treespec_dumps``.

torch.fx turns a graph into Python source and runs it, so on load every string that would reach
that source — node names, inputs, tensor names, keyword names, the spec's argument names and
keys — must be a plain identifier (or a dotted path of them); the spec is checked node by node
against the schema ``treespec_dumps`` writes before it is rebuilt (``graph_spec.py``). The file is
untrusted data.

torch.export's runtime guard module (``_guards_fn``) is not kept: it only re-checks input shapes.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.graph import _PyTreeCodeGen

from qcompiler.errors import ArtifactError
from qcompiler.ir.tensors import get_raw_tensor, set_tensor
from qcompiler.store.graph_sizes import check_literal_sizes
from qcompiler.store.graph_spec import call_structure, check_dotted, check_identifier, short

__all__ = ["graph_to_data", "graph_from_data", "ArtifactError"]

FORMAT_VERSION = 1
_OP_NAMESPACES = ("aten", "qc")
_LAYOUTS = {str(v): v for v in (torch.strided, torch.sparse_coo, torch.sparse_csr)}
_MEMORY_FORMATS = {str(v): v for v in (torch.contiguous_format, torch.preserve_format, torch.channels_last)}


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


_SCALARS = (bool, int, float, str, type(None))


def _decode(value: Any, nodes: dict[str, fx.Node]) -> Any:
    """Only the tagged forms ``_encode`` writes; anything else in the file is refused."""
    if isinstance(value, _SCALARS):
        return value
    if not isinstance(value, dict) or len(value) != 1:
        raise ArtifactError(f"malformed graph argument {short(value)}")
    ((kind, payload),) = value.items()
    if kind == "node":
        if not isinstance(payload, str) or payload not in nodes:
            raise ArtifactError(f"graph argument names node {short(payload)}, which is not defined before it")
        return nodes[payload]
    if kind in ("list", "tuple"):
        if not isinstance(payload, list):
            raise ArtifactError(f"malformed graph argument {short(value)}")
        items = [_decode(v, nodes) for v in payload]
        return items if kind == "list" else tuple(items)
    if not isinstance(payload, str):
        raise ArtifactError(f"malformed graph argument {short(value)}")
    if kind == "dtype":
        dtype = getattr(torch, payload, None) if payload.isidentifier() else None
        if not isinstance(dtype, torch.dtype):
            raise ArtifactError(f"unknown dtype {payload!r} in the graph")
        return dtype
    if kind == "device":
        if not re.fullmatch(r"[a-z]+(:\d+)?", payload):
            raise ArtifactError(f"unknown device {short(payload)} in the graph")
        try:
            return torch.device(payload)
        except RuntimeError:
            raise ArtifactError(f"unknown device {short(payload)} in the graph") from None
    table = {"layout": _LAYOUTS, "memory_format": _MEMORY_FORMATS}.get(kind)
    if table is None or payload not in table:
        raise ArtifactError(f"unknown graph argument {short(value)}")
    return table[payload]


# Pure arithmetic, comparison and indexing only: no attrgetter/methodcaller/call, which reach
# arbitrary attributes and callables.
_OPERATORS = {
    name: getattr(operator, name)
    for name in (
        "add",
        "sub",
        "mul",
        "truediv",
        "floordiv",
        "mod",
        "pow",
        "neg",
        "pos",
        "abs",
        "matmul",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "and_",
        "or_",
        "xor",
        "invert",
        "not_",
        "lshift",
        "rshift",
        "getitem",
        "truth",
    )
}


class GraphEvaluationError(ArtifactError):
    """A stored graph's plain arithmetic would run away (a huge power, shift or repetition)."""


_INT_BITS = 64  # shape arithmetic never needs more
_PRODUCT_BITS = 1024  # a product's bound: far past any shape, far below a runaway chain


def _digits(value) -> str:
    """A number for a message: a huge integer by its size, not its (maybe megabytes of) digits."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<a {value.bit_length()}-bit integer>"
    return repr(value)[:40]


def _bounded(name: str, fn):
    """``fn`` (operator pow / lshift / mul) refusing results that cannot be shape arithmetic: a
    loaded graph's constants are untrusted, and ``2 ** 10**12`` or ``[0] * 10**12`` never return."""

    def check(a, b):
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (a, b))
        if name == "pow" and ints and b > 0 and abs(a) > 1 and b * max(abs(a).bit_length(), 1) > _INT_BITS:
            raise GraphEvaluationError(f"graph arithmetic {a} ** {b} exceeds {_INT_BITS} bits")
        if name == "lshift" and ints and (b > _INT_BITS or abs(a).bit_length() + b > _INT_BITS):
            raise GraphEvaluationError(f"graph arithmetic {a} << {b} exceeds {_INT_BITS} bits")
        if name == "mul" and any(isinstance(v, (str, bytes, list, tuple)) for v in (a, b)):
            count = b if isinstance(a, (str, bytes, list, tuple)) else a
            size = len(a if count is b else b)
            if isinstance(count, int) and count * max(size, 1) > 1 << 20:
                raise GraphEvaluationError(f"graph arithmetic repeats a sequence {count} times")
        if name == "mul" and ints and abs(a).bit_length() + abs(b).bit_length() > _PRODUCT_BITS:
            # each product bounded, so a chain of self-multiplications cannot double its size 60 times
            raise GraphEvaluationError(f"graph arithmetic {_digits(a)} * {_digits(b)} exceeds {_PRODUCT_BITS} bits")
        try:
            return fn(a, b)
        except OverflowError:  # float ** float
            raise GraphEvaluationError(f"graph arithmetic {name}({_digits(a)}, {_digits(b)}) overflows") from None

    check.__name__ = name
    return check


for _name in ("pow", "lshift", "mul"):
    _OPERATORS[_name] = _bounded(_name, _OPERATORS[_name])
_PLAIN = {getattr(operator, name): name for name in _OPERATORS}  # captured graphs call operator's own

# torch's pure functions on symbolic sizes (a sliding-window cache is min/max of lengths)
_SYM_FUNCTIONS = {f"torch.{name}": getattr(torch, name) for name in ("sym_max", "sym_min", "sym_not")}

_FORBIDDEN_OPS = {"from_file", "_save", "save"}  # aten ops that touch the file system
# Pure compute ops of other libraries that captured graphs contain: transformers' grouped matmul
# over a MoE layer's experts (when they stay in full precision).
_EXTRA_OPS = {"torch.ops.transformers.grouped_mm_fallback.default"}


def _target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"torch.ops.{target.namespace}.{target._schema.name.split('::')[1]}.{target._overloadname}"
    name = getattr(target, "__name__", "")
    if _OPERATORS.get(name) is target or _PLAIN.get(target) == name:
        return f"operator.{name}"
    if _SYM_FUNCTIONS.get(f"torch.{name}") is target:
        return f"torch.{name}"
    raise ArtifactError(
        f"cannot store a call to {target!r}: only aten/qc operators, plain operator "
        f"arithmetic ({', '.join(sorted(_OPERATORS))}) and {', '.join(_SYM_FUNCTIONS)} are allowed"
    )


def _resolve_target(name: str):
    parts = name.split(".") if isinstance(name, str) else []
    if len(parts) == 2 and parts[0] == "operator" and parts[1] in _OPERATORS:
        return _OPERATORS[parts[1]]
    if name in _SYM_FUNCTIONS:
        return _SYM_FUNCTIONS[name]
    if name in _EXTRA_OPS:  # registered when transformers' MoE integration is imported
        import transformers.integrations.moe  # noqa: F401

        return torch.ops.transformers.grouped_mm_fallback.default
    if (
        len(parts) == 5
        and parts[:2] == ["torch", "ops"]
        and parts[2] in _OP_NAMESPACES
        and all(p.isidentifier() for p in parts[3:])
        and parts[3] not in _FORBIDDEN_OPS
    ):
        try:
            op = getattr(getattr(getattr(torch.ops, parts[2]), parts[3]), parts[4])
        except (AttributeError, RuntimeError):
            raise ArtifactError(f"operator {name} does not exist in this torch / qcompiler version") from None
        if isinstance(op, torch._ops.OpOverload):
            return op
    raise ArtifactError(f"refusing to load call target {short(name)}: not an allowed operator")


def graph_to_data(gm: fx.GraphModule) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(structure, tensors)``: JSON-ready structure and the tensors it names; a streamed graph's
    tensors still on disk are their ``meta`` placeholders (read them with ``get_tensor``)."""
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
            tensor = get_raw_tensor(gm, node.target)
            if not isinstance(tensor, torch.Tensor):
                raise ArtifactError(f"get_attr node {node.name} names {node.target!r}, which is not a tensor")
            kinds[node.target] = "parameter" if isinstance(tensor, torch.nn.Parameter) else "buffer"
            key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
            if tensor.is_meta:  # still on disk (lazy_weights.py): the writer reads it when it writes it
                tensors[node.target] = tensor
            elif tensor.numel() and key in seen:
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
        spec = {
            "orig_args": list(info.orig_args),
            "in_spec": pytree.treespec_dumps(info.in_spec),
            "out_spec": pytree.treespec_dumps(info.out_spec),
        }
    return {
        "format_version": FORMAT_VERSION,
        "nodes": nodes,
        "pytree": spec,
        "aliases": aliases,
        "tensor_kinds": kinds,
    }, tensors


def graph_from_data(structure: dict, tensors: dict[str, torch.Tensor]) -> fx.GraphModule:
    """Rebuild the GraphModule written by :func:`graph_to_data`, treating the file as untrusted:
    every name that fx would place into generated source is checked to be a plain identifier, every
    call target is allow-listed, every argument is one of the tagged value kinds."""
    try:
        return _graph_from_data(structure, tensors)
    except ArtifactError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ArtifactError(f"the graph file is malformed ({type(exc).__name__}: {short(str(exc))})") from None


def _graph_from_data(structure: dict, tensors: dict[str, torch.Tensor]) -> fx.GraphModule:
    if not isinstance(structure, dict) or structure.get("format_version") != FORMAT_VERSION:
        version = structure.get("format_version") if isinstance(structure, dict) else None
        raise ArtifactError(
            f"graph format version {short(version)} is not supported (this qcompiler reads version {FORMAT_VERSION})"
        )
    root = torch.nn.Module()
    aliases = structure["aliases"]
    for target, kind in structure["tensor_kinds"].items():
        check_dotted(target, "tensor name")
        name = aliases.get(target, target)
        if not isinstance(name, str) or name not in tensors:
            raise ArtifactError(f"tensor {short(name)} is missing from the artifact's weights")
        set_tensor(root, target, tensors[name], parameter=kind == "parameter")
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}
    placeholders = []
    for entry in structure["nodes"]:
        op, name = entry["op"], check_identifier(entry["name"], "node name")
        if name in nodes:
            raise ArtifactError(f"node name {name} appears twice in the graph")
        args = _decode(entry["args"], nodes)
        if not isinstance(args, tuple) or not isinstance(entry["kwargs"], dict):
            raise ArtifactError(f"node {name}: malformed arguments")
        kwargs = {
            check_identifier(k, f"keyword argument of node {name}"): _decode(v, nodes)
            for k, v in entry["kwargs"].items()
        }
        if op == "call_function":
            target = _resolve_target(entry["target"])
        elif op == "placeholder":
            target = check_identifier(entry["target"], "graph input")
            if args or kwargs:
                raise ArtifactError(f"graph input {name} has default values; artifacts store none")
            placeholders.append(target)
        elif op == "get_attr":
            target = check_dotted(entry["target"], f"tensor of node {name}")
            if target not in structure["tensor_kinds"]:
                raise ArtifactError(f"node {name} reads tensor {target}, which the artifact does not list")
        elif op == "output":
            target = "output"
        else:
            raise ArtifactError(f"node {name}: unsupported op kind {short(op)}")
        node = graph.create_node(op, target, args, kwargs, name=name)  # registers the name in the namespace
        nodes[name] = node
    outputs = [n for n in graph.nodes if n.op == "output"]
    if len(outputs) != 1 or outputs[0] is not list(graph.nodes)[-1]:
        raise ArtifactError(f"the graph has {len(outputs)} output nodes; a graph ends in exactly one")
    check_literal_sizes(graph, tensors)
    spec = structure.get("pytree")
    if spec is not None:
        graph.set_codegen(call_structure(spec, placeholders))
    gm = fx.GraphModule(root, graph)
    gm.graph.lint()
    return gm
