"""The base every pass uses, built-in or user-written: declared requirements, products, one ``run``.

A pass is a small frozen dataclass (its fields are its config, validated in ``__post_init__``;
``config_version`` says which meaning of those fields it has) that transforms a ``GraphModule``
and returns whether it changed anything (or a :class:`PassResult`). It declares the graph
properties it ``requires`` and ``provides``, and those after which it would find nothing to do
(``noop_after``: a weight quantizer after another one); the pass manager checks the whole list
before anything runs, and checks each claimed property after its pass ran
(``qcompiler/pipeline/pass_contract.py``). ``qc.run_pass(p, gm, ctx)`` runs one pass under that contract;
``p.run(gm, ctx)`` is the bare transformation.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch
from torch.fx import GraphModule

from qcompiler.distributed.ranks import current_ranks
from qcompiler.ir.graph_property import GraphProperty

__all__ = ["GraphProperty", "Pass", "PassContext", "PassRecord", "PassResult", "progress_line"]


@dataclass
class PassRecord:
    """What one pass did: filled by the manager (timing) and by the pass (layers, notes)."""

    name: str
    config: dict
    seconds: float = 0.0
    modified: bool = False
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)  # module path -> figures
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PassResult:
    """What running one pass gave: the graph to continue with (the same object when the pass edits
    in place), whether it changed anything, and its record (notes, per-layer figures)."""

    graph_module: GraphModule
    modified: bool
    record: PassRecord


class _StderrHandler(logging.StreamHandler):
    """Writes to the ``sys.stderr`` of the moment (a redirected stream, pytest's capture), not the
    one there was at import."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


# Progress goes through the standard "qcompiler" logger, on stderr as "[qcompiler] ..." by default:
# logging.getLogger("qcompiler").setLevel(logging.WARNING) silences it, and an application may
# replace its handler (it does not propagate to the root logger, so a root handler shows no copy).
LOG = logging.getLogger("qcompiler")
if not LOG.handlers:
    _handler = _StderrHandler()
    _handler.setFormatter(logging.Formatter("[qcompiler] %(message)s"))
    LOG.addHandler(_handler)
    LOG.setLevel(logging.INFO)
    LOG.propagate = False


def progress_line(message: str) -> None:
    """A progress line on the "qcompiler" logger (stderr by default); in a distributed run only
    rank 0 logs (every rank computes the same report)."""
    if current_ranks().is_root:
        LOG.info(message)


@dataclass
class PassContext:
    """What a running pass may use besides the graph."""

    example_inputs: tuple[tuple, dict]
    calibration: Optional[list[tuple[tuple, dict]]] = None  # normalized (args, kwargs) batches
    record: PassRecord = field(default_factory=lambda: PassRecord("standalone", {}))  # pass.run(gm, ctx) alone
    progress: bool = True
    device: Optional[torch.device] = None  # where calibration and solvers run (None: where the weights are)
    offload: bool = False  # keep cached block inputs on the CPU, move them per batch
    checkpoint: Any = None  # a RunCheckpoint: where finished blocks are recorded (run_checkpoint.py)
    pass_index: int = 0  # the running pass's place in the recipe (set by the pass manager)

    def log(self, message: str) -> None:
        """Progress line (stderr), shown unless the user turned progress off."""
        if self.progress:
            progress_line(message)


def _own_fields_first(p) -> list:
    """A dataclass pass's fields with the keyword-only ones last (stable otherwise)."""
    return sorted(dataclasses.fields(p), key=lambda f: f.kw_only)


def _call_repr(p) -> str:
    """A pass as the call that builds it: the dataclass repr, with keyword-only fields (the base's
    ``ignore`` / ``true_sequential`` / ``lm_head`` of a weight quantizer) after the pass's own."""
    if not dataclasses.is_dataclass(p):
        return object.__repr__(p)
    shown = [f for f in _own_fields_first(p) if f.repr]
    return f"{type(p).__qualname__}({', '.join(f'{f.name}={getattr(p, f.name)!r}' for f in shown)})"


class Pass:
    """Base class of all passes. Subclass it, set ``requires``/``provides``, implement ``run``."""

    requires: ClassVar[frozenset[GraphProperty]] = frozenset()
    provides: ClassVar[frozenset[GraphProperty]] = frozenset()
    noop_after: ClassVar[frozenset[GraphProperty]] = frozenset()  # would change nothing once these hold
    needs_calibration: ClassVar[bool] = False
    config_version: ClassVar[int] = 1  # raise when a field's meaning changes; artifacts record it

    def __init_subclass__(cls, **kwargs):
        """Every ``run`` works without autograd; every pass class joins the registry recipes and
        artifacts resolve names in (``qcompiler/pipeline/pass_registry.py``)."""
        super().__init_subclass__(**kwargs)
        if "run" in cls.__dict__:
            cls.run = torch.no_grad()(cls.__dict__["run"])
        if "__repr__" not in cls.__dict__:  # set before @dataclass runs, which then keeps it
            cls.__repr__ = _call_repr
        from qcompiler.pipeline.pass_registry import add_pass_class

        add_pass_class(cls)

    @property
    def name(self) -> str:
        """The class name: what the report and error messages call the pass."""
        return type(self).__name__

    def config(self) -> dict:
        """The pass's settings (its dataclass fields), as recorded in the report and the artifact."""
        if dataclasses.is_dataclass(self):
            return {f.name: getattr(self, f.name) for f in _own_fields_first(self)}
        return {}

    @classmethod
    def migrate_config(cls, config: dict, version: int) -> dict:
        """``config`` as saved by version ``version`` of this pass, in today's fields. Override it to
        keep loading artifacts an older version wrote; by default only the current version loads."""
        from qcompiler.errors import ArtifactError

        raise ArtifactError(
            f"pass {cls.__name__}: the artifact's settings are config version {version}, "
            f"this qcompiler's {cls.__name__} is version {cls.config_version} and has no "
            f"migration from it; re-quantize with this version"
        )

    def run(self, gm: GraphModule, ctx: PassContext) -> "bool | PassResult":
        """Transform ``gm`` (in place, or return a PassResult with a new graph); True if anything changed."""
        raise NotImplementedError(f"{self.name} does not implement run()")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{self.name}({args})"
