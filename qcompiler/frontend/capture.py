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

from qcompiler.errors import CaptureError
from qcompiler.frontend import lazy_weights
from qcompiler.frontend.causal_lm import wants_cache
from qcompiler.ir.graph import canonicalize_linears

__all__ = ["capture", "CaptureInfo", "normalize_inputs", "dynamic_shapes_for"]


@dataclass
class CaptureInfo:
    """What the capture was made from: needed to call the graph like the original module."""

    model_class: str
    arg_count: int
    kwarg_names: tuple[str, ...]
    constant_kwargs: dict[str, Any] = field(default_factory=dict)  # non-tensor kwargs (use_cache=False)
    model_config: Optional[dict] = None  # a transformers model's config (for checkpoint export)
    source_path: Optional[str] = None  # the folder the model was loaded from (never overwritten)
    cache: Optional[dict] = None  # a causal LM captured with its KV cache: causal_lm.CacheLayout
    optional_inputs: dict = field(default_factory=dict)  # inputs filled in when the caller omits them
    # graph tensors that are not the model's state (non-persistent buffers such as rotary inv_freq,
    # torch.export's lifted constants): checkpoint exports leave them out, as from_pretrained would
    transient: tuple[str, ...] = ()
    # tied parameters (an output head sharing the input embedding): every other state-dict name of a
    # shared tensor -> the name checkpoints store it under (the embedding's, as save_pretrained does)
    tied: dict[str, str] = field(default_factory=dict)
    # layers whose weight the model stores as [in, out] (GPT-2's Conv1D): checkpoint clients that
    # swap in quantized nn.Linear layers skip them
    transposed_layers: tuple[str, ...] = ()


def normalize_inputs(example_inputs) -> tuple[tuple, dict]:
    """``example_inputs`` as ``(args, kwargs)``: a tensor, a tuple of args, or a dict of kwargs."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        if (
            len(example_inputs) == 2
            and isinstance(example_inputs[0], (tuple, list))
            and isinstance(example_inputs[1], dict)
        ):
            return tuple(example_inputs[0]), dict(example_inputs[1])
        return tuple(example_inputs), {}
    raise CaptureError(
        f"example_inputs must be a tensor, a tuple of tensors or a dict of keyword "
        f"inputs, got {type(example_inputs).__name__}"
    )


def _dynamic_spec(value):
    """Batch (dim 0) and sequence (dim 1) dynamic for every tensor input; the rest static."""
    if isinstance(value, torch.Tensor):
        return {d: torch.export.Dim.AUTO for d in range(min(value.dim(), 2))} or None
    return None


def dynamic_shapes_for(args: tuple, kwargs: dict, param_names: list[str]):
    """torch.export ``dynamic_shapes``: by name when there are keyword inputs, else positional."""
    if kwargs:
        return {
            **{param_names[i]: _dynamic_spec(a) for i, a in enumerate(args)},
            **{k: _dynamic_spec(v) for k, v in kwargs.items()},
        }
    return tuple(_dynamic_spec(a) for a in args)


def _check_signature(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    try:
        inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as exc:
        raise CaptureError(
            f"example inputs do not match {type(model).__name__}.forward{inspect.signature(model.forward)}: {exc}"
        ) from None


_HINTS = (
    (
        "data-dependent",
        "the module branches on or reads a tensor's value (data-dependent control "
        "flow, .item(), .tolist()); rewrite it with torch.where / torch.cond, or move "
        "that logic out of forward()",
    ),
    (
        "Could not guard",
        "the module branches on a tensor's value; rewrite it with torch.where / "
        "torch.cond, or move that logic out of forward()",
    ),
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
    if not args and wants_cache(model, kwargs):
        return _capture_with_cache(model, kwargs)
    # Export guards on the example's strides; a sliced (non-contiguous) example would make the
    # graph reject ordinary contiguous inputs later.
    args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
    kwargs = {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    _check_signature(model, args, kwargs)
    optional = _add_optional_inputs(model, args, kwargs)
    model.eval()
    shapes = dynamic_shapes_for(args, kwargs, list(inspect.signature(model.forward).parameters))
    try:
        exported = export_program(model, args, kwargs, shapes)
    except Exception as exc:  # torch.export raises many types; we re-raise one that explains
        text = str(exc)
        hint = next(
            (h for key, h in _HINTS if key in text),
            "simplify the failing construct in forward(), or capture a submodule that torch.export can trace",
        )
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}: {first} ({type(exc).__name__}). Hint: {hint}."
        ) from exc
    gm = _unlift(exported, model)
    gm.meta["qcompiler"] = CaptureInfo(
        model_class=type(model).__name__,
        arg_count=len(args),
        kwarg_names=tuple(kwargs),
        constant_kwargs={k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)},
        model_config=_config_dict(model),
        source_path=_source_folder(model),
        optional_inputs=optional,
        transient=transient_tensors(gm, model),
        tied=tied_names(model),
        transposed_layers=conv1d_layers(model),
    )
    return gm


def conv1d_layers(model: torch.nn.Module) -> tuple[str, ...]:
    """The layers that store their weight as ``[in, out]`` (transformers' ``Conv1D``, GPT-2's linears)."""
    return tuple(name for name, m in model.named_modules() if type(m).__name__ == "Conv1D")


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """``{alias: stored name}`` for each parameter reachable under several names; the stored name
    is the input embedding's where it is one of them (clients read a tied table from there)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    table = getattr(embeddings, "weight", None)
    tied = {}
    for names in groups.values():
        if len(names) > 1:
            keep = next((n for n in names if table is not None and model.get_parameter(n) is table), names[0])
            tied.update({n: keep for n in names if n != keep})
    return tied


