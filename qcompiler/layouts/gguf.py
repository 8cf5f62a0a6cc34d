"""llama.cpp's block bytes as they are written to a GGUF file (Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, Q4_0,
Q4_1, Q5_1, Q8_0) — ``qc.gguf_linear``: the layout of grids whose minima are not integer zero
points, one byte row per output row (docs/formats.md).

A GPTQ-family solve on a llama.cpp grid (``QuantResult.gguf_grid``) is stored here by
:func:`gguf_layer`; :func:`layer_grid` picks the 32-column fallback grid where a super-block grid
cannot hold a layer's width.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from qcompiler.algorithms.gguf_bytes import dequantize as dequantize_blocks
from qcompiler.algorithms.gguf_bytes import pack
from qcompiler.algorithms.gguf_grids import BY_NAME, FORMATS, GRID_FALLBACK
from qcompiler.algorithms.gptq import GGUF_GRIDS, QuantResult
from qcompiler.ir.graph import LinearLayer
from qcompiler.ir.graph_property import GraphProperty
from qcompiler.ir.op_registry import OpSpec, expect_stored, register
from qcompiler.layouts.base import LayerQuant, LayerRewrite, Layout, UnpackableLayer, linear_rewrite, register_layout

__all__ = [
    "GGUF",
    "GGUF_BLOCK_TYPES",
    "dequantize_gguf",
    "gguf_linear",
    "gguf_layer",
    "layer_grid",
    "grid_settings",
]

QUANTIZED = frozenset({GraphProperty.QUANTIZED_WEIGHTS})

GGUF_BLOCK_TYPES = tuple(f.name for f in FORMATS.values())  # llama.cpp block types qc.gguf_linear holds


def dequantize_gguf(blocks: Tensor, block_type: str, in_features: int) -> Tensor:
    """The float32 weight ``[out, in]`` that llama.cpp block bytes ``[out, ·]`` of ``block_type`` stand for."""
    if block_type not in GGUF_BLOCK_TYPES:
        raise ValueError(f"block_type {block_type!r} is not one qc.gguf_linear holds ({', '.join(GGUF_BLOCK_TYPES)})")
    return dequantize_blocks(block_type, blocks, in_features)


@torch.library.custom_op("qc::gguf_linear", mutates_args=())
def gguf_linear(x: Tensor, blocks: Tensor, bias: Optional[Tensor], block_type: str, in_features: int) -> Tensor:
    """Weight-only linear on llama.cpp's block bytes as they are written to a GGUF file (Q4_K, Q4_1:
    grids whose minima are not integer zero points): dequantize, then an ordinary matmul."""
    w = dequantize_gguf(blocks, block_type, in_features).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


@gguf_linear.register_fake
def _gguf_linear_fake(x, blocks, bias, block_type, in_features):
    return x.new_empty((*x.shape[:-1], blocks.shape[0]))


def _validate(a, gm) -> None:
    """A block type qc.gguf_linear holds, and one byte row per output row of its width."""
    fmt = BY_NAME.get(a.block_type) if isinstance(a.block_type, str) else None
    if fmt is None:
        raise ValueError(f"block_type {a.block_type!r} is not one qc.gguf_linear holds ({', '.join(GGUF_BLOCK_TYPES)})")
    n_in = int(a.in_features)
    if n_in <= 0 or n_in % fmt.super_block:
        raise ValueError(f"in_features={n_in} is not a positive multiple of {fmt.name}'s {fmt.super_block}")
    out = a.stored_like(gm, "blocks").shape[0]
    expect_stored(a, gm, "blocks", (torch.uint8,), (out, n_in // fmt.super_block * fmt.block_bytes))


register(
    OpSpec(
        "gguf_linear",
        storage=("blocks",),
        weights=lambda a, gm: a.stored_like(gm, "blocks").shape[0] * a.in_features,
        establishes=QUANTIZED,
        validate=_validate,
    )
)


def grid_settings(grid: str, bits: int, group_size: int) -> tuple[int, int]:
    """``(bits, group_size)`` a layer on ``grid`` is solved with: a llama.cpp grid's own (a fallback's
    may differ from the recipe's: Q3_K's 3 bits per 16 columns fall back to Q4_0's 4 per 32)."""
    return (FORMATS[grid].bits, FORMATS[grid].sub_block) if grid in FORMATS else (bits, group_size)


def layer_grid(layer: LinearLayer, W: Tensor, grid: str) -> str:
    """The grid ``layer`` is quantized on: ``grid``, or where a llama.cpp super-block grid cannot hold
    ``W``'s width, its 32-column fallback (``GRID_FALLBACK``); UnpackableLayer, before any solve,
    when neither holds it."""
    if grid not in GGUF_GRIDS or W.shape[1] % FORMATS[grid].super_block == 0:
        return grid
    fallback = GRID_FALLBACK.get(grid)
    if fallback is not None and W.shape[1] % FORMATS[fallback].super_block == 0:
        return fallback
    fmt = FORMATS[grid]
    raise UnpackableLayer(
        f"layer {layer.path}: in_features={W.shape[1]} is not a multiple of {fmt.super_block}, "
        f"llama.cpp's {fmt.name} block"
    )


def gguf_layer(res: QuantResult, asked: str, grid: str, figures: dict) -> LayerQuant:
    """A llama.cpp grid's result as its block bytes; the dequantized weight is read back from them,
    so calibration of later blocks sees exactly what the op computes. ``grid``: the one used,
    ``asked``'s fallback where the width needed one (the figures note it)."""
    block_type = FORMATS[grid].name
    blocks = pack(grid, res.codes, res.gguf_grid)
    n_in = res.codes.shape[1]
    figures = {**figures, "bits": FORMATS[grid].bits, "grid": block_type}
    if grid != asked:
        fmt = FORMATS[asked]
        figures["grid_fallback"] = (
            f"{block_type} for {fmt.name} (in_features={n_in} is not a multiple of {fmt.super_block})"
        )
    rewrite = LayerRewrite("gguf", {"block_type": block_type, "in_features": n_in})
    return LayerQuant(dequantize_gguf(blocks, block_type, n_in), figures, {"blocks": blocks}, rewrite, res.damped_error)


def _join_rows(parts: list[dict], constants: list[dict]) -> tuple[dict, dict, dict]:
    """One byte row per output row: ranges of rows follow one another."""
    return {"blocks": torch.cat([t["blocks"] for t in parts], dim=0)}, constants[0], {}


GGUF = register_layout(
    Layout(
        "gguf",
        linear_op="gguf_linear",
        ops=("gguf_linear",),
        rewrite=linear_rewrite("gguf_linear"),  # constants: block_type, in_features
        row_unit=1,
        row_join=_join_rows,
        aliases=("gguf_linear",),
        description="llama.cpp block bytes (Q4_K, Q6_K, Q4_1, ...), one byte row per output row",
    )
)
