"""FP8: e4m3 weights with an fp32 scale per output channel or per 128 × 128 block — ``qc.fp8_linear``,
optionally with FP8 activations: quantized at run time (per token, or per token and 128 inputs:
compressed-tensors' FP8-dynamic and FP8-block schemes) or with one calibrated static scale per
tensor (its FP8 scheme's activations: ``input_scale``, no reduction at run time).

``weight_fp8`` float8_e4m3fn ``[out, in]``; ``weight_scale`` float32 ``[out, 1]`` (per channel,
``block=0``) or ``[⌈out/128⌉, ⌈in/128⌉]`` (``block=128``). On CPU the op dequantizes and multiplies in
float32: the products of FP8 values are exact there, so it is the reference an FP8 GEMM with fp32
accumulation is checked against.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from qcompiler.algorithms.float_grid import FLOAT_FORMATS, FloatQuant, dequantize, round_to_element
from qcompiler.errors import QuantizationError
from qcompiler.ir.graph import LinearLayer
from qcompiler.ir.graph_property import GraphProperty
from qcompiler.ir.op_registry import OpSpec, expect_stored, register
from qcompiler.layouts.base import LayerQuant, LayerRewrite, Layout, linear_rewrite, register_layout

__all__ = ["FP8", "FP8_ACTIVATIONS", "fp8_linear", "dequantize_fp8", "quantize_fp8_activations", "fp8_layer"]

# "none": weight-only (W8A16); "token": one dynamic scale per token; "group": one per token and 128
# inputs; "static": one calibrated scale per tensor (``input_scale``)
FP8_ACTIVATIONS = ("none", "token", "group", "static")
ACTIVATION_GROUP = 128


def dequantize_fp8(weight_fp8: Tensor, weight_scale: Tensor, block: int) -> Tensor:
    """The float32 weight ``[out, in]`` the stored tensors stand for."""
    fmt = FLOAT_FORMATS["fp8-block" if block else "fp8"]
    return dequantize(weight_fp8, weight_scale, fmt)


def quantize_fp8_activations(x: Tensor, activations: str, input_scale: Optional[Tensor] = None) -> Tensor:
    """``x`` (float32) rounded to e4m3 with a dynamic scale ``max|x| / 448`` per token (``"token"``)
    or per token and group of 128 inputs (``"group"``), or with the calibrated ``input_scale``
    (``"static"``, saturating at ±448 steps): the values an FP8 GEMM multiplies."""
    if activations == "none":
        return x
    if activations == "static":
        if input_scale is None:
            raise QuantizationError("static FP8 activations need an input_scale")
        scale = input_scale.float().reshape(())
        return round_to_element(x / scale, "e4m3") * scale
    shape = x.shape
    if activations == "group":
        if shape[-1] % ACTIVATION_GROUP:
            raise QuantizationError(f"FP8 group activations need inputs in multiples of 128, got {shape[-1]}")
        x = x.reshape(*shape[:-1], shape[-1] // ACTIVATION_GROUP, ACTIVATION_GROUP)
    scale = x.abs().amax(dim=-1, keepdim=True) / 448.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (round_to_element(x / scale, "e4m3") * scale).reshape(shape)


@torch.library.custom_op("qc::fp8_linear", mutates_args=())
def fp8_linear(
    x: Tensor,
    weight_fp8: Tensor,
    weight_scale: Tensor,
    bias: Optional[Tensor],
    block: int,
    activations: str,
    input_scale: Optional[Tensor] = None,
) -> Tensor:
    """FP8 linear: e4m3 weights (per channel or per block scales); activations as they come
    (``"none"``) or rounded to e4m3 per token / per token-group / with the static ``input_scale`` first."""
    w = dequantize_fp8(weight_fp8, weight_scale, block)
    if activations == "none":
        return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
    xq = quantize_fp8_activations(x.float(), activations, input_scale)
    return F.linear(xq, w, None if bias is None else bias.float()).to(x.dtype)


@fp8_linear.register_fake
def _fp8_linear_fake(x, weight_fp8, weight_scale, bias, block, activations, input_scale=None):
    return x.new_empty((*x.shape[:-1], weight_fp8.shape[0]))


def _validate(a, gm) -> None:
    """e4m3 weights and a float scale per channel (``block`` 0) or per 128 x 128 block; an fp32
    ``input_scale`` ``[1]`` exactly when the activations are static."""
    if a.block not in (0, 128) or a.activations not in FP8_ACTIVATIONS:
        raise ValueError(f"block={a.block!r}, activations={a.activations!r} (block 0 or 128; {FP8_ACTIVATIONS})")
    if (a.activations == "static") != (a.input_scale is not None):
        raise ValueError(f"activations={a.activations!r} with{'out' if a.input_scale is None else ''} an input_scale")
    if a.input_scale is not None:
        expect_stored(a, gm, "input_scale", (torch.float32,), (1,))
    out, n_in = expect_stored(a, gm, "weight_fp8", (torch.float8_e4m3fn,))
    cells = (out, 1) if a.block == 0 else (-(-out // a.block), -(-n_in // a.block))
    expect_stored(a, gm, "weight_scale", (torch.float32, torch.bfloat16, torch.float16), cells)


register(
    OpSpec(
        "fp8_linear",
        storage=("weight_fp8", "weight_scale"),
        weights=lambda a, gm: a.stored_like(gm, "weight_fp8").numel(),
        establishes=frozenset({GraphProperty.QUANTIZED_WEIGHTS}),
        validate=_validate,
    )
)


def fp8_layer(layer: LinearLayer, res: FloatQuant, block: bool, figures: dict) -> LayerQuant:
    """An FP8 solve (``float_grid`` elements and scales) as ``qc.fp8_linear``, weight-only."""
    tensors = {"weight_fp8": res.elements.to(torch.float8_e4m3fn), "weight_scale": res.scales.float()}
    rewrite = LayerRewrite("fp8", {"block": 128 if block else 0, "activations": "none"})
    return LayerQuant(res.dequantized, {**figures, "bits": 8}, tensors, rewrite, res.damped_error)


def _join_rows(parts: list[dict], constants: list[dict]) -> tuple[dict, dict, dict]:
    """Rows (of 128 for blocks) follow one another in both tensors."""
    return {k: torch.cat([t[k] for t in parts], dim=0) for k in ("weight_fp8", "weight_scale")}, constants[0], {}


FP8 = register_layout(
    Layout(
        "fp8",
        linear_op="fp8_linear",
        ops=("fp8_linear",),
        rewrite=linear_rewrite("fp8_linear"),  # constants: block, activations
        row_unit=128,
        row_join=_join_rows,
        description="FP8: e4m3 weights, fp32 scales per channel or per 128x128 block; optional FP8 activations",
    )
)
