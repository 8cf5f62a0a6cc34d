"""Backends: each turns a (quantized) GraphModule into something that runs."""
from __future__ import annotations

from typing import Callable

from qcompiler.errors import BackendError

from .eager import prepare_eager

__all__ = ["get_backend", "available_backends", "prepare_eager"]

_BACKENDS: dict[str, Callable] = {"eager": prepare_eager}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str) -> Callable:
    """The ``prepare(gm) -> callable`` function of backend ``name``."""
    if name not in _BACKENDS:
        raise BackendError(f"unknown backend {name!r}; available: {', '.join(available_backends())}")
    return _BACKENDS[name]