def transient_tensors(gm: torch.fx.GraphModule, model: torch.nn.Module) -> tuple[str, ...]:
    """The graph's stored tensors that are not in ``model``'s state dict."""
    state = set(model.state_dict(keep_vars=True))
    return tuple(sorted({n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target not in state}))


# Inputs an encoder's callers may or may not pass: captured always (with the value that means
# "absent"), so the compiled model accepts them either way and a backend never drops one.
OPTIONAL_INPUTS = {"attention_mask": "ones", "token_type_ids": "zeros"}


def optional_value(kind: str, input_ids: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(input_ids) if kind == "ones" else torch.zeros_like(input_ids)


def fill_optional_inputs(info: CaptureInfo, kwargs: dict) -> dict:
    """Fill in place the optional inputs the caller left out (or passed as None), from input_ids."""
    ids = kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor):
        for name, kind in (info.optional_inputs or {}).items():
            if kwargs.get(name) is None:
                kwargs[name] = optional_value(kind, ids)
    return kwargs


def _add_optional_inputs(model, args: tuple, kwargs: dict) -> dict:
    """For a (non-generating) transformers model called by keyword: add the optional inputs its
    forward takes and the example lacks. Returns ``{name: "ones" | "zeros"}`` of every optional
    input the graph then takes, so that a call may leave any of them out (as transformers allows)."""
    can_generate = getattr(model, "can_generate", None)
    ids = kwargs.get("input_ids")
    if (
        args
        or not isinstance(ids, torch.Tensor)
        or getattr(model, "config", None) is None
        or (callable(can_generate) and can_generate())
    ):
        return {}
    params = inspect.signature(model.forward).parameters
    taken = {name: kind for name, kind in OPTIONAL_INPUTS.items() if name in params}
    for name, kind in taken.items():
        if kwargs.get(name) is None:
            kwargs[name] = optional_value(kind, ids)
    return taken


def _capture_with_cache(model: torch.nn.Module, kwargs: dict) -> torch.fx.GraphModule:
    """A causal LM with its KV cache as graph inputs and outputs (see causal_lm.py)."""
    from qcompiler.frontend import causal_lm

    unknown = set(kwargs) - {"input_ids", "attention_mask", "use_cache"}
    if unknown or not isinstance(kwargs.get("input_ids"), torch.Tensor):
        raise CaptureError(
            f"a causal LM is captured from input_ids (and optionally attention_mask); the example "
            f"also has {sorted(unknown)}"
            if unknown
            else "a causal LM example needs input_ids"
        )
    model.eval()
    layout = causal_lm.cache_layout(model)
    inputs = causal_lm.example_graph_inputs(layout, kwargs["input_ids"], kwargs.get("attention_mask"))
    model.forward = causal_lm.cache_forward(model, layout)  # an instance attribute: traced instead of the class's
    try:
        exported = export_program(model, (), inputs, causal_lm.dynamic_shapes(inputs))
    except Exception as exc:
        text = str(exc).strip()
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__} with its KV cache: "
            f"{text.splitlines()[0] if text else type(exc).__name__} ({type(exc).__name__}). "
            f"Hint: pass use_cache=False in the example to capture it without a cache."
        ) from exc
    finally:
        del model.forward
    gm = _unlift(exported, model)
    for node in list(gm.graph.nodes):  # assumes sizes >= 2; the graph itself runs P = 0 and S = 1
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    gm.recompile()
    gm.meta["qcompiler"] = CaptureInfo(
        model_class=type(model).__name__,
        arg_count=0,
        kwarg_names=tuple(inputs),
        constant_kwargs={},
        model_config=_config_dict(model),
        source_path=_source_folder(model),
        cache=layout.to_dict(),
        transient=transient_tensors(gm, model),
        tied=tied_names(model),
        transposed_layers=conv1d_layers(model),
    )
    return gm


def export_program(model: torch.nn.Module, args: tuple, kwargs: dict, shapes) -> torch.export.ExportedProgram:
    """``torch.export`` (non-strict) of ``model`` at the example, in its fake mode when it is a
    streamed skeleton. Both capture paths export here (the test suite memoizes this one call)."""
    with _quiet_export_logs(), torch.no_grad():
        return torch.export.export(model, *_in_fake_mode_of(model, args, kwargs), dynamic_shapes=shapes, strict=False)


def _in_fake_mode_of(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A streamed skeleton's parameters are fake tensors: export must see its inputs in their mode."""
    mode = lazy_weights.fake_mode_of(model)
    if mode is None:
        return args, kwargs
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, (args, kwargs))


def _unlift(exported, model: torch.nn.Module) -> torch.fx.GraphModule:
    """The exported program as a GraphModule with ``get_attr`` weights (placeholders read on demand
    for a streamed skeleton)."""
    gm = exported.module()
    if lazy_weights.fake_mode_of(model) is not None:
        lazy_weights.attach(gm, model)
    canonicalize_linears(gm)
    return gm


def _source_folder(model) -> Optional[str]:
    import os

    path = getattr(model, "name_or_path", None)
    return os.path.abspath(path) if isinstance(path, str) and path and os.path.isdir(path) else None


def _config_dict(model) -> Optional[dict]:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return None
    import json

    return json.loads(config.to_json_string(use_diff=False))
