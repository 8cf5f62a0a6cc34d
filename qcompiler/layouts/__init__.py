"""Storage layouts, one file each: a layout's ops (spec, fake, plain-torch twin), packing, the
rewrite that puts them in a linear's place, the join of row ranges solved on several ranks, and
the stack of a mixture-of-experts parameter's experts (``base.py`` says what a layout is).

This room sits between ``ir/`` (graphs, the op registry) and ``pipeline/`` (the block walk, which
calls a layout through the ``LayerRewrite`` a method returns). Importing it registers every
layout and its ops.
"""

from qcompiler.layouts import fp8, gguf, gptq, gptq_embedding, int8, mxfp4, nvfp4, spqr  # noqa: F401  (each registers its ops)
from qcompiler.layouts.base import (
    ExpertsFormat,
    LayerQuant,
    LayerRewrite,
    Layout,
    QuantizeFn,
    UnpackableLayer,
    check_packable,
    layout,
    layouts,
    linear_rewrite,
    register_layout,
    same_in_every_range,
    store_dequantized,
    stored_bits,
)

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
]
