"""A storage layout as one registered thing: its ops, how a solved layer becomes them, how row
ranges of a layer solved on several ranks join, and how experts stack.

A layout is the part of quantization this field changes most often (GPTQ's packed int32 words,
llama.cpp's block bytes, SpQR's dense + sparse pair, int8; FP8, NVFP4, MXFP4 and codebooks next).
Each lives in one file of ``qcompiler/layouts/`` and registers a :class:`Layout` here; a weight
method (a pass) produces :class:`LayerQuant` results naming a layout through :class:`LayerRewrite`,
which is data — a layout name and JSON constants — so the same rewrite runs in one process, on
every rank of a distributed run and from a resumed run's records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
from torch.fx import GraphModule

from qcompiler.algorithms.packing import packed_length
from qcompiler.errors import QuantizationError
from qcompiler.ir.graph import LinearLayer
from qcompiler.ir.node_swap import replace_linear
from qcompiler.ir.op_registry import expect_stored, spec, storage_ops
from qcompiler.ir.tensors import set_tensor

__all__ = [
    "Layout",
    "register_layout",
    "layout",
    "layouts",
    "LayerRewrite",
    "LayerQuant",
    "QuantizeFn",
    "ExpertsFormat",
    "UnpackableLayer",
    "stored_bits",
    "store_dequantized",
    "check_packable",
    "same_in_every_range",
    "linear_rewrite",
    "expect_fp4_pairs",
]

# (tensors of each row range in row order, their rewrite constants) -> (tensors, constants, figures)
RowJoin = Callable[[list[dict], list[dict]], tuple[dict, dict, dict]]


@dataclass(frozen=True)
class Layout:
    """One storage layout. ``rewrite(gm, layer, tensors, **constants)`` swaps a linear's node for
    the layout's op(s); ``row_join`` joins a layer solved in row ranges (None: whole layers only);
    ``row_unit``: the rows a range must be a multiple of (packed words along the outputs);
    ``experts_stack(results)`` gives ``(op, tensors, constants)`` for a mixture-of-experts
    parameter's experts in expert order (None: experts stay in full precision); ``ops``: every op
    a graph in this layout may hold (the coverage test asks every target about each)."""

    name: str
    linear_op: str
    ops: tuple[str, ...]
    rewrite: Callable[..., None]
    row_unit: int = 1
    row_join: Optional[RowJoin] = None
    experts_op: Optional[str] = None
    experts_stack: Optional[Callable[[list["LayerQuant"]], tuple[str, dict, dict]]] = None
    aliases: tuple[str, ...] = ()  # names earlier releases recorded for it (a resumed run's records)
    description: str = ""


_LAYOUTS: dict[str, Layout] = {}
_ALIASES: dict[str, str] = {}


def register_layout(new: Layout) -> Layout:
    """Add ``new`` (its ops must already be registered op specs)."""
    for op in new.ops:
        spec(op)  # a KeyError naming the op when the layout's file forgot to register it
    if new.linear_op not in new.ops or (new.experts_op is not None and new.experts_op not in new.ops):
        raise ValueError(f"layout {new.name}: its linear and experts ops must be among its ops {new.ops}")
    _LAYOUTS[new.name] = new
    for alias in new.aliases:
        _ALIASES[alias] = new.name
    return new


def layout(name: str) -> Layout:
    """The layout called ``name`` (or one of its earlier names), or a one-line error listing them."""
    found = _LAYOUTS.get(_ALIASES.get(name, name))
    if found is None:
        raise QuantizationError(f"no storage layout {name!r} (layouts: {', '.join(sorted(_LAYOUTS))})")
    return found


def layouts() -> dict[str, Layout]:
    """Every registered layout by name."""
    return dict(_LAYOUTS)


class LayerRewrite(NamedTuple):
    """How the final rewrite swaps a solved layer's node: a layout's name and its rewrite's
    constants (JSON values). Data, not a closure: a layer solved by one rank of a distributed run
    is rewritten on every rank, and a resumed run rewrites it from its records."""

    layout: str
    constants: dict

    def __call__(self, gm: GraphModule, layer: LinearLayer, tensors: dict) -> None:
        """Swap ``layer``'s node for the layout's op(s) storing ``tensors``."""
        layout(self.layout).rewrite(gm, layer, tensors, **self.constants)


class LayerQuant(NamedTuple):
    """What a method made of one layer (its tensors may live on the compute device: the caller moves
    ``tensors`` to where the graph's weights live before the rewrite stores them)."""

    dequantized: torch.Tensor  # [out, in]: what the stored tensors stand for
    figures: dict  # per-layer report entries
    tensors: dict  # name -> tensor the rewrite stores
    rewrite: LayerRewrite  # which layout's op(s) the node becomes, with its constants
    damped_error: Optional[tuple[float, float]] = None  # GPTQ's (‖E‖², λ): output_error without a GEMM


QuantizeFn = Callable[[LinearLayer, torch.Tensor, Optional[torch.Tensor]], LayerQuant]


class ExpertsFormat(NamedTuple):
    """How a method quantizes a mixture-of-experts parameter's expert that no calibration row
    reached (``no_tokens``, described as ``no_tokens_name``); the experts are stacked by the
    layout their results name."""

    no_tokens: QuantizeFn
    no_tokens_name: str


class UnpackableLayer(QuantizationError):
    """A layer whose shape the packed layout cannot hold: it is skipped with a note, the rest quantize."""


def linear_rewrite(op_name: str) -> Callable[..., None]:
    """The rewrite of a layout whose one op takes the linear's input, its stored tensors, the
    linear's bias and the rewrite's constants by name (GPTQ's, llama.cpp's): ``op_name`` in the
    linear's place, its tensors stored beside it."""

    def rewrite(gm: GraphModule, layer: LinearLayer, tensors: dict, **constants) -> None:
        replace_linear(gm, layer, op_name, tensors, lambda x, a: dict(x=x, **a, bias=layer.bias_node, **constants))

    return rewrite


def stored_bits(tensors: dict[str, torch.Tensor]) -> int:
    """Bits of the tensors a layer's result stores, counted as ``bits_per_parameter`` counts them
    (the ops' storage arguments: codes, scales, zeros, outliers; not per-column indices)."""
    storage = {name for s in storage_ops() for name in s.storage}
    return sum(t.numel() * t.element_size() * 8 for k, t in tensors.items() if k in storage)


def check_packable(layer: LinearLayer, W: torch.Tensor, bits: int, layout_name: str = "GPTQ") -> None:
    """Raise UnpackableLayer when codes packed in int32 words cannot hold ``W`` at ``bits``."""
    for dim, size in (("in_features", W.shape[1]), ("out_features", W.shape[0])):
        try:
            packed_length(size, bits)
        except ValueError as exc:
            raise UnpackableLayer(
                f"layer {layer.path}: {dim}={size} cannot be stored in the {layout_name} layout at {bits} bits ({exc})"
            ) from None


def store_dequantized(gm: GraphModule, layer: LinearLayer, W_hat: torch.Tensor, like: torch.Tensor) -> None:
    """Quantization runs in fp32 (on the compute device); the stored weight keeps the model's dtype
    (fp16/bf16 models) and stays where the model's weights live."""
    W_hat = W_hat.t() if layer.transposed else W_hat
    set_tensor(gm, layer.weight_node.target, W_hat.to(device=like.device, dtype=like.dtype).contiguous())


def expect_fp4_pairs(a, gm: GraphModule, group: int, scale_dtype: torch.dtype) -> tuple[int, int]:
    """``(out, in)`` of an FP4 layout's node (NVFP4, MXFP4): uint8 ``weight_packed`` ``[out, in/2]``
    and ``weight_scale`` ``[out, in/group]`` in ``scale_dtype``; ValueError otherwise."""
    out, half = expect_stored(a, gm, "weight_packed", (torch.uint8,))
    if (2 * half) % group:
        raise ValueError(f"weight_packed holds {2 * half} inputs, not a multiple of {group}")
    expect_stored(a, gm, "weight_scale", (scale_dtype,), (out, 2 * half // group))
    return out, 2 * half


def same_in_every_range(name: str, parts: list[dict]) -> torch.Tensor:
    """A tensor every row range stores alike (per input column: g_idx, perm)."""
    first = parts[0][name]
    if any(not torch.equal(first, t[name]) for t in parts[1:]):
        raise QuantizationError(f"row ranges of one layer disagree on {name}")
    return first
