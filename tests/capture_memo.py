"""One ``torch.export`` per architecture per test worker, reused for every example its guards admit.

About two thirds of the suite's time was ``torch.export`` re-capturing the same tiny models (the
2-layer LLaMA alone 60 times). The memo keys a capture by everything that decides the traced graph
of a Hugging Face model — class, full config (and attention implementation), the cache-mode
forward, every parameter and buffer name/shape/dtype, the example's ranks and dtypes, the dynamic
shapes — and hands a later capture whose example sizes the program's own guards admit (``_fits``:
static sizes equal, symbolic ones inside their traced ranges; the same example sizes were a third
of the suite's exports) the same program re-bound to the new model's own tensors, so
the graph computes with that model's weights exactly as a fresh capture would. Models that are not
Hugging Face models (their forward may depend on constructor options no key sees) always export
afresh. A streamed skeleton (fake parameters) gets its own program, rebound to the new skeleton's
placeholders the same way (``lazy_weights.attach`` then maps them to its checkpoint).
``QC_TEST_CAPTURE_MEMO=0`` turns it off, also while a test runs (a test of what capture itself
reads sets it).
"""

from __future__ import annotations

import copy
import importlib
import os

import torch
from torch.utils._pytree import tree_flatten

from qcompiler.frontend import lazy_weights

capture_module = importlib.import_module("qcompiler.frontend.capture")  # the package re-exports a function of that name

_programs: dict = {}


def _spec(value):
    if isinstance(value, torch.Tensor):  # sizes are checked against each program's own guards (_fits)
        return ("tensor", value.dim(), value.dtype)
    return ("value", repr(value))


def _fits(program: torch.export.ExportedProgram, args: tuple, kwargs: dict) -> bool:
    """Whether ``program`` was traced for inputs of these sizes: each static size equal, each
    symbolic one inside the program's range for its symbol (where tracing branched on a size, the
    range says which side it took) and equal wherever the program shares the symbol."""
    import torch.fx._pytree as fx_pytree

    try:
        leaves = fx_pytree.tree_flatten_spec((args, kwargs), program.call_spec.in_spec)
    except Exception:
        return False
    names = program.graph_signature.user_inputs
    values = {n.name: n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}
    bound: dict = {}
    for name, leaf in zip(names, leaves, strict=True):
        if not isinstance(leaf, torch.Tensor):
            continue  # constants: in the key
        traced = values.get(name)
        if traced is None or traced.dim() != leaf.dim():
            return False
        for size, actual in zip(traced.shape, leaf.shape):
            if isinstance(size, int):
                if size != actual:
                    return False
                continue
            symbol = size.node.expr
            ranges = program.range_constraints.get(symbol)
            if ranges is None or bound.setdefault(symbol, actual) != actual or actual not in ranges:
                return False
    return True


def _key(model: torch.nn.Module, args: tuple, kwargs: dict, shapes):
    config = getattr(model, "config", None)
    if not hasattr(config, "to_json_string"):
        return None
    tensors = [(name, tuple(t.shape), t.dtype) for name, t in model.state_dict(keep_vars=True).items()]
    tensors += [(name, tuple(t.shape), t.dtype) for name, t in model.named_buffers(remove_duplicate=False)]
    return (
        lazy_weights.fake_mode_of(model) is not None,  # a streamed skeleton: its own program, rebound alike
        type(model),
        "forward" in vars(model),
        config.to_json_string(use_diff=False),
        getattr(config, "_attn_implementation", None),
        tuple(tensors),
        tuple(_spec(v) for v in tree_flatten((args, kwargs))[0]),
        repr(shapes),
    )


def _rebound(program: torch.export.ExportedProgram, model: torch.nn.Module) -> torch.export.ExportedProgram:
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update(model.named_buffers(remove_duplicate=False))
    missing = [name for name in program.state_dict if name not in own]
    assert not missing, f"capture memo: {missing[:3]} not in the model"
    fresh = copy.copy(program)  # module() deep-copies the graph: programs are never mutated
    fresh._state_dict = {name: own[name] for name in program.state_dict}
    fresh._constants = {name: own.get(name, value) for name, value in program.constants.items()}
    return fresh


def install() -> None:
    if os.environ.get("QC_TEST_CAPTURE_MEMO", "1") == "0":
        return
    export = capture_module.export_program

    def memoized(model, args, kwargs, shapes):
        key = None if os.environ.get("QC_TEST_CAPTURE_MEMO", "1") == "0" else _key(model, args, kwargs, shapes)
        if key is None:
            return export(model, args, kwargs, shapes)
        programs = _programs.setdefault(key, [])
        program = next((p for p in programs if _fits(p, args, kwargs)), None)
        if program is None:
            program = export(model, args, kwargs, shapes)
            programs.append(program)
        return _rebound(program, model)

    capture_module.export_program = memoized
