"""MXFP4 (OCP microscaling): e2m1 weights packed two per byte and a power-of-two e8m0 scale per 32
inputs — ``qc.mxfp4_linear`` (compressed-tensors' ``mxfp4-pack-quantized``, 4.25 bits per weight).

``weight_packed`` uint8 ``[out, in/2]`` (input ``2k`` in the low nibble), ``weight_scale`` uint8
``[out, in/32]`` holding the biased exponent: a weight is ``e2m1 · 2^(weight_scale − 127)``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from qcompiler.algorithms.float_grid import FLOAT_FORMATS, FloatQuant, dequantize, pack_e2m1, unpack_e2m1
from qcompiler.ir.graph import LinearLayer
from qcompiler.ir.graph_property import GraphProperty
from qcompiler.ir.op_registry import OpSpec, register
from qcompiler.layouts.base import LayerQuant, LayerRewrite, Layout, expect_fp4_pairs, linear_rewrite, register_layout

__all__ = ["MXFP4", "mxfp4_linear", "dequantize_mxfp4", "mxfp4_layer"]

MXFP4_FORMAT = FLOAT_FORMATS["mxfp4"]


def dequantize_mxfp4(weight_packed: Tensor, weight_scale: Tensor) -> Tensor:
    """The float32 weight ``[out, in]`` the stored tensors stand for."""
    n_in = weight_scale.shape[1] * MXFP4_FORMAT.group
    return dequantize(unpack_e2m1(weight_packed, n_in), weight_scale, MXFP4_FORMAT)


@torch.library.custom_op("qc::mxfp4_linear", mutates_args=())
def mxfp4_linear(x: Tensor, weight_packed: Tensor, weight_scale: Tensor, bias: Optional[Tensor]) -> Tensor:
    """Weight-only MXFP4 linear (W4A16): dequantize, then an ordinary matmul."""
    w = dequantize_mxfp4(weight_packed, weight_scale).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


@mxfp4_linear.register_fake
def _mxfp4_linear_fake(x, weight_packed, weight_scale, bias):
    return x.new_empty((*x.shape[:-1], weight_packed.shape[0]))


def _validate(a, gm) -> None:
    """e2m1 pairs ``[out, in/2]`` and e8m0 exponents ``[out, in/32]``."""
    expect_fp4_pairs(a, gm, MXFP4_FORMAT.group, torch.uint8)


register(
    OpSpec(
        "mxfp4_linear",
        storage=("weight_packed", "weight_scale"),
        weights=lambda a, gm: a.stored_like(gm, "weight_packed").numel() * 2,
        establishes=frozenset({GraphProperty.QUANTIZED_WEIGHTS}),
        validate=_validate,
    )
)


def mxfp4_layer(layer: LinearLayer, res: FloatQuant, figures: dict) -> LayerQuant:
    """An MXFP4 solve (``float_grid`` elements and scales) as ``qc.mxfp4_linear``."""
    tensors = {"weight_packed": pack_e2m1(res.elements), "weight_scale": res.scales}
    return LayerQuant(res.dequantized, {**figures, "bits": 4}, tensors, LayerRewrite("mxfp4", {}), res.damped_error)


def _join_rows(parts: list[dict], constants: list[dict]) -> tuple[dict, dict, dict]:
    """One scale row per output row: ranges of rows follow one another."""
    return {k: torch.cat([t[k] for t in parts], dim=0) for k in ("weight_packed", "weight_scale")}, constants[0], {}


MXFP4 = register_layout(
    Layout(
        "mxfp4",
        linear_op="mxfp4_linear",
        ops=("mxfp4_linear",),
        rewrite=linear_rewrite("mxfp4_linear"),
        row_unit=1,
        row_join=_join_rows,
        description="MXFP4: e2m1 pairs in bytes, a power-of-two (e8m0) scale per 32 inputs",
    )
)
