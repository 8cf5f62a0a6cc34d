"""The GPTQ checkpoint layout: codes packed in int32 words, per-group fp16 scales and integer
zero points, a per-column group index — ``qc.quant_linear`` and, experts stacked on a leading dim,
``qc.quant_experts_linear``.

``qweight`` int32 ``[in·bits/32, out]`` packed along the input dim, ``qzeros`` int32
``[groups, out·bits/32]`` holding the real zero points (GPTQ "v2" convention: no −1 offset),
``scales`` fp16 ``[groups, out]``, ``g_idx`` int32 ``[in]`` mapping each input column to its group.
The layout GPTQ, RTN, AWQ and SignRound results are stored in, and what the GPTQ and
compressed-tensors exporters write (docs/formats.md).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from qcompiler.algorithms.packing import pack_cols, pack_rows, packed_length, unpack_cols, unpack_rows
from qcompiler.errors import QuantizationError
from qcompiler.ir.graph import LinearLayer
from qcompiler.ir.graph_property import GraphProperty
from qcompiler.ir.op_registry import OpSpec, expect_stored, register
from qcompiler.ir.ops import per_expert
from qcompiler.layouts.base import (
    LayerQuant,
    LayerRewrite,
    Layout,
    check_packable,
    linear_rewrite,
    register_layout,
    same_in_every_range,
)

__all__ = [
    "GPTQWeight",
    "GPTQ_TENSORS",
    "GPTQ_ROW_UNIT",
    "GPTQ",
    "pack_gptq",
    "dequantize_gptq",
    "gptq_layer",
    "quant_linear",
    "quant_experts_linear",
]

QUANTIZED = frozenset({GraphProperty.QUANTIZED_WEIGHTS})
# rows a GPTQ-layout layer may be split at: qzeros pack 32/bits rows per int32 word, 3-bit codes 32 per 3 words
GPTQ_ROW_UNIT = 32


class GPTQWeight(NamedTuple):
    """One linear's weight in the GPTQ layout."""

    qweight: Tensor  # int32 [in*bits/32, out]
    qzeros: Tensor  # int32 [groups, out*bits/32], real zero points
    scales: Tensor  # float16 [groups, out]
    g_idx: Tensor  # int32 [in], group of each input column
    bits: int
    group_size: int  # -1: one group per output channel

    @property
    def in_features(self) -> int:
        """Input width of the packed weight."""
        return self.g_idx.numel()

    @property
    def out_features(self) -> int:
        """Output width of the packed weight."""
        return self.scales.shape[1]


GPTQ_TENSORS = GPTQWeight._fields[:4]  # ("qweight", "qzeros", "scales", "g_idx"): the stored tensors, by name


def pack_gptq(codes: Tensor, scales: Tensor, zeros: Tensor, g_idx: Tensor, bits: int, group_size: int) -> GPTQWeight:
    """Pack codes ``[out, in]`` and per-group ``scales``/``zeros`` ``[groups, out]`` into the layout."""
    return GPTQWeight(
        pack_rows(codes.t().contiguous(), bits),
        pack_cols(zeros.round().to(torch.int32), bits),
        scales.to(torch.float16).contiguous(),
        g_idx.to(torch.int32).contiguous(),
        bits,
        group_size,
    )


def dequantize_gptq(qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int) -> Tensor:
    """The float32 weight ``[out, in]`` the packed tensors stand for."""
    n_in, n_out = g_idx.numel(), scales.shape[1]
    codes = unpack_rows(qweight, bits, n_in)  # [in, out]
    zeros = unpack_cols(qzeros, bits, n_out)  # [groups, out]
    g = g_idx.long()
    w_t = (codes - zeros[g]).float() * scales[g].float()  # [in, out]
    return w_t.t()


@torch.library.custom_op("qc::quant_linear", mutates_args=())
def quant_linear(
    x: Tensor,
    qweight: Tensor,
    qzeros: Tensor,
    scales: Tensor,
    g_idx: Tensor,
    bias: Optional[Tensor],
    bits: int,
    group_size: int,
) -> Tensor:
    """Weight-only quantized linear (W{bits}A16/A32): dequantize, then an ordinary matmul."""
    w = dequantize_gptq(qweight, qzeros, scales, g_idx, bits).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


@quant_linear.register_fake
def _quant_linear_fake(x, qweight, qzeros, scales, g_idx, bias, bits, group_size):
    return x.new_empty((*x.shape[:-1], scales.shape[1]))


def _in_times_out(in_arg: str, out_arg: str) -> Callable:
    """Weights = (input columns recorded in ``in_arg``) x (output channels, last dim of ``out_arg``)."""
    return lambda a, gm: a.stored_like(gm, in_arg).numel() * a.stored_like(gm, out_arg).shape[-1]


