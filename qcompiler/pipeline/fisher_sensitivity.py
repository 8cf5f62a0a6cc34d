"""Each layer's quantization damage to the model's output from one backward pass per sample, not one
forward per layer and candidate.

The forward measurement (``sensitivity.py``) runs the whole graph once per layer × candidate:
depth × candidates forwards, ~1,800 through a 262k-wide head for Gemma-3 270M, and more with depth.
Here, as in the Fisher-based allocators (HAWQ-style second-order scores, ModelOpt's AutoQuantize),
the output distance is expanded to second order around the FP model: for a change ``Δy`` of one
linear's output, ``KL(p ‖ p') ≈ ½ Σ_t Δy_tᵀ F_t Δy_t`` with ``F_t`` the Fisher of the next-token
distributions seen from that output at position ``t``. Its diagonal comes from squared gradients of
``−log p(y)`` with ``y`` *sampled from the model itself* (an unbiased estimate of the true Fisher,
not the empirical one of the data's labels); for an encoder's relative squared error the same holds
with ``F = JᵀJ / ‖out‖²``, estimated by gradients of ``r · out`` for a random normal ``r``. One
forward and one backward per sensitivity sample give every layer's ``F`` at once (a zero "probe"
added to each linear's output receives the gradient). A candidate's damage is then
``½ Σ_t Σ_o F_{t,o} (x_t · Δw_o)²`` (``Σ`` without ½ for the relative error), ``Δw = Ŵ − W``, over
the samples' own input rows ``x_t``, which the calibration walk keeps. Per position, not the
channel's mean times the input Hessian: tokens with large gradients are not independent of the
inputs there (measured, the per-channel product chose allocations with 1.2-1.3x the forward
measure's KL at 3.25 bits; per position they are level with it, docs/methods/auto.md).

Cost: ``samples`` forward + backward passes, one calibration walk, and per layer × candidate the
candidate's solve and one ``[positions, in] × [in, rows]`` product, where ``rows`` is a random sample
of the layer's rows (``score_rows``; the candidates' rows are independent given ``H``, so the sampled
terms are exactly those of the whole solve, scaled by ``out / rows``). Memory: the squared gradients
of every measured layer's sampled channels, ``positions × Σ rows`` bf16 values (Gemma-3 270M at
8 × 256 positions: 126 MB; every row: 0.5 GB), and one block's input rows at a time. A graph whose
ops have no derivative raises ``FisherUnavailable`` and the caller measures forward instead.
"""

from __future__ import annotations

import math
import time
import zlib
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch.fx import GraphModule, Node

from qcompiler.calib.layer_stats import LayerStats
from qcompiler.ir.graph import LinearLayer, block_of, find_linears
from qcompiler.layouts import LayerQuant
from qcompiler.pipeline.pass_base import PassContext
from qcompiler.pipeline.sensitivity import (
    CandidateScore,
    StoredWeights,
    first_output,
    score_candidates,
    sensitivity_samples,
)

if TYPE_CHECKING:
    from qcompiler.pipeline.weight_quantizer import WeightQuantizer

__all__ = ["FisherUnavailable", "measure_fisher_sensitivities", "output_fisher", "sample_rows", "sample_tokens"]


class FisherUnavailable(RuntimeError):
    """The graph cannot be differentiated (an op without a derivative); measure forward instead."""


class _Probed(StoredWeights):
    """The graph with a zero tensor added to each probed linear's output, whose gradient is the
    output's: ``probes[path]`` after a run."""

    def __init__(self, gm: GraphModule, probe_nodes: dict[Node, str]):
        super().__init__(gm)
        self.probe_nodes, self.probes = probe_nodes, {}

    def run_node(self, n: Node):
        out = super().run_node(n)
        path = self.probe_nodes.get(n)
        if path is None or not isinstance(out, torch.Tensor):
            return out
        probe = torch.zeros_like(out, requires_grad=True)
        self.probes[path] = probe
        return out + probe


