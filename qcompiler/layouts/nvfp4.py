"""NVFP4: e2m1 weights packed two per byte, an e4m3 scale per 16 inputs and one fp32 global scale
per tensor — ``qc.nvfp4_linear`` (compressed-tensors' ``nvfp4-pack-quantized``, 4.5 bits per weight
plus 32 per tensor).

``weight_packed`` uint8 ``[out, in/2]`` (input ``2k`` in the low nibble), ``weight_scale``
float8_e4m3fn ``[out, in/16]`` in global-scaled units, ``weight_global_scale`` float32 ``[1]``:
a weight is ``e2m1 · weight_scale / weight_global_scale`` (compressed-tensors' convention;
ModelOpt's checkpoints store the reciprocal global scale).

W4A4: with an ``input_global_scale`` (fp32 ``[1]``, ``448 · 6 / max|x|`` over calibration) the
inputs are rounded to NVFP4 at run time too, on the same rule as the weights: an e4m3 scale per 16
inputs of each token, computed from the token in global-scaled units (compressed-tensors' NVFP4
scheme, ``dynamic: local``; what a Blackwell FP4 GEMM multiplies).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from qcompiler.algorithms.float_grid import (
    FLOAT_FORMATS,
    FloatQuant,
    dequantize,
    effective_scales,
    fit_scales,
    pack_e2m1,
    per_element,
    quantize_elements,
    unpack_e2m1,
)
from qcompiler.ir.graph import LinearLayer, find_linears, find_siblings, source_of
from qcompiler.ir.graph_property import GraphProperty
from qcompiler.ir.op_registry import OpSpec, expect_stored, register
from qcompiler.layouts.base import LayerQuant, LayerRewrite, Layout, expect_fp4_pairs, linear_rewrite, register_layout

__all__ = [
    "NVFP4",
    "nvfp4_linear",
    "dequantize_nvfp4",
    "quantize_nvfp4_activations",
    "nvfp4_layer",
    "fused_global_amax",
]

NVFP4_FORMAT = FLOAT_FORMATS["nvfp4"]


def dequantize_nvfp4(weight_packed: Tensor, weight_scale: Tensor, weight_global_scale: Tensor) -> Tensor:
    """The float32 weight ``[out, in]`` the stored tensors stand for."""
    n_in = weight_scale.shape[1] * NVFP4_FORMAT.group
    return dequantize(unpack_e2m1(weight_packed, n_in), weight_scale, NVFP4_FORMAT, weight_global_scale)


def quantize_nvfp4_activations(x: Tensor, input_global_scale: Tensor) -> Tensor:
    """``x`` (float32 ``[..., in]``, ``in`` a multiple of 16) on the NVFP4 grid: per token and 16
    inputs an e4m3 scale ``max|x| / 6`` in units of ``input_global_scale`` (saturating at 448), the
    elements rounded to e2m1 — the values an FP4 GEMM multiplies."""
    rows = x.reshape(-1, x.shape[-1])
    g = input_global_scale.float().reshape(1)
    scale = per_element(effective_scales(fit_scales(rows, NVFP4_FORMAT, g), NVFP4_FORMAT, g), NVFP4_FORMAT, rows.shape)
    return (quantize_elements(rows, scale, NVFP4_FORMAT.element) * scale).reshape(x.shape)


@torch.library.custom_op("qc::nvfp4_linear", mutates_args=())
def nvfp4_linear(
    x: Tensor,
    weight_packed: Tensor,
    weight_scale: Tensor,
    weight_global_scale: Tensor,
    bias: Optional[Tensor],
    input_global_scale: Optional[Tensor] = None,
) -> Tensor:
    """NVFP4 linear: weight-only (W4A16: dequantize, then an ordinary matmul), or W4A4 with an
    ``input_global_scale`` (the inputs rounded to NVFP4 first, the product in float32)."""
    w = dequantize_nvfp4(weight_packed, weight_scale, weight_global_scale)
    if input_global_scale is None:
        return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
    xq = quantize_nvfp4_activations(x.float(), input_global_scale)
    return F.linear(xq, w, None if bias is None else bias.float()).to(x.dtype)


@nvfp4_linear.register_fake
def _nvfp4_linear_fake(x, weight_packed, weight_scale, weight_global_scale, bias, input_global_scale=None):
    return x.new_empty((*x.shape[:-1], weight_packed.shape[0]))


def _validate(a, gm) -> None:
    """e2m1 pairs ``[out, in/2]``, e4m3 scales ``[out, in/16]``, one fp32 global scale (and one for
    the inputs, W4A4)."""
    expect_fp4_pairs(a, gm, NVFP4_FORMAT.group, torch.float8_e4m3fn)
    expect_stored(a, gm, "weight_global_scale", (torch.float32,), (1,))
    if a.input_global_scale is not None:
        expect_stored(a, gm, "input_global_scale", (torch.float32,), (1,))


register(
    OpSpec(
        "nvfp4_linear",
        storage=("weight_packed", "weight_scale", "weight_global_scale"),
        weights=lambda a, gm: a.stored_like(gm, "weight_packed").numel() * 2,
        establishes=frozenset({GraphProperty.QUANTIZED_WEIGHTS}),
        validate=_validate,
    )
)


# GraphModule -> {source node name: max|W| over the linears reading it}, filled from the FP weights
_SIBLING_AMAX: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def fused_global_amax(layer: LinearLayer) -> Optional[float]:
    """max|W| over every linear that reads ``layer``'s input (q/k/v; gate/up), from the weights as
    they are when the first of them asks — before any of them is solved, so all get one value.

    vLLM fuses those layers into one (qkv_proj, gate_up_proj) and keeps a single global scale for
    it, the largest of theirs (its compressed-tensors NVFP4 schemes take ``weight_global_scale.max()``);
    a layer whose own global scale was smaller would be read with the wrong one. llm-compressor
    shares the scale across the same layers for the same reason. None (the layer's own) for a
    layer outside a graph."""
    gm = getattr(getattr(getattr(layer, "weight_node", None), "graph", None), "owning_module", None)
    if gm is None:
        return None
    cache = _SIBLING_AMAX.setdefault(gm, {})
    key = source_of(layer.input).name
    if key not in cache:
        siblings = find_siblings(find_linears(gm), layer) or [layer]
        cache[key] = max(float(s.weight(gm).detach().abs().amax()) for s in siblings)
    return cache[key]


def nvfp4_layer(layer: LinearLayer, res: FloatQuant, figures: dict) -> LayerQuant:
    """An NVFP4 solve (``float_grid`` elements and scales) as ``qc.nvfp4_linear``."""
    tensors = {
        "weight_packed": pack_e2m1(res.elements),
        "weight_scale": res.scales,
        "weight_global_scale": res.global_scale.float().reshape(1),
    }
    return LayerQuant(res.dequantized, {**figures, "bits": 4}, tensors, LayerRewrite("nvfp4", {}), res.damped_error)


NVFP4 = register_layout(
    Layout(
        "nvfp4",
        linear_op="nvfp4_linear",
        ops=("nvfp4_linear",),
        rewrite=linear_rewrite("nvfp4_linear"),
        description="NVFP4: e2m1 pairs in bytes, e4m3 scales per 16 inputs, an fp32 global scale per tensor",
    )
)
