"""Streamed weights: a model folder is captured without reading its weights, and each tensor is
read from its safetensors file only when a pass or the calibration engine needs it.

``skeleton`` builds the model with *fake* parameters (a ``FakeTensorMode``: shapes and dtypes, no
storage), which torch.export captures like real ones; buffers the model computes itself (rotary
tables) stay real. ``attach`` swaps the captured graph's fake tensors for ``meta`` placeholders and
records which checkpoint tensor each one is; ``graph.get_tensor`` then reads a placeholder's
tensor from disk on every access, so the calibration engine holds one block's weights at a time
and a pass's result, once stored, replaces the placeholder. A weight pass's results parked on
disk while it ran (``files/spill.py``) become placeholders too (``adopt_parked``), read from their
files. ``materialize_all`` reads what is still a placeholder (embeddings, norms, layers kept in
full precision, parked results) when the passes are done; ``compile(..., materialize=False)``
leaves them on disk, and the artifact writer reads them one at a time.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import safe_open
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import GraphModule
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from qcompiler.errors import PassError
from qcompiler.files.spill import Parked, Spill
from qcompiler.frontend.checkpoint_keys import Converted, Entry, checkpoint_keys
from qcompiler.ir.tensors import LAZY_META_KEY, drop_tensor, get_raw_tensor, set_tensor

__all__ = [
    "Checkpoint",
    "skeleton",
    "fake_mode_of",
    "attach",
    "LazySource",
    "lazy_source",
    "materialize_all",
    "adopt_parked",
    "keep_spill",
    "release",
]

_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


class Checkpoint:
    """The tensors of a folder's safetensors files (``model.safetensors`` or shards + index),
    read one at a time; only the files' headers are read up front."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"model folder {self.folder} has no safetensors weights")
        self.file_of: dict[str, Path] = {}
        self.shape_of: dict[str, tuple] = {}
        self.stored_dtype: dict[str, str] = {}  # safetensors' name of each tensor's dtype ("BF16", "I32", ...)
        self.float_dtypes: set[torch.dtype] = set()
        for file in files:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    if key in self.file_of:
                        raise ValueError(
                            f"model folder {self.folder}: tensor {key} is in both "
                            f"{self.file_of[key].name} and {file.name}"
                        )
                    self.file_of[key] = file
                    part = f.get_slice(key)
                    self.shape_of[key] = tuple(part.get_shape())
                    self.stored_dtype[key] = part.get_dtype()
                    if part.get_dtype() in _FLOAT_DTYPES:
                        self.float_dtypes.add(_FLOAT_DTYPES[part.get_dtype()])
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():  # a shard the index names but the folder lacks is an incomplete download
            listed = json.loads(index.read_text()).get("weight_map", {})
            lost = sorted(k for k in listed if k not in self.file_of)
            if lost:
                raise ValueError(
                    f"model folder {self.folder}: the index lists {len(lost)} tensors no safetensors "
                    f"file holds (first: {lost[0]} in {listed[lost[0]]}); the download is incomplete"
                )

    @property
    def dtype(self) -> torch.dtype:
        """The checkpoint's floating-point dtype: the model computes in it (one is required)."""
        if len(self.float_dtypes) > 1:
            names = sorted(str(d).removeprefix("torch.") for d in self.float_dtypes)
            raise ValueError(
                f"model folder {self.folder} mixes floating-point dtypes ({', '.join(names)}); "
                f"load it without streaming (computes in float32)"
            )
        return next(iter(self.float_dtypes), torch.float32)

    def read(self, key: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The tensor stored under ``key`` (cast to ``dtype`` when given)."""
        with safe_open(self.file_of[key], framework="pt") as f:
            tensor = f.get_tensor(key)
        return tensor if dtype is None else tensor.to(dtype)

    def read_entry(self, entry: Entry, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """One model parameter: a stored tensor, or one transformers' conversion builds from
        several (read one parameter's sources at a time, e.g. one block's experts)."""
        if not isinstance(entry, Converted):
            return self.read(entry, dtype)
        tensor = entry.build(self.read)
        return tensor if dtype is None else tensor.to(dtype)

    def shape_of_entry(self, entry: Entry) -> tuple:
        """The shape an entry's tensor has once read (several keys stacked for MoE experts)."""
        if not isinstance(entry, Converted):
            return self.shape_of[entry]
        return tuple(entry.build(lambda key: torch.empty(self.shape_of[key], device="meta")).shape)


@contextlib.contextmanager
def _fake_parameters(mode: FakeTensorMode, dtype: torch.dtype):
    """Every parameter registered inside is a fake CPU tensor of ``dtype`` (floating point ones).
    The real tensor a module's constructor makes is dropped at once, before it is initialized."""
    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and not isinstance(param, FakeTensor):
            with mode:
                fake = torch.empty(param.shape, dtype=dtype if param.is_floating_point() else param.dtype)
            param = torch.nn.Parameter(fake, requires_grad=False)
        original(module, name, param)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def skeleton(build: Callable[[torch.dtype], torch.nn.Module], folder: Path) -> torch.nn.Module:
    """``build(dtype)`` with fake parameters of the checkpoint's dtype, remembering ``folder``'s
    checkpoint to read them from."""
    checkpoint = Checkpoint(folder)
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    dtype = checkpoint.dtype
    with _fake_parameters(mode, dtype):
        model = build(dtype)
    model.eval()
    object.__setattr__(model, "_qcompiler_checkpoint", checkpoint)  # not a submodule, not in the state
    _check_against_checkpoint(model, checkpoint)
    return model


def fake_mode_of(model: torch.nn.Module) -> Optional[FakeTensorMode]:
    """The fake mode of a skeleton's parameters (None for an ordinary model)."""
    return next((p.fake_mode for p in model.parameters() if isinstance(p, FakeTensor)), None)


def _check_against_checkpoint(model: torch.nn.Module, checkpoint: Checkpoint) -> None:
    """The same refusals as a full load: a missing tensor, one of the wrong shape, or an extra one."""
    keys = checkpoint_keys(model, checkpoint.file_of)
    folder = checkpoint.folder
    missing = sorted(n for n, k in keys.items() if k is None)
    if missing:
        raise ValueError(
            f"model folder {folder}: the checkpoint is missing {', '.join(missing[:3])}"
            + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        )
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, entry in keys.items():
        shape = checkpoint.shape_of_entry(entry)
        if tuple(params[name].shape) != shape:
            raise ValueError(
                f"model folder {folder}: the checkpoint has the wrong shape for {name} "
                f"({list(shape)}, the model expects {list(params[name].shape)})"
            )
    check_stored_dtypes(model, checkpoint, keys)
    buffers = {n for n, _ in model.named_buffers()}
    used = {k for entry in keys.values() for k in (entry.keys() if isinstance(entry, Converted) else [entry])}
    extra = sorted(set(checkpoint.file_of) - used - buffers)
    if extra:
        raise ValueError(
            f"model folder {folder}: the checkpoint holds tensors the model does not have: "
            f"{', '.join(extra[:3])}" + (f" and {len(extra) - 3} more" if len(extra) > 3 else "")
        )


def check_stored_dtypes(model: torch.nn.Module, checkpoint: Checkpoint, keys: Optional[dict] = None) -> None:
    """A floating-point parameter stored as an integer or boolean tensor is refused naming it (a
    load would cast the codes of a quantized or damaged checkpoint to floats without a word)."""
    keys = checkpoint_keys(model, checkpoint.file_of) if keys is None else keys
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, entry in keys.items():
        if entry is None or not params[name].is_floating_point():
            continue
        for key in entry.keys() if isinstance(entry, Converted) else [entry]:
            stored = checkpoint.stored_dtype[key]
            if stored not in _FLOAT_DTYPES:
                raise ValueError(
                    f"model folder {checkpoint.folder}: the checkpoint stores {key} as {stored}, not a "
                    f"floating-point type; the model's parameter {name} is floating point (a quantized or "
                    f"damaged checkpoint?)"
                )


@dataclass
class LazySource:
    """Where each placeholder of a captured graph comes from: the model's checkpoint, or a pass's
    results parked on disk (``files/spill.py``)."""

    checkpoint: Checkpoint
    keys: dict[str, Entry] = field(default_factory=dict)  # graph target -> checkpoint tensor(s)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    parked: dict[str, tuple[Parked, str]] = field(default_factory=dict)  # graph target -> (file, key)
    spills: list[Spill] = field(default_factory=list)  # the folders of those files, kept as long as the graph

    def __contains__(self, target: str) -> bool:
        return target in self.keys or target in self.parked

    def read(self, target: str) -> torch.Tensor:
        """The real tensor behind the placeholder at graph target ``target``."""
        if target in self.parked:
            file, key = self.parked[target]
            return file.read_one(key)
        return self.checkpoint.read_entry(self.keys[target], self.dtypes[target])


def attach(gm: GraphModule, model: torch.nn.Module) -> None:
    """Replace the fake tensors of ``gm`` (captured from the skeleton ``model``) by ``meta``
    placeholders read from the checkpoint on access."""
    checkpoint: Checkpoint = model._qcompiler_checkpoint
    by_name = checkpoint_keys(model, checkpoint.file_of)
    source = LazySource(checkpoint)
    for target, tensor in list(gm.state_dict(keep_vars=True).items()):
        if not isinstance(tensor, FakeTensor):
            continue
        if target not in by_name:
            raise ValueError(
                f"captured tensor {target} is not a parameter of {type(model).__name__}; "
                f"load the model without streaming"
            )
        source.keys[target], source.dtypes[target] = by_name[target], tensor.dtype
    gm.meta[LAZY_META_KEY] = source
    for target in source.keys:
        _set_placeholder(gm, target, get_raw_tensor(gm, target))


def lazy_source(gm: GraphModule) -> Optional[LazySource]:
    """The streamed-weights source of ``gm``, or None for a fully loaded model."""
    return gm.meta.get(LAZY_META_KEY)


def adopt_parked(gm: GraphModule, parked: Parked, values: dict[str, torch.Tensor]) -> None:
    """Swap the tensors a rewrite stored from ``values`` (read from the file ``parked``; found by
    identity) for placeholders read from that file on use. A tensor the rewrite derived from them
    (a new object) stays in memory as stored."""
    source = lazy_source(gm)
    by_id = {id(t): key for key, t in values.items()}
    for target, tensor in list(gm.named_buffers()):
        key = by_id.get(id(tensor))
        if key is not None:
            source.parked[target] = (parked, key)
            _set_placeholder(gm, target, tensor)


def keep_spill(gm: GraphModule, spill: Spill) -> None:
    """Keep ``spill``'s files while the graph may read them (closed by ``materialize_all``)."""
    lazy_source(gm).spills.append(spill)


def _set_placeholder(gm: GraphModule, target: str, like: torch.Tensor) -> None:
    placeholder = torch.empty(like.shape, dtype=like.dtype, device="meta")
    set_tensor(gm, target, placeholder, parameter=isinstance(like, torch.nn.Parameter))
    get_raw_tensor(gm, target)._qcompiler_placeholder = True  # told apart from a meta tensor a pass stored


def release(gm: GraphModule, target: str) -> None:
    """Drop a tensor a pass stored (a dequantized weight whose node is about to be rewritten):
    it becomes a ``meta`` placeholder — streamed or not, nothing may read it again (the user's
    own parameter is untouched; the graph only held the pass's dequantized copy)."""
    _set_placeholder(gm, target, get_raw_tensor(gm, target))


def materialize_all(gm: GraphModule, log: Callable[[str], None] = lambda _m: None) -> int:
    """Read every placeholder the graph still uses; the graph no longer needs the checkpoint."""
    source = lazy_source(gm)
    if source is None:
        return 0
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for target in sorted(used):
        value = get_raw_tensor(gm, target)
        if isinstance(value, torch.Tensor) and value.is_meta and not getattr(value, "_qcompiler_placeholder", False):
            raise PassError(
                f"a pass stored a tensor without data at {target}: it computed on a streamed weight's "
                f"placeholder (read weights with qcompiler.ir.graph.get_tensor or layer.weight(gm), "
                f"not gm.get_parameter)"
            )
    todo = [t for t in used if t in source and get_raw_tensor(gm, t).is_meta]
    kept = sum(t not in source.parked for t in todo)
    if kept:
        log(f"reading {kept} tensors kept in full precision from {source.checkpoint.folder}")
    if len(todo) > kept:
        log(f"reading {len(todo) - kept} quantized tensors back from the spill")
    for target in todo:
        set_tensor(
            gm, target, source.read(target), parameter=isinstance(get_raw_tensor(gm, target), torch.nn.Parameter)
        )
    stale = [t for t, v in gm.state_dict().items() if v.is_meta]
    del gm.meta[LAZY_META_KEY]
    for spill in source.spills:
        spill.close()
    if stale:  # placeholders no node reads any more (rewritten layers): drop them
        for target in stale:
            drop_tensor(gm, target)
    return len(todo)