def sample_tokens(weights: torch.Tensor, gen: torch.Generator, block: int = 512) -> torch.Tensor:
    """``[n]`` tokens, row ``r``'s drawn with probabilities ``weights[r] /
    Σ weights[r]`` (``weights`` ``[n, vocabulary]``, non-negative, unnormalized): by inverting the
    cumulative sum of block sums, then of the chosen block alone. ``torch.multinomial`` took 16 s of
    the 42 s Fisher pass on Gemma-3 270M's 2,048 x 262,144 logits, a cumulative sum over the whole
    vocabulary 3 s; block sums are one vectorized pass. Sums in float64; rounding that points past a
    block's last token picks its last one."""
    n, vocabulary = weights.shape
    w = weights.float()
    if vocabulary % block:
        w = torch.nn.functional.pad(w, (0, -vocabulary % block))
    blocks = w.view(n, -1, block)
    cdf = blocks.sum(-1).double().cumsum(-1)  # [n, blocks]
    u = torch.rand(n, 1, generator=gen, dtype=torch.float64) * cdf[:, -1:]
    b = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[1] - 1)
    rest = u - torch.where(b > 0, cdf.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(u))
    inner = blocks[torch.arange(n)[:, None], b].double().cumsum(-1)  # [n, 1, block]
    j = torch.searchsorted(inner, rest[..., None], right=True)[..., 0].clamp_(max=block - 1)
    return (b * block + j).clamp_(max=vocabulary - 1)[:, 0]


def _output_gradient(out: torch.Tensor, mask: Optional[torch.Tensor], kl: bool, gen: torch.Generator, rows_at_once=256):
    """The gradient, with respect to the output, of the scalar whose gradients' squares estimate the
    Fisher's diagonal, and the positions it covers. KL: ``−Σ_t log p_t(y_t)`` with ``y_t`` drawn from
    the model's own next-token distribution, whose gradient is ``p_t − onehot(y_t)``: written directly
    from one softmax per row chunk (the same softmax the tokens are drawn from) instead of autograd
    through ``log_softmax`` and ``gather`` — two fewer passes over positions × vocabulary, ~5 s of
    Gemma-3 270M's 30 s Fisher pass. Relative error: ``r · out / ‖out‖`` for a random normal ``r``."""
    keep = torch.ones(out.shape[:-1]) if mask is None or mask.shape != out.shape[: mask.dim()] else mask.float()
    if not kl:
        norm = (out.detach().float().square() * keep[..., None]).sum().sqrt().clamp_min(1e-30)
        r = torch.randn(out.shape, generator=gen)
        return (r * keep[..., None] / norm).to(out.dtype), 1.0
    flat = out.detach().reshape(-1, out.shape[-1])
    grad = torch.empty(flat.shape, dtype=torch.float32)
    weight = keep.reshape(-1, 1)
    for start in range(0, flat.shape[0], rows_at_once):
        chunk = grad[start : start + rows_at_once]
        torch.softmax(flat[start : start + rows_at_once].float(), dim=-1, out=chunk)
        y = sample_tokens(chunk, gen)
        chunk[torch.arange(chunk.shape[0]), y] -= 1.0
        chunk.mul_(weight[start : start + rows_at_once])
    return grad.view(out.shape).to(out.dtype), float(keep.sum())


def output_fisher(
    gm: GraphModule,
    batches: list,
    masks: list,
    kl: bool,
    layers: list[LinearLayer],
    seed: int = 0,
    channels: Optional[dict[str, torch.Tensor]] = None,
) -> dict[str, torch.Tensor]:
    """``{path: F}``: each layer's squared output gradients, ``[rows, out_features]`` in bf16 with the
    rows of every batch in order (a linear's input rows as the calibration walk sees them), divided
    by the positions (KL) or the batches (relative error) — the Fisher's diagonal, per position.
    ``channels[path]``: only those output channels kept (the rows its candidates are scored on)."""
    nodes = {layer.node: layer.path for layer in layers}
    gen = torch.Generator().manual_seed(seed)
    parts: dict[str, list] = {}
    count = 0.0
    for batch, mask in zip(batches, masks):
        runner = _Probed(gm, nodes)
        with torch.enable_grad():
            out = first_output(runner, batch)
            seed, n = _output_gradient(out, mask, kl, gen)
            probes = list(runner.probes.items())
            try:
                grads = torch.autograd.grad(out, [p for _, p in probes], grad_outputs=seed, allow_unused=True)
            except RuntimeError as e:  # an op without a derivative
                raise FisherUnavailable(str(e).splitlines()[0][:200]) from None
        for (path, probe), g in zip(probes, grads):
            g2 = torch.zeros(probe.shape) if g is None else g.detach().float().square()
            if channels is not None and channels.get(path) is not None:
                g2 = g2.index_select(-1, channels[path])
            parts.setdefault(path, []).append(g2.reshape(-1, g2.shape[-1]).to(torch.bfloat16))
        count += n
        del out, seed, probes, grads
    return {path: torch.cat(p).div_(max(count, 1.0)) for path, p in parts.items()}


