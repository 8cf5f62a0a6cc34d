"""SignRound (Cheng et al., 2023; the method of Intel's AutoRound): rounding and clipping learned per
block by signed gradient descent on the block's output error.

For each weight ``W`` of a block, on the same asymmetric (or symmetric) group grid as RTN and GPTQ:

    s = (α·max(W_g) − β·min(W_g)) / (2^b − 1),   z = round(−β·min(W_g) / s)
    Ŵ = s · (clamp(round(W/s + V) + z, 0, 2^b − 1) − z)

with a rounding offset ``V ∈ [−½, ½]`` per weight and clipping factors ``α, β ∈ [0, 1]`` per group
(symmetric: one factor on the signed extreme). All of a block's ``V, α, β`` are tuned together to
minimize the mean squared error between the block's outputs with ``Ŵ`` and its outputs in full
precision, one calibration batch per step, by ``p ← p − lr_t · sign(∂loss/∂p)`` with ``lr_t``
falling linearly from ``lr`` (default ``1/iters``) to 0; rounding passes gradients straight
through. The parameters of the step with the least batch loss are kept, so step 0 — plain
round-to-nearest on the starting grid — is among the candidates. Scales are rounded to fp16 in
the forward pass too (straight through), so the tuned codes reproduce exactly the stored weights.

This module is the algorithm on tensors; ``passes/signround.py`` runs it block by block on the
graph's calibration data.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from qcompiler.algorithms.gptq import QuantResult
from qcompiler.algorithms.quant_grid import search_shrinks

__all__ = ["Rounding", "initial_rounding", "fake_quantize_rounding", "rounding_result", "tune_rounding"]


class Rounding(NamedTuple):
    """One weight's learnable rounding: offsets ``v`` [out, in] and clipping factors [out, groups]."""

    v: torch.Tensor
    hi: torch.Tensor  # α: the fraction of each group's maximum (symmetric: of its signed extreme) kept
    lo: torch.Tensor  # β: the fraction of each group's minimum kept (unused when symmetric)


def _grouped(W: torch.Tensor, group_size: int) -> torch.Tensor:
    """``W`` [out, in] as [out, groups, g], zero-padded to whole groups (a zero never moves a
    group's range: the range always contains 0)."""
    out, width = W.shape
    g = width if group_size == -1 else group_size
    pad = (-width) % g
    if pad:
        W = torch.nn.functional.pad(W, (0, pad))
    return W.reshape(out, -1, g)


