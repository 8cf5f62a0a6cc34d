"""Backends: each turns a (quantized) GraphModule into something that runs."""

from __future__ import annotations

from typing import Callable

from qcompiler.backends.eager import prepare_eager
from qcompiler.backends.onnxruntime import prepare_onnxruntime
from qcompiler.backends.triton import prepare_triton
from qcompiler.errors import BackendError

__all__ = [
    "get_backend",
    "available_backends",
    "register_backend",
    "prepare_eager",
    "prepare_onnxruntime",
    "prepare_triton",
]

# name -> prepare(gm, example_inputs, **options) -> callable like the original model
_BACKENDS: dict[str, Callable] = {}


def register_backend(name: str, prepare: Callable) -> None:
    """Make ``backend=name`` (and the CLI's ``--backend name``) run graphs through ``prepare``."""
    _BACKENDS[name] = prepare


def available_backends() -> list[str]:
    """The registered backend names, sorted."""
    return sorted(_BACKENDS)


def get_backend(name: str) -> Callable:
    """The ``prepare(gm, example_inputs, **options) -> callable`` function of backend ``name``."""
    if name not in _BACKENDS:
        raise BackendError(f"unknown backend {name!r}; available: {', '.join(available_backends())}")
    return _BACKENDS[name]


for _name, _prepare in (("eager", prepare_eager), ("onnxruntime", prepare_onnxruntime), ("triton", prepare_triton)):
    register_backend(_name, _prepare)
