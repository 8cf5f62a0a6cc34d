"""The facts about a graph that passes establish and depend on.

They live in ``ir/`` because ops witness them (an op spec says which properties a node of it
establishes) and ops sit below the pass machinery; ``pipeline/pass_base.py`` re-exports them for
passes."""

from __future__ import annotations

import enum

__all__ = ["GraphProperty"]


class GraphProperty(enum.Enum):
    """Facts about a graph that passes establish and depend on."""

    CAPTURED = "captured"  # an aten-level export graph (always true at start)
    SMOOTHED = "smoothed"  # SmoothQuant scales folded in
    ROTATED = "rotated"  # orthogonal rotations folded in (outputs unchanged)
    QUANTIZED_WEIGHTS = "quantized_weights"  # linears replaced by weight-quantized ops
    QUANTIZED_EMBEDDINGS = "quantized_embeddings"  # embedding tables stored quantized (qc.quant_embedding)
    INT8_LOWERED = "int8_lowered"  # linears replaced by int8 x int8 ops
    OUTLIERS_SPLIT = "outliers_split"  # SpQR dense + sparse branches
    FP8_ACTIVATIONS = "fp8_activations"  # FP8 linears quantize their inputs to e4m3 at run time
    FP4_ACTIVATIONS = "fp4_activations"  # NVFP4 linears quantize their inputs to e2m1 (W4A4)
    FP8_KV_CACHE = "fp8_kv_cache"  # attention reads keys and values as an FP8 cache holds them