def _ste(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` forward, the gradient of ``x`` backward (rounding seen as the identity)."""
    return x + (value - x).detach()


def _grid(Wg: torch.Tensor, r: Rounding, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zeros [out, groups, 1] of the clipped range, scales fp16-representable."""
    maxq = 2**bits - 1
    xmin, xmax = Wg.amin(dim=2).clamp(max=0), Wg.amax(dim=2).clamp(min=0)
    if sym:
        extreme = torch.where(xmax >= -xmin, xmax, xmin)
        extreme = torch.where(extreme == 0, torch.ones_like(extreme), extreme)
        scale = extreme * r.hi / -(2 ** (bits - 1))
        scale = _ste(scale, scale.half().float())
        tiny = scale.detach().abs() < 2.0**-24
        scale = torch.where(tiny, torch.full_like(scale, -(2.0**-24)), scale)
        return scale.unsqueeze(2), torch.full_like(scale, float(2 ** (bits - 1))).unsqueeze(2)
    empty = (xmin == 0) & (xmax == 0)
    xmin = torch.where(empty, -torch.ones_like(xmin), xmin) * r.lo
    xmax = torch.where(empty, torch.ones_like(xmax), xmax) * r.hi
    scale = (xmax - xmin) / maxq
    scale = _ste(scale, scale.half().float())
    scale = torch.where(scale.detach() > 2.0**-24, scale, torch.full_like(scale, 2.0**-24))
    zero = _ste(-xmin / scale, torch.round(-xmin / scale)).clamp(0, maxq)
    return scale.unsqueeze(2), zero.unsqueeze(2)


def fake_quantize_rounding(W: torch.Tensor, r: Rounding, bits: int, group_size: int, sym: bool) -> torch.Tensor:
    """``Ŵ`` [out, in], differentiable in ``r`` (straight-through rounding)."""
    Wg = _grouped(W, group_size)
    scale, zero = _grid(Wg, r, bits, sym)
    v = _grouped(r.v, group_size)
    x = Wg / scale + v
    q = (_ste(x, torch.round(x)) + zero).clamp(0, 2**bits - 1)
    return (scale * (q - zero)).reshape(W.shape[0], -1)[:, : W.shape[1]]


def initial_rounding(W: torch.Tensor, bits: int, group_size: int, sym: bool, start: str = "minmax") -> Rounding:
    """``V = 0`` and the clipping of the starting grid: min-max (``α = β = 1``), or ``"mse"``: each
    group's shrink factor from ``quant_grid.search_shrinks`` (least squared rounding error)."""
    Wg = _grouped(W.float(), group_size)
    out, groups, g = Wg.shape
    if start == "mse":
        p = search_shrinks(Wg.reshape(-1, g), bits, sym).reshape(out, groups)
    elif start == "minmax":
        p = torch.ones(out, groups, device=W.device)
    else:
        raise ValueError(f"start={start!r}: choose 'minmax' or 'mse'")
    return Rounding(torch.zeros_like(W, dtype=torch.float32), p.clone(), p.clone())


def rounding_result(W: torch.Tensor, r: Rounding, bits: int, group_size: int, sym: bool) -> QuantResult:
    """The tuned rounding as stored codes, fp16 scales and zeros (``QuantResult``, original column
    order): its ``dequantized`` equals ``fake_quantize_rounding`` exactly."""
    W = W.detach().float()
    with torch.no_grad():
        Wg = _grouped(W, group_size)
        scale, zero = _grid(Wg, r, bits, sym)
        codes = (torch.round(Wg / scale + _grouped(r.v, group_size)) + zero).clamp(0, 2**bits - 1)
        deq = (scale * (codes - zero)).reshape(W.shape[0], -1)[:, : W.shape[1]]
        codes = codes.reshape(W.shape[0], -1)[:, : W.shape[1]].to(torch.int32)
    width = W.shape[1]
    g = width if group_size == -1 else group_size
    g_idx = (torch.arange(width, device=W.device) // g).to(torch.int32)
    return QuantResult(codes, scale.squeeze(2).t().contiguous(), zero.squeeze(2).t().contiguous(), g_idx, deq, 0.0, 0)


class TuneLog(NamedTuple):
    """How a block's tuning went: batch loss at step 0 (round-to-nearest), the best, and its step."""

    first_loss: float
    best_loss: float
    best_step: int


def tune_rounding(
    weights: dict[str, torch.Tensor],
    block_loss: Callable[[int, dict[str, torch.Tensor]], torch.Tensor],
    batches: int,
    *,
    bits: int,
    group_size: int,
    sym: bool,
    iters: int = 200,
    lr: float | None = None,
    start: str = "minmax",
    seed: int = 0,
    order: Sequence[int] | None = None,
    specs: dict[str, tuple[int, int]] | None = None,
) -> tuple[dict[str, Rounding], TuneLog]:
    """Tune every weight's rounding jointly: ``block_loss(batch, {name: Ŵ})`` is the block's output
    error on calibration batch ``batch`` with the trial weights (differentiable). Returns the
    roundings of the step with the least loss, and how the loss went. ``specs``: ``(bits, group
    size)`` of the weights that differ from ``bits`` / ``group_size`` (a mixed-precision plan)."""
    lr = 1.0 / max(iters, 1) if lr is None else lr  # iters=0: round to nearest on the starting grid
    spec = {name: (specs or {}).get(name, (bits, group_size)) for name in weights}
    params = {name: initial_rounding(W, *spec[name], sym, start) for name, W in weights.items()}
    for r in params.values():
        for t in r:
            t.requires_grad_(True)
    flat = [t for r in params.values() for t in r]
    if order is None:
        gen = torch.Generator().manual_seed(seed)
        order = [int(i) for _ in range(-(-max(iters, 1) // batches)) for i in torch.randperm(batches, generator=gen)]
    best, best_loss, best_step, first = None, float("inf"), 0, float("nan")
    for step in range(max(iters, 1)):
        trial = {name: fake_quantize_rounding(W, params[name], *spec[name], sym) for name, W in weights.items()}
        loss = block_loss(order[step % len(order)], trial)
        value = float(loss.detach())
        if step == 0:
            first = value
        if value < best_loss:
            best_loss, best_step = value, step
            best = {name: Rounding(*(t.detach().clone() for t in r)) for name, r in params.items()}
        if step == iters - 1 or iters == 0:
            break
        grads = torch.autograd.grad(loss, flat, allow_unused=True)
        rate = lr * (1.0 - step / iters)
        with torch.no_grad():
            for t, g in zip(flat, grads):
                if g is not None:
                    t.sub_(rate * torch.sign(g))
            for r in params.values():
                r.v.clamp_(-0.5, 0.5)
                r.hi.clamp_(0.0, 1.0)
                r.lo.clamp_(0.0, 1.0)
    return best, TuneLog(first, best_loss, best_step)
