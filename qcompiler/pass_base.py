"""The base every pass uses, built-in or user-written: declared requirements, products, one ``run``.

A pass is a small frozen dataclass (its fields are its config, validated in ``__post_init__``)
that transforms a ``GraphModule`` in place and returns whether it changed anything. It declares
the graph properties it ``requires`` and ``provides``, and those after which it would find nothing
to do (``noop_after``: a weight quantizer after another one); the pass manager checks the whole list
before anything runs.
"""
from __future__ import annotations

import dataclasses
import enum
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch
from torch.fx import GraphModule

__all__ = ["GraphProperty", "Pass", "PassContext", "PassRecord"]


class GraphProperty(enum.Enum):
    """Facts about a graph that passes establish and depend on."""

    CAPTURED = "captured"                    # an aten-level export graph (always true at start)
    SMOOTHED = "smoothed"                    # SmoothQuant scales folded in
    QUANTIZED_WEIGHTS = "quantized_weights"  # linears replaced by weight-quantized ops
    INT8_LOWERED = "int8_lowered"            # linears replaced by int8 x int8 ops
    OUTLIERS_SPLIT = "outliers_split"        # SpQR dense + sparse branches


@dataclass
class PassRecord:
    """What one pass did: filled by the manager (timing) and by the pass (layers, notes)."""

    name: str
    config: dict
    seconds: float = 0.0
    modified: bool = False
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)  # module path -> figures
    notes: list[str] = field(default_factory=list)


@dataclass
class PassContext:
    """What a running pass may use besides the graph."""

    example_inputs: tuple[tuple, dict]
    calibration: Optional[list[tuple[tuple, dict]]] = None  # normalized (args, kwargs) batches
    record: PassRecord = field(default_factory=lambda: PassRecord("standalone", {}))  # pass.run(gm, ctx) alone
    progress: bool = True
    device: Optional[torch.device] = None   # where calibration and solvers run (None: where the weights are)
    offload: bool = False                   # keep cached block inputs on the CPU, move them per batch

    def log(self, message: str) -> None:
        """Progress line (stderr), shown unless the user turned progress off."""
        if self.progress:
            print(f"[qcompiler] {message}", file=sys.stderr, flush=True)


class Pass:
    """Base class of all passes. Subclass it, set ``requires``/``provides``, implement ``run``."""

    requires: ClassVar[frozenset[GraphProperty]] = frozenset()
    provides: ClassVar[frozenset[GraphProperty]] = frozenset()
    noop_after: ClassVar[frozenset[GraphProperty]] = frozenset()  # would change nothing once these hold
    needs_calibration: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        """Every ``run`` works without autograd, under the manager or called on its own."""
        super().__init_subclass__(**kwargs)
        if "run" in cls.__dict__:
            cls.run = torch.no_grad()(cls.__dict__["run"])

    @property
    def name(self) -> str:
        return type(self).__name__

    def config(self) -> dict:
        """The pass's settings (its dataclass fields), as recorded in the report."""
        if dataclasses.is_dataclass(self):
            return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {}

    def run(self, gm: GraphModule, ctx: PassContext) -> bool:
        """Transform ``gm`` in place; return True if anything changed."""
        raise NotImplementedError(f"{self.name} does not implement run()")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{self.name}({args})"
