"""Which checkpoint tensors make each model parameter, as transformers would load them.

transformers renames checkpoint keys on load (GPT-NeoX ``embed_out`` -> ``lm_head``, Mixtral's
``block_sparse_moe`` -> ``mlp``) and converts layouts: Mixtral checkpoints store every expert as
its own ``w1``/``w2``/``w3`` linear, the model one stacked ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]``. A streamed load reads one parameter at a time, so a converted parameter is
a recipe (``Converted``): its source keys, read and merged by transformers' own conversion
operations only when the parameter is needed, then dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union

import torch

__all__ = ["Converted", "Entry", "checkpoint_keys"]


@dataclass
class Converted:
    """A model parameter transformers builds from several checkpoint tensors."""

    name: str  # the parameter, named as the checkpoint's keys rename to
    transform: object  # the transformers ``WeightConverter`` that builds it
    sources: dict[str, list[str]]  # its source pattern -> checkpoint keys, in expert order

    def keys(self) -> list[str]:
        """The checkpoint keys this parameter is read from."""
        return [k for keys in self.sources.values() for k in keys]

    def build(self, read, model: Optional[torch.nn.Module] = None) -> torch.Tensor:
        """The parameter from ``read(key) -> tensor``, through the converter's own operations."""
        t = self.transform
        fresh = t.copy(t._original_source_patterns, t._original_target_patterns, operations=t.operations)
        for pattern, keys in self.sources.items():
            for key in keys:
                fresh.add_tensor(self.name, key, pattern, lambda key=key: read(key))
        out = fresh.convert(self.name, model=model, config=getattr(model, "config", None))
        if len(out) != 1:
            raise ValueError(
                f"transformers' conversion of {self.name} made {len(out)} tensors "
                f"({', '.join(out)}); streaming handles one-target conversions only"
            )
        return next(iter(out.values()))


Entry = Union[str, Converted, None]  # one checkpoint key, a conversion, or missing


def _transforms(model: torch.nn.Module) -> tuple[list[tuple[str, str]], list]:
    """transformers' key renamings for ``model`` as (regex, replacement) pairs, and its layout
    converters; none for a model transformers has no mapping for (or an API it changed)."""
    try:
        from transformers.conversion_mapping import WeightRenaming, get_model_conversion_mapping

        transforms = get_model_conversion_mapping(model)
    except Exception:  # not a transformers model, or an API change: names are used as they are
        return [], []
    pairs, converters = [], []
    for t in transforms:
        if isinstance(t, WeightRenaming):
            targets = list(t.target_patterns)
            pairs += [(src, targets[min(i, len(targets) - 1)]) for i, src in enumerate(t.source_patterns)]
        else:
            converters.append(t)
    return pairs, converters


def _natural(key: str) -> list:
    """``experts.10`` after ``experts.9`` (a plain sort puts it after ``experts.1``)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def checkpoint_keys(model: torch.nn.Module, stored_keys) -> dict[str, Entry]:
    """Parameter name -> where its value is in a checkpoint holding ``stored_keys``. Names go
    through transformers' renamings, then at most one converter (as transformers loads), and the
    base-model prefix (a ``transformer.h.0`` checkpoint for an ``h.0`` model); a tied parameter
    (lm_head sharing the embedding) maps to whichever of its names the checkpoint holds."""
    pairs, converters = _transforms(model)
    prefix = getattr(model, "base_model_prefix", "") or ""
    by_model_name: dict[str, Entry] = {}
    for key in sorted(stored_keys, key=_natural):
        name = key
        for src, dst in pairs:
            name = re.sub(src, dst, name)
        for converter in converters:  # at most one converts a key, as in transformers' loading
            target, pattern = converter.rename_source_key(name)
            if pattern is not None:
                entry = by_model_name.get(target)
                if not isinstance(entry, Converted):
                    entry = by_model_name[target] = Converted(target, converter, {})
                entry.sources.setdefault(pattern, []).append(key)
                break
        else:
            by_model_name.setdefault(name, key)
    for name in list(by_model_name):
        if prefix and name.startswith(prefix + "."):
            by_model_name.setdefault(name[len(prefix) + 1 :], by_model_name[name])
        elif prefix:
            by_model_name.setdefault(f"{prefix}.{name}", by_model_name[name])
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    keys: dict[str, Entry] = {}
    for group in names.values():
        stored = next((by_model_name[n] for n in group if n in by_model_name), None)
        for n in group:
            keys[n] = stored
    return keys
