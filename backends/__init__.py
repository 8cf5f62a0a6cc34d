"""Backends: each turns a (quantized) GraphModule into something that runs."""
from __future__ import annotations

from typing import Callable

from qcompiler.errors import BackendError

from .eager import prepare_eager
from .onnxruntime import prepare_onnxruntime
from .triton import prepare_triton

__all__ = ["get_backend", "available_backends", "prepare_eager", "prepare_onnxruntime", "prepare_triton"]

# name -> prepare(gm, example_inputs, **options) -> callable like the original model
_BACKENDS: dict[str, Callable] = {"eager": prepare_eager, "onnxruntime": prepare_onnxruntime,
                                 "triton": prepare_triton}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str) -> Callable:
    """The ``prepare(gm, example_inputs, **options) -> callable`` function of backend ``name``."""
    if name not in _BACKENDS:
        raise BackendError(f"unknown backend {name!r}; available: {', '.join(available_backends())}")
    return _BACKENDS[name]
