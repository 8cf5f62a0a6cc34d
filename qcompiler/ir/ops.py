"""The layout-free ``qc`` ops: what quantized computation needs beside a storage layout's own ops
(``qcompiler/layouts/``, one file per layout).

Each op is a ``torch.library`` custom op with a plain-torch reference implementation (what the
eager backend runs and what every kernel is tested against) and a fake implementation so graphs
stay shape-checkable. ``per_expert`` is the grouped-matmul loop every experts op of every layout
runs through.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from qcompiler.algorithms.float_grid import round_to_element
from qcompiler.algorithms.hadamard import rotate_last_dim
from qcompiler.ir.graph_property import GraphProperty
from qcompiler.ir.op_registry import OpSpec, expect_stored, register

__all__ = ["expert_ranges", "per_expert", "hadamard", "fp8_kv_quant"]


def expert_ranges(offsets: Tensor) -> list[tuple[int, int]]:
    """The ``(start, end)`` rows of each expert, from the cumulative counts ``offsets`` of rows
    sorted by expert (the layout of transformers' grouped matmul)."""
    ends = [int(v) for v in offsets.tolist()]
    return list(zip([0] + ends[:-1], ends))


def per_expert(x: Tensor, offsets: Tensor, n_out: int, rows_times: Callable[[Tensor, int], Tensor]) -> Tensor:
    """A grouped linear over rows sorted by expert: ``rows_times(rows, e)`` for each expert that
    received rows, written into its rows of a ``[rows, n_out]`` output; rows past the last offset
    stay zero. Every experts op's reference, kernel and ONNX-layout twin runs through this one loop."""
    y = x.new_zeros((x.shape[0], n_out))
    for e, (start, end) in enumerate(expert_ranges(offsets)):
        if end > start:
            y[start:end] = rows_times(x[start:end], e)
    return y


@torch.library.custom_op("qc::hadamard", mutates_args=())
def hadamard(x: Tensor, signs: Tensor, block_size: int) -> Tensor:
    """Online rotation ``x @ R``, ``R = diag(signs) · blockdiag(H_b/√b)`` (QuaRot's online Hadamard:
    the linear after it holds ``W R``, so their product is unchanged). Computed in float32."""
    return rotate_last_dim(x, signs, block_size).to(x.dtype)


@hadamard.register_fake
def _hadamard_fake(x, signs, block_size):
    return torch.empty_like(x)


def _hadamard_setup(ctx, inputs, output):
    _, signs, block_size = inputs
    ctx.save_for_backward(signs)
    ctx.block_size = block_size


def _hadamard_backward(ctx, grad):
    """``∂/∂x = grad · Rᵀ = (grad · blockdiag(H_b/√b)) · diag(signs)`` (H symmetric): for passes
    that tune weights by gradients through a rotated graph (SignRound)."""
    (signs,) = ctx.saved_tensors
    ones = torch.ones_like(signs)
    return (rotate_last_dim(grad, ones, ctx.block_size) * signs.to(grad.device)).to(grad.dtype), None, None


hadamard.register_autograd(_hadamard_backward, setup_context=_hadamard_setup)


MAX_HADAMARD_BLOCK = 16384  # the widest a model's residual stream gives (Llama-3 405B); its H is 2 GB in float64


def _validate_hadamard(a, gm) -> None:
    """±1 int8 signs, and a power-of-two block that divides their width and is not larger than any
    model's (a hostile block size would otherwise allocate a block x block matrix)."""
    (width,) = expect_stored(a, gm, "signs", (torch.int8,))
    block = int(a.block_size)
    if block < 1 or block & (block - 1) or width % block or block > MAX_HADAMARD_BLOCK:
        raise ValueError(
            f"block_size {block} is not a power of two up to {MAX_HADAMARD_BLOCK} dividing the {width} signs"
        )
    signs = a.tensor(gm, "signs")
    if width and not bool(((signs == 1) | (signs == -1)).all()):
        raise ValueError("signs holds values other than +1 and -1")


# no weights of its own: its signs are part of the FP model, like a norm's
register(OpSpec("hadamard", validate=_validate_hadamard))


@torch.library.custom_op("qc::fp8_kv_quant", mutates_args=())
def fp8_kv_quant(x: Tensor, scale: Tensor) -> Tensor:
    """Keys or values as an FP8 KV cache holds them: ``x / scale`` rounded to e4m3 (ties to even,
    saturating at 448), times ``scale`` (one per tensor, calibrated). Computed in float32; applying
    it twice changes nothing, so quantizing at the attention's input is quantizing what the cache
    stores."""
    return (round_to_element(x.float() / scale.float(), "e4m3") * scale.float()).to(x.dtype)


@fp8_kv_quant.register_fake
def _fp8_kv_quant_fake(x, scale):
    return torch.empty_like(x)


register(OpSpec("fp8_kv_quant", establishes=frozenset({GraphProperty.FP8_KV_CACHE})))
