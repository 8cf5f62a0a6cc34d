"""The ``qc`` op contract as code: one spec per op, and every graph node's arguments by name.

Passes, backends, bit counting and exporters read a ``qc`` node through :func:`args_of`
(``a.qweight``, ``a.bits``) and build one through :func:`call_op` (keyword arguments), so the
argument order lives in exactly one place: the op's ``torch.library`` schema. A new op is
defined in its layout's file under ``qcompiler/layouts/`` (layout-free ops: ``qcompiler/ir/ops.py``;
export-only ones: a backend's lowering module) and registered here with the names of its stored
tensors, the number of weights it stands for and its capabilities; tests/test_op_registry.py
fails on positional ``args[...]`` access to ``qc`` nodes anywhere else.

Each backend and exporter (a *target*) registers, per op, its implementation (:func:`implement`)
or a refusal with its reason (:func:`refuse`), beside its own code; none keeps a private per-op
table. tests/test_op_coverage.py walks every op x every target: a new op fails it until each
target either runs it or says why not. The eager backend runs every op's reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.fx import Graph, GraphModule, Node

from qcompiler.ir.graph import module_path
from qcompiler.ir.graph_property import GraphProperty
from qcompiler.ir.tensors import get_raw_tensor, get_tensor

__all__ = [
    "OpSpec",
    "OpArgs",
    "register",
    "spec",
    "spec_of",
    "args_of",
    "call_op",
    "registered",
    "quantized_layer_path",
    "Implementation",
    "register_target",
    "targets",
    "implement",
    "refuse",
    "implementation",
    "implementations",
    "storage_ops",
]

_SPECS: dict[str, "OpSpec"] = {}
_TARGETS: dict[str, str] = {}  # target -> what it is
_IMPLEMENTATIONS: dict[tuple[str, str], "Implementation"] = {}  # (target, op) -> implementation or refusal
_TARGETS["eager"] = "backend: every op's plain-torch reference implementation"


@dataclass(frozen=True)
class OpSpec:
    """What the rest of the code needs to know about one ``qc`` op besides its schema.

    ``storage``: the stored-tensor arguments that make up the layer's size (bit counting);
    ``weights``: how many weights a node stands for, from its arguments and output (None: the op
    adds storage but no weights of its own, like SpQR's sparse outliers beside the dense branch);
    ``code_widths``: the integer arguments that are bit widths of packed codes (what kernels and
    exporters check against the widths they unpack); ``establishes``: the graph properties a node of
    this op witnesses (the pass contract checks a pass's ``provides`` with them); ``export_only``:
    the target whose lowering makes this op (it exists only on the way there and is never saved);
    ``validate``: raises ValueError when a node's stored tensors or constants are not what the op
    stores (dtype, shape, a block type): a loaded artifact is checked with it before anything runs.
    """

    name: str
    storage: tuple[str, ...] = ()
    weights: Optional[Callable[["OpArgs", GraphModule], int]] = None
    code_widths: tuple[str, ...] = ()
    establishes: frozenset[GraphProperty] = frozenset()
    export_only: Optional[str] = None
    validate: Optional[Callable[["OpArgs", GraphModule], None]] = None

    @property
    def overload(self) -> torch._ops.OpOverload:
        """The ``torch.ops.qc`` overload graph nodes call."""
        return getattr(torch.ops.qc, self.name).default

    @property
    def params(self) -> tuple[str, ...]:
        """The op's argument names, in schema order."""
        return tuple(a.name for a in self.overload._schema.arguments)

    def defaults(self) -> dict[str, Any]:
        """The arguments that have defaults, with them."""
        return {a.name: a.default_value for a in self.overload._schema.arguments if a.has_default_value()}


class OpArgs:
    """A ``qc`` node's arguments by name: graph nodes (``get_attr`` for stored tensors) or constants."""

    def __init__(self, op_spec: OpSpec, node: Node):
        names = op_spec.params
        if len(node.args) > len(names) or any(k not in names for k in node.kwargs):
            raise ValueError(f"node {node.name}: arguments do not match qc.{op_spec.name}{names}")
        values, missing = _bind(op_spec, {**dict(zip(names, node.args)), **node.kwargs})
        if missing:
            raise ValueError(f"node {node.name}: qc.{op_spec.name} is missing {missing}")
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "spec", op_spec)
        object.__setattr__(self, "node", node)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(
                f"qc.{self.spec.name} has no argument {name!r} (arguments: {', '.join(self.spec.params)})"
            ) from None

    def __setattr__(self, name, value):
        raise AttributeError("OpArgs is read-only; build a new node with call_op")

    def as_dict(self) -> dict[str, Any]:
        """Every argument by name."""
        return dict(self._values)

    def tensor(self, gm: GraphModule, name: str) -> torch.Tensor:
        """The stored tensor behind argument ``name`` (a ``get_attr`` node)."""
        arg = self._values[name]
        if not (isinstance(arg, Node) and arg.op == "get_attr"):
            raise ValueError(f"node {self.node.name}: qc.{self.spec.name} argument {name!r} is not a stored tensor")
        return get_tensor(gm, arg.target)

    def stored_like(self, gm: GraphModule, name: str) -> torch.Tensor:
        """The stored tensor behind ``name`` as held: shape and dtype, without reading a streamed
        graph's placeholder from disk (counting bits needs no values)."""
        arg = self._values[name]
        if not (isinstance(arg, Node) and arg.op == "get_attr"):
            raise ValueError(f"node {self.node.name}: qc.{self.spec.name} argument {name!r} is not a stored tensor")
        return get_raw_tensor(gm, arg.target)

    def tensors(self, gm: GraphModule, *names: str) -> tuple[torch.Tensor, ...]:
        """The stored tensors behind several arguments, in the order named."""
        return tuple(self.tensor(gm, n) for n in names)

    def stored(self) -> list[Node]:
        """The ``get_attr`` nodes among the arguments, in schema order."""
        return [v for v in self._values.values() if isinstance(v, Node) and v.op == "get_attr"]


def _bind(op_spec: OpSpec, given: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Every argument of the op in schema order (defaults filled in, absent optional ones None),
    and the required ones ``given`` lacks."""
    schema = op_spec.overload._schema.arguments
    values = {**op_spec.defaults(), **given}
    missing = [a.name for a in schema if a.name not in values and not isinstance(a.type, torch.OptionalType)]
    return {a.name: values.get(a.name) for a in schema}, missing


def register(op_spec: OpSpec) -> OpSpec:
    """Add ``op_spec``; the op must already be defined (``torch.library.custom_op``). The eager
    backend runs it by its reference implementation."""
    op_spec.overload  # fails here, naming the op, if it is not defined
    _SPECS[op_spec.name] = op_spec
    implement("eager", op_spec.name, op_spec.overload, label="reference")
    return op_spec


@dataclass(frozen=True)
class Implementation:
    """How one target handles one op: ``load()`` gives the callable (imported on first use: Triton
    is slow to import), ``kind`` what it is to the target (a kernel, a graph lowering, an ONNX
    translation, a checkpoint writer), ``label`` its name in plans and reports; or a refusal."""

    target: str
    op: str
    load: Optional[Callable[[], Callable]] = None
    kind: str = ""
    label: str = ""
    refusal: Optional[str] = None


def register_target(name: str, description: str) -> None:
    """Declare a backend or exporter; the coverage test then asks it about every op."""
    _TARGETS[name] = description


def targets() -> dict[str, str]:
    """Every declared target and what it is."""
    return dict(_TARGETS)


def implement(
    target: str,
    op: str,
    fn: Optional[Callable] = None,
    *,
    load: Optional[Callable[[], Callable]] = None,
    kind: str = "",
    label: str = "",
) -> None:
    """Register how ``target`` runs ``op``: ``fn`` itself, or ``load`` that imports and returns it."""
    if (fn is None) == (load is None):
        raise TypeError(f"implement({target!r}, {op!r}): give exactly one of fn or load")
    _IMPLEMENTATIONS[(target, op)] = Implementation(target, op, load or (lambda: fn), kind, label or op)


def refuse(target: str, op: str, reason: str) -> None:
    """Register that ``target`` cannot handle ``op``, and why (the error users see)."""
    _IMPLEMENTATIONS[(target, op)] = Implementation(target, op, refusal=reason)


def implementation(target: str, op: str) -> Optional[Implementation]:
    """What ``target`` registered for ``op`` (None: nothing, which the coverage test forbids)."""
    return _IMPLEMENTATIONS.get((target, op))


def implementations(target: str, kind: Optional[str] = None) -> dict[str, Implementation]:
    """Every op ``target`` implements (refusals left out), optionally only those of one ``kind``."""
    return {
        op: impl
        for (t, op), impl in _IMPLEMENTATIONS.items()
        if t == target and impl.refusal is None and kind in (None, impl.kind)
    }


def storage_ops() -> list[OpSpec]:
    """The ops a pass may leave in a saved graph (not export-only)."""
    return [s for s in _SPECS.values() if s.export_only is None]


def spec(name: str) -> OpSpec:
    """The spec of ``qc.{name}``, or an error listing the registered ops."""
    try:
        return _SPECS[name]
    except KeyError:
        raise KeyError(f"qc.{name} is not a registered op (registered: {', '.join(sorted(_SPECS))})") from None


def registered() -> dict[str, OpSpec]:
    """Every registered op spec by name."""
    return dict(_SPECS)


def spec_of(node: Node) -> Optional[OpSpec]:
    """The spec of a ``call_function`` node's ``qc`` op, else None."""
    if node.op != "call_function" or getattr(node.target, "namespace", None) != "qc":
        return None
    return _SPECS.get(node.target._schema.name.split("::")[-1])


def args_of(node: Node) -> OpArgs:
    """``node``'s arguments by name (a ValueError if it is not a registered ``qc`` op)."""
    op_spec = spec_of(node)
    if op_spec is None:
        raise ValueError(f"node {node.name} ({node.target}) is not a registered qc op")
    return OpArgs(op_spec, node)


def call_op(graph: Graph, name: str, **arguments: Any) -> Node:
    """A new node calling ``qc.{name}`` with ``arguments`` by name (positional in schema order)."""
    op_spec = spec(name)
    unknown = set(arguments) - set(op_spec.params)
    if unknown:
        raise TypeError(f"qc.{name} has no argument(s) {sorted(unknown)} (arguments: {', '.join(op_spec.params)})")
    values, missing = _bind(op_spec, arguments)
    if missing:
        raise TypeError(f"qc.{name} is missing argument(s) {missing}")
    return graph.call_function(op_spec.overload, tuple(values.values()))


def expect_stored(a: OpArgs, gm: GraphModule, name: str, dtypes: tuple, shape: Optional[tuple] = None) -> tuple:
    """The shape of the stored tensor behind ``name``; ValueError unless its dtype is one of
    ``dtypes`` and (given) its shape is ``shape``."""
    t = a.stored_like(gm, name)
    if t.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} is {str(t.dtype).removeprefix('torch.')}, qc.{a.spec.name} stores {want}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, qc.{a.spec.name} here needs {tuple(shape)}")
    return tuple(t.shape)


def validate_stored(gm: GraphModule) -> None:
    """Check every ``qc`` node whose op has a ``validate``: ValueError naming the node and layer."""
    for node in gm.graph.nodes:
        op_spec = spec_of(node)
        if op_spec is None or op_spec.validate is None:
            continue
        a = OpArgs(op_spec, node)
        try:
            op_spec.validate(a, gm)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"node {node.name} (layer {quantized_layer_path(a)}): {exc}") from None


def quantized_layer_path(a: OpArgs) -> str:
    """The quantized layer's path: its first stored tensor's target without the argument's name.
    Tensors are stored as ``{path}.{name}`` beside a linear and as ``{path}_{name}`` beside a 3-D
    expert parameter (one module holds several of those, so the module path would not tell them
    apart); else the node's name."""
    stored = [(name, v) for name, v in a.as_dict().items() if isinstance(v, Node) and v.op == "get_attr"]
    if not stored:
        return a.node.name
    name, node = stored[0]
    target = str(node.target)
    for suffix in (f".{name}", f"_{name}"):
        if target.endswith(suffix) and len(target) > len(suffix):
            return target[: -len(suffix)]
    return module_path(node) or a.node.name