def sample_rows(path: str, out_features: int, unit: Optional[int], limit: int) -> Optional[torch.Tensor]:
    """At least ``limit`` of a layer's ``out_features`` weight rows, in whole ``unit``s chosen at random
    (the same for every run: seeded by the layer's path), ascending; None: all of them (``limit`` 0,
    a method that cannot solve rows apart, or a layer not larger than the sample)."""
    if not limit or unit is None or out_features % unit:
        return None
    units, take = out_features // unit, -(-limit // unit)
    if take >= units:
        return None
    seeded = torch.Generator().manual_seed(zlib.crc32(path.encode()))
    picked = torch.randperm(units, generator=seeded)[:take].sort().values
    return (picked[:, None] * unit + torch.arange(unit)).reshape(-1)


def measure_fisher_sensitivities(
    gm: GraphModule,
    ctx: PassContext,
    candidates: dict[str, "WeightQuantizer"],
    *,
    samples: int,
    kl: bool,
    eligible: Callable[[str], bool] = lambda _path: True,
    score_rows: int = 0,
    together: Optional[Callable] = None,
    hessians_from_samples: bool = False,
) -> dict[str, dict[str, CandidateScore]]:
    """``{layer path: {candidate: score}}`` as ``measure_sensitivities`` returns it, from the Fisher
    estimate of the module docstring; the graph's weights are never changed. ``score_rows``: each
    layer's candidates solved on that many of its rows (``sample_rows``; 0: all), the Fisher kept
    for those output channels only; ``together``: as ``score_candidates`` takes it;
    ``hessians_from_samples``: the candidates solved on the sensitivity samples' Hessians (one walk
    over ``samples`` sequences instead of the whole calibration)."""
    batches = sensitivity_samples(ctx.calibration, samples)
    masks = [kwargs.get("attention_mask") for _args, kwargs in batches]
    start = time.perf_counter()
    # block linears only: the output head is never a candidate (its F alone, positions x vocabulary, was
    # 1 GB of Gemma-3 270M's 1.5 GB)
    layers = [layer for layer in find_linears(gm) if eligible(layer.path) and block_of(layer.path) is not None]
    row_sample = {}
    for layer in layers:
        out_features = layer.weight_shape(gm)[0]
        units = [quantizer.row_split_unit(layer) for quantizer in candidates.values()]
        unit = None if None in units else math.lcm(*units)
        row_sample[layer.path] = sample_rows(layer.path, out_features, unit, score_rows)
    fisher = output_fisher(gm, batches, masks, kl, layers, channels=row_sample)
    rows = max((f.shape[0] for f in fisher.values()), default=0)
    megabytes = sum(f.numel() * f.element_size() for f in fisher.values()) / 2**20
    seconds = time.perf_counter() - start
    ctx.log(
        f"  output Fisher of {len(fisher)} layers at {rows} positions ({megabytes:.0f} MB) "
        f"from {len(batches)} backward passes, {seconds:.1f}s"
    )
    factor = 0.5 if kl else 1.0  # KL ≈ ½ Δyᵀ F Δy; the relative error is Δyᵀ F Δy itself

    @contextmanager
    def fisher_damage(layer: LinearLayer, _stored: torch.Tensor, W: torch.Tensor, stats: LayerStats):
        # the first kept input rows are the samples' positions, in the order of the gradients' rows
        X, F = stats.sample, fisher.get(layer.path)
        n = 0 if X is None or F is None else min(X.shape[0], F.shape[0])
        X = X[:n].float().to(W.device) if n else None
        F = F[:n].float().to(W.device) if n else None

        def damage(result: LayerQuant) -> float:
            if not n:
                return 0.0
            dW = result.dequantized.float().to(W.device) - W
            return factor * float((F * (X @ dW.t()).square()).sum())

        yield damage

    return score_candidates(
        gm,
        ctx,
        candidates,
        eligible,
        fisher_damage,
        keep_rows=rows,
        row_sample=row_sample,
        together=together,
        walk_on=batches if hessians_from_samples else None,
    )
