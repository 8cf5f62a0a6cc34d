"""Backends: each turns a (quantized) GraphModule into something that runs."""

from __future__ import annotations

from typing import Callable, Optional

from qcompiler.backends.eager import prepare_eager
from qcompiler.backends.onnxruntime import prepare_onnxruntime
from qcompiler.backends.triton import prepare_triton
from qcompiler.errors import BackendError

__all__ = [
    "get_backend",
    "available_backends",
    "register_backend",
    "backend_target",
    "prepare_eager",
    "prepare_onnxruntime",
    "prepare_triton",
]

# name -> prepare(gm, example_inputs, **options) -> callable like the original model
_BACKENDS: dict[str, Callable] = {}
_TARGETS: dict[str, str] = {}  # name -> the op-registry target that says which qc ops it runs


def register_backend(name: str, prepare: Callable, target: Optional[str] = None) -> None:
    """Make ``backend=name`` (and the CLI's ``--backend name``) run graphs through ``prepare``;
    ``target``: the op-registry target whose implement/refuse lines it runs by (default: ``name``)."""
    _BACKENDS[name] = prepare
    _TARGETS[name] = target or name


def backend_target(name: str) -> str:
    """The op-registry target backend ``name`` runs ``qc`` ops by."""
    get_backend(name)
    return _TARGETS[name]


def available_backends() -> list[str]:
    """The registered backend names, sorted."""
    return sorted(_BACKENDS)


def get_backend(name: str) -> Callable:
    """The ``prepare(gm, example_inputs, **options) -> callable`` function of backend ``name``."""
    if name not in _BACKENDS:
        raise BackendError(f"unknown backend {name!r}; available: {', '.join(available_backends())}")
    return _BACKENDS[name]


for _name, _prepare, _target in (
    ("eager", prepare_eager, "eager"),
    ("onnxruntime", prepare_onnxruntime, "onnx"),
    ("triton", prepare_triton, "triton"),
):
    register_backend(_name, _prepare, _target)