def _validate(a, gm) -> None:
    """The tensors a GPTQ-layout node stores: int32 words for its ``bits``, fp16 scales, and a
    ``g_idx`` naming groups that exist."""
    (n_in,) = expect_stored(a, gm, "g_idx", (torch.int32,))
    groups, n_out = expect_stored(a, gm, "scales", (torch.float16,))
    bits = int(a.bits)
    expect_stored(a, gm, "qweight", (torch.int32,), (packed_length(n_in, bits), n_out))
    expect_stored(a, gm, "qzeros", (torch.int32,), (groups, packed_length(n_out, bits)))
    g_idx = a.tensor(gm, "g_idx")
    if n_in and not (0 <= int(g_idx.min()) and int(g_idx.max()) < groups):
        raise ValueError(f"g_idx names groups outside the {groups} its scales hold")


register(
    OpSpec(
        "quant_linear",
        storage=("qweight", "qzeros", "scales"),
        weights=_in_times_out("g_idx", "scales"),
        code_widths=("bits",),
        establishes=QUANTIZED,
        validate=_validate,
    )
)


@torch.library.custom_op("qc::quant_experts_linear", mutates_args=())
def quant_experts_linear(
    x: Tensor,
    offsets: Tensor,
    qweight: Tensor,
    qzeros: Tensor,
    scales: Tensor,
    g_idx: Tensor,
    bits: int,
    group_size: int,
) -> Tensor:
    """A mixture-of-experts grouped linear with GPTQ-layout experts (``quant_linear``'s tensors
    stacked on a leading expert dim): ``x`` rows are sorted by expert, ``offsets[e]`` is the
    cumulative row count of experts ``0..e``. One expert's weight is dequantized at a time."""
    return per_expert(
        x,
        offsets,
        scales.shape[-1],
        lambda rows, e: F.linear(rows, dequantize_gptq(qweight[e], qzeros[e], scales[e], g_idx[e], bits).to(x.dtype)),
    )


@quant_experts_linear.register_fake
def _quant_experts_linear_fake(x, offsets, qweight, qzeros, scales, g_idx, bits, group_size):
    return x.new_empty((x.shape[0], scales.shape[-1]))


register(
    OpSpec(
        "quant_experts_linear",
        storage=("qweight", "qzeros", "scales"),
        weights=_in_times_out("g_idx", "scales"),  # g_idx [E, in]: E x in x out weights
        code_widths=("bits",),
        establishes=QUANTIZED,
    )
)


def gptq_layer(
    layer: LinearLayer,
    codes: Tensor,
    scales: Tensor,
    zeros: Tensor,
    g_idx: Tensor,
    bits: int,
    group_size: int,
    dequantized: Tensor,
    figures: dict,
    damped_error: Optional[tuple[float, float]] = None,
) -> LayerQuant:
    """One layer's codes ``[out, in]`` and per-group ``scales``/``zeros`` as a GPTQ-layout result.
    ``group_size`` is the recipe's, also when the width is not a multiple of it (the last group is
    shorter) or is one group: every layer of a recipe records the same setting."""
    check_packable(layer, dequantized, bits)
    packed = pack_gptq(codes, scales, zeros, g_idx, bits, group_size)
    rewrite = LayerRewrite("gptq", {"bits": packed.bits, "group_size": packed.group_size})
    return LayerQuant(dequantized, figures, {f: getattr(packed, f) for f in GPTQ_TENSORS}, rewrite, damped_error)


def _join_rows(parts: list[dict], constants: list[dict]) -> tuple[dict, dict, dict]:
    """qweight, qzeros (packed along the outputs: ranges are whole words) and scales are
    ``[…, out]``; g_idx is per input column."""
    joined = {name: torch.cat([t[name] for t in parts], dim=1) for name in ("qweight", "qzeros", "scales")}
    return {**joined, "g_idx": same_in_every_range("g_idx", parts)}, constants[0], {}


def _stack_experts(results: list[LayerQuant]) -> tuple[str, dict, dict]:
    """``qc.quant_experts_linear``: each ``quant_linear`` tensor stacked on a leading expert dim."""
    if len({tuple(sorted(r.rewrite.constants.items())) for r in results}) != 1:
        raise QuantizationError("experts of one parameter were quantized with different bits or groups")
    tensors = {f: torch.stack([r.tensors[f] for r in results]) for f in GPTQ_TENSORS}
    return "quant_experts_linear", tensors, dict(results[0].rewrite.constants)


GPTQ = register_layout(
    Layout(
        "gptq",
        linear_op="quant_linear",
        ops=("quant_linear", "quant_experts_linear"),
        rewrite=linear_rewrite("quant_linear"),  # constants: bits, group_size
        row_unit=GPTQ_ROW_UNIT,
        row_join=_join_rows,
        experts_op="quant_experts_linear",
        experts_stack=_stack_experts,
        aliases=("quant_linear",),
        description="GPTQ checkpoint layout: int32-packed codes, fp16 group scales, integer zeros, g_idx",
    )
)
