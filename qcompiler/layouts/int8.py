"""W8A8: int8 weights per output channel, int8 activations (per token at run time, or one static
scale), int32 accumulation — ``qc.int8_linear`` (made by the ``LowerInt8`` pass, which fuses an
explicit SmoothQuant ``1/s`` into the activation quantizer).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.fx import GraphModule, Node

from qcompiler.algorithms.int8 import quantize_per_token
from qcompiler.ir.graph import LinearLayer
from qcompiler.ir.graph_property import GraphProperty
from qcompiler.ir.node_swap import replace_linear
from qcompiler.ir.op_registry import OpSpec, expect_stored, register
from qcompiler.layouts.base import Layout, register_layout

__all__ = [
    "INT8",
    "int8_matmul",
    "int8_linear",
    "quantize_activations",
    "int8_linear_quantized",
]


def int8_matmul(xq: Tensor, wq: Tensor) -> Tensor:
    """Exact int8 × int8 → int32 product ``xq @ wq.T`` (int32 accumulation).

    CPU: ``torch._int_mm`` (oneDNN's int8 GEMM; measured 11× faster than an int32 ``@``, which has no
    BLAS path, at 4096×256×768). CUDA's ``_int_mm`` has shape limits, so there float64 is used: exact,
    since every partial sum is an integer below 2^53."""
    if xq.device.type == "cpu":
        return torch._int_mm(xq, wq.t())
    return (xq.double() @ wq.double().t()).to(torch.int32)


@torch.library.custom_op("qc::int8_linear", mutates_args=())
def int8_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Optional[Tensor],
    act_scale: Optional[Tensor],
    smooth_inv: Optional[Tensor],
) -> Tensor:
    """W8A8 linear: int8 weights (per output channel), int8 activations, int32 accumulation.

    ``act_scale`` None: per-token dynamic activation scales; else one static per-tensor scale.
    ``smooth_inv``: SmoothQuant's per-channel ``1/s`` for producers that could not absorb it,
    applied inside the activation quantizer (one multiply, no extra pass over memory).
    """
    return int8_linear_quantized(x, quantize_activations(x, act_scale, smooth_inv), weight, weight_scale, bias)


def quantize_activations(x: Tensor, act_scale: Optional[Tensor], smooth_inv: Optional[Tensor]) -> tuple:
    """``int8_linear``'s first half: int8 codes of ``x`` (times ``smooth_inv``) and their scales —
    per token ``[..., 1]``, or the static one ``[1]``. Linears that share an input can share it."""
    xs = x.float() if smooth_inv is None else x.float() * smooth_inv.float()
    if act_scale is None:
        return quantize_per_token(xs)
    sx = act_scale.float().reshape(1)
    return torch.clamp(torch.round(xs / sx), -127, 127).to(torch.int8), sx


def int8_linear_quantized(
    x: Tensor, quantized: tuple, weight: Tensor, weight_scale: Tensor, bias: Optional[Tensor]
) -> Tensor:
    """``int8_linear``'s second half on :func:`quantize_activations`' output (``x`` gives the dtype)."""
    xq, sx = quantized
    shape = xq.shape
    acc = int8_matmul(xq.reshape(-1, shape[-1]), weight).reshape(*shape[:-1], weight.shape[0])
    y = acc.float() * (sx if sx.numel() == 1 else sx.reshape(*sx.shape[:-1], 1)) * weight_scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@int8_linear.register_fake
def _int8_linear_fake(x, weight, weight_scale, bias, act_scale, smooth_inv):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _validate(a, gm) -> None:
    """int8 codes ``[out, in]`` and a float scale per output row."""
    out, _ = expect_stored(a, gm, "weight", (torch.int8,))
    scale = expect_stored(a, gm, "weight_scale", (torch.float32, torch.bfloat16, torch.float16))
    if int(torch.Size(scale).numel()) != out:
        raise ValueError(f"weight_scale holds {torch.Size(scale).numel()} scales for {out} output rows")


register(
    OpSpec(
        "int8_linear",
        storage=("weight", "weight_scale"),
        weights=lambda a, gm: a.stored_like(gm, "weight").numel(),
        establishes=frozenset({GraphProperty.INT8_LOWERED}),
        validate=_validate,
    )
)


def _rewrite(
    gm: GraphModule, layer: LinearLayer, tensors: dict, x: Optional[Node] = None, smooth_inv: Optional[Node] = None
) -> None:
    """``tensors``: ``weight_int8``, ``weight_scale`` and, for a static scale, ``act_scale``; ``x``
    and ``smooth_inv``: the nodes the op reads when a SmoothQuant multiply is fused (graph nodes, so
    this layout's rewrite is called in one process only, by ``LowerInt8``)."""
    replace_linear(
        gm,
        layer,
        "int8_linear",
        tensors,
        lambda _x, a: dict(
            x=_x if x is None else x,
            weight=a["weight_int8"],
            weight_scale=a["weight_scale"],
            bias=layer.bias_node,
            act_scale=a.get("act_scale"),
            smooth_inv=smooth_inv,
        ),
    )


INT8 = register_layout(
    Layout(
        "int8",
        linear_op="int8_linear",
        ops=("int8_linear",),
        rewrite=_rewrite,
        description="W8A8: int8 weights per output channel, int8 activations, int32 accumulation",
    )
)
