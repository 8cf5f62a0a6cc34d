"""Capture a model into an aten-level ``torch.fx.GraphModule`` with ``torch.export``.

The pre-decomposition export graph keeps ``aten.linear`` and ``aten.layer_norm`` as single nodes
and records each node's module path in ``node.meta["nn_module_stack"]``, which is what passes
match on. Batch and sequence dims are exported as dynamic (``Dim.AUTO``), so a graph captured at
one shape runs at others. Parameters are unlifted back to ``get_attr`` nodes (``ep.module()``), so
a pass rewrites a weight by replacing a module attribute.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .errors import CaptureError

__all__ = ["capture", "CaptureInfo", "normalize_inputs", "dynamic_shapes_for"]


@dataclass
class CaptureInfo:
    """What the capture was made from: needed to call the graph like the original module."""

    model_class: str
    arg_count: int
    kwarg_names: tuple[str, ...]
    constant_kwargs: dict[str, Any] = field(default_factory=dict)  # non-tensor kwargs (use_cache=False)
    model_config: Optional[dict] = None  # a transformers model's config (for checkpoint export)


def normalize_inputs(example_inputs) -> tuple[tuple, dict]:
    """``example_inputs`` as ``(args, kwargs)``: a tensor, a tuple of args, or a dict of kwargs."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        if len(example_inputs) == 2 and isinstance(example_inputs[0], (tuple, list)) \
                and isinstance(example_inputs[1], dict):
            return tuple(example_inputs[0]), dict(example_inputs[1])
        return tuple(example_inputs), {}
    raise CaptureError(f"example_inputs must be a tensor, a tuple of tensors or a dict of keyword "
                       f"inputs, got {type(example_inputs).__name__}")


def _dynamic_spec(value):
    """Batch (dim 0) and sequence (dim 1) dynamic for every tensor input; the rest static."""
    if isinstance(value, torch.Tensor):
        return {d: torch.export.Dim.AUTO for d in range(min(value.dim(), 2))} or None
    return None


def dynamic_shapes_for(args: tuple, kwargs: dict, param_names: list[str]):
    """torch.export ``dynamic_shapes``: by name when there are keyword inputs, else positional."""
    if kwargs:
        return {**{param_names[i]: _dynamic_spec(a) for i, a in enumerate(args)},
                **{k: _dynamic_spec(v) for k, v in kwargs.items()}}
    return tuple(_dynamic_spec(a) for a in args)


def _check_signature(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    try:
        inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as exc:
        raise CaptureError(f"example inputs do not match {type(model).__name__}.forward"
                           f"{inspect.signature(model.forward)}: {exc}") from None


_HINTS = (
    ("data-dependent", "the module branches on or reads a tensor's value (data-dependent control "
                       "flow, .item(), .tolist()); rewrite it with torch.where / torch.cond, or move "
                       "that logic out of forward()"),
    ("Could not guard", "the module branches on a tensor's value; rewrite it with torch.where / "
                        "torch.cond, or move that logic out of forward()"),
    ("same reduction dim", "an example input has the wrong feature size for a layer"),
    ("mat1 and mat2", "an example input has the wrong feature size for a layer"),
    ("numpy", "the module converts tensors to numpy inside forward(); keep forward() in torch ops"),
)


@contextlib.contextmanager
def _quiet_export_logs():
    """torch.export logs every failed fake-tensor op at ERROR level; we raise our own message instead."""
    names = ("torch._subclasses.fake_tensor", "torch._dynamo", "torch.export", "torch.fx.experimental")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def capture(model: torch.nn.Module, example_inputs) -> torch.fx.GraphModule:
    """Export ``model`` (in eval mode) at ``example_inputs`` into an aten-level GraphModule.

    The returned module is called like the original (same positional and keyword inputs);
    ``gm.meta["qcompiler"]`` holds a :class:`CaptureInfo`.
    """
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"capture() needs a torch.nn.Module, got {type(model).__name__}")
    args, kwargs = normalize_inputs(example_inputs)
    # Export guards on the example's strides; a sliced (non-contiguous) example would make the
    # graph reject ordinary contiguous inputs later.
    args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
    kwargs = {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    _check_signature(model, args, kwargs)
    model.eval()
    shapes = dynamic_shapes_for(args, kwargs, list(inspect.signature(model.forward).parameters))
    try:
        with _quiet_export_logs(), torch.no_grad():
            exported = torch.export.export(model, args, kwargs, dynamic_shapes=shapes, strict=False)
    except Exception as exc:  # torch.export raises many types; we re-raise one that explains
        text = str(exc)
        hint = next((h for key, h in _HINTS if key in text), "simplify the failing construct in forward(), "
                    "or capture a submodule that torch.export can trace")
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        raise CaptureError(f"torch.export could not capture {type(model).__name__}: {first} "
                           f"({type(exc).__name__}). Hint: {hint}.") from exc
    gm = exported.module()
    gm.meta["qcompiler"] = CaptureInfo(
        model_class=type(model).__name__, arg_count=len(args), kwarg_names=tuple(kwargs),
        constant_kwargs={k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)},
        model_config=_config_dict(model))
    return gm


def _config_dict(model) -> Optional[dict]:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return None
    import json
    return json.loads(config.to_json_string(use_diff=False))
