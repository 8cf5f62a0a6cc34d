"""Untouched tensors stored no wider than the checkpoint they came from.

A bf16 checkpoint loaded in float32 (``models.load(folder)``, ``--no-stream``) would otherwise be
saved with every tensor a pass left alone in float32: on Gemma-3 270M, whose 16-bit embedding is
63 % of the parameters, a 4-bit artifact came out 1.35x the bf16 original. A float32 parameter is
stored in the checkpoint's 16-bit dtype only when that is lossless (every value survives the round
trip), and the artifact's graph file lists it, so loading widens it back: the reloaded graph is
bit-identical to the saved one, and tensors a pass changed (a SmoothQuant-scaled norm, a rotated
embedding) keep their float32 values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

__all__ = ["checkpoint_float_dtype", "narrowing", "WIDEN_KEY", "widen"]

WIDEN_KEY = "widen_to_float32"  # graph.json: targets stored narrower than the graph computes them
_NARROW = {"BF16": torch.bfloat16, "F16": torch.float16}


def checkpoint_float_dtype(folder: Optional[str]) -> Optional[torch.dtype]:
    """The one 16-bit float dtype of the safetensors checkpoint in ``folder`` (headers only), or
    None: no folder, no safetensors, float32 tensors or a mix of float dtypes."""
    if not folder or not Path(folder).is_dir():
        return None
    from safetensors import safe_open

    found = set()
    try:
        for file in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                found |= {f.get_slice(k).get_dtype() for k in f.keys()}
    except Exception:  # an unreadable checkpoint: store as computed (the source is not ours to judge here)
        return None
    floats = {d for d in found if d.startswith(("F", "BF"))}
    return _NARROW.get(floats.pop()) if len(floats) == 1 else None


def narrowing(tensors: dict[str, torch.Tensor], kinds: dict[str, str], dtype: Optional[torch.dtype]) -> dict:
    """``{target: dtype}`` for each float32 parameter held in memory whose values ``dtype`` holds
    exactly (a streamed tensor still on disk is already in the checkpoint's dtype)."""
    if dtype is None:
        return {}
    out = {}
    for target, t in tensors.items():
        if kinds.get(target) != "parameter" or t.is_meta or t.dtype != torch.float32 or not t.numel():
            continue
        if torch.equal(t.to(dtype).to(torch.float32), t):
            out[target] = dtype
    return out


def widen(structure: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Back to float32, in place, each tensor the graph file lists as stored narrower; the list is
    untrusted: a name that is no stored 16-bit tensor is an error naming it."""
    from qcompiler.store.graph_format import ArtifactError

    listed = structure.get(WIDEN_KEY, [])
    if not isinstance(listed, list):
        raise ArtifactError(f"graph file: {WIDEN_KEY} must be a list of tensor names")
    for name in listed:
        t = tensors.get(name) if isinstance(name, str) else None
        if t is None or t.dtype not in _NARROW.values():
            raise ArtifactError(f"graph file: {WIDEN_KEY} names {name!r}, which is no stored 16-bit tensor")
        tensors[name] = t.to(torch.float32)
