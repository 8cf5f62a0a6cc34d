"""How much each layer's quantization candidate moves the model's final output.

For every block linear and every candidate: quantize that layer alone (from its Hessian on the FP
model's calibration inputs), run the whole graph on a few calibration samples, and measure the
output's distance from the FP output — KL divergence of the next-token distributions for a causal
LM, relative squared error of the output tensor otherwise (padding positions left out). This is the
damage the allocator (passes/auto_bits.py) weighs against each candidate's stored bits; it sees what
a layer's own output error cannot: how much the rest of the network amplifies or absorbs it.

Cost: one forward pass over the sensitivity samples per layer and candidate, plus one solve per layer
and candidate. The graph runs through an interpreter that reads every weight with ``get_tensor``, so a
streamed model's weights come from its checkpoint on each pass (the page cache keeps that cheap while
the model fits in memory).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, ContextManager, Optional

import torch
import torch.fx._pytree as fx_pytree
import torch.nn.functional as F
from torch.fx import GraphModule
from torch.utils._pytree import tree_leaves, tree_map

from qcompiler.calib.calibration import CalibrationEngine
from qcompiler.calib.cpu_products import Float32Products
from qcompiler.calib.layer_stats import LayerStats
from qcompiler.errors import QuantizationError
from qcompiler.ir.graph import LinearLayer
from qcompiler.ir.tensors import get_raw_tensor, get_tensor, set_tensor
from qcompiler.layouts import LayerQuant, UnpackableLayer, store_dequantized, stored_bits
from qcompiler.pipeline.pass_base import PassContext

if TYPE_CHECKING:
    from qcompiler.pipeline.weight_quantizer import WeightQuantizer

__all__ = [
    "CandidateScore",
    "StoredWeights",
    "first_output",
    "measure_sensitivities",
    "output_distance",
    "sensitivity_samples",
]


@dataclass(frozen=True)
class CandidateScore:
    """One candidate on one layer: its stored size and the output distance it caused alone."""

    bits: float  # stored bits of the layer's tensors under this candidate
    distance: float  # output distance from FP with only this layer quantized this way


_KL_ROWS = 128  # positions per chunk of output_distance's KL


def output_distance(reference: torch.Tensor, output: torch.Tensor, mask: Optional[torch.Tensor], kl: bool) -> float:
    """Mean KL(reference ‖ output) over positions (``kl``: logits), or ‖output − reference‖² / ‖reference‖²,
    over the positions ``mask`` keeps."""
    ref, out = reference, output
    if mask is not None and mask.shape == ref.shape[: mask.dim()]:
        ref, out = ref[mask.bool()], out[mask.bool()]
    if kl:  # a few rows at a time: a 262k-token vocabulary makes every temporary 1 MB per position
        ref, out = ref.reshape(-1, ref.shape[-1]), out.reshape(-1, out.shape[-1])
        total = 0.0
        for start in range(0, ref.shape[0], _KL_ROWS):
            log_p = F.log_softmax(ref[start : start + _KL_ROWS].float(), dim=-1)
            log_q = F.log_softmax(out[start : start + _KL_ROWS].float(), dim=-1)
            total += float((log_p.exp() * (log_p - log_q)).sum())
        return total / max(ref.shape[0], 1)
    ref, out = ref.float(), out.float()
    den = ref.double().square().sum()
    return float((out.double() - ref.double()).square().sum() / den) if den > 0 else 0.0


def _batch_size(batch: tuple[tuple, dict]) -> int:
    return next(t.shape[0] for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim())


def _first_rows(batch: tuple[tuple, dict], n: int) -> tuple[tuple, dict]:
    """The first ``n`` samples of a calibration batch (every tensor with the batch's leading size)."""
    args, kwargs = batch
    leading = _batch_size(batch)
    take = lambda t: t[:n] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == leading else t  # noqa: E731
    return tree_map(take, args), tree_map(take, kwargs)


def sensitivity_samples(calibration: list, n: int) -> list[tuple[tuple, dict]]:
    """The first ``n`` samples of the calibration batches (the last batch cut to fit)."""
    picked, have = [], 0
    for batch in calibration:
        if have >= n:
            break
        picked.append(_first_rows(batch, n - have))
        have += _batch_size(picked[-1])
    return picked


class StoredWeights(Float32Products):
    """Runs the whole graph reading each weight through ``get_tensor`` (a streamed one from disk);
    half-precision products on a CPU without half-precision units in float32 (calib/cpu_products.py)."""

    def fetch_attr(self, target: str):
        """The stored weight (read from its checkpoint when streamed)."""
        return get_tensor(self.module, target)


def first_output(runner: StoredWeights, batch: tuple[tuple, dict]) -> torch.Tensor:
    """The graph's first floating-point output on ``batch`` (logits, or the last hidden state)."""
    out = runner.run(*fx_pytree.tree_flatten_spec(batch, runner.module._in_spec))
    return next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())


class ForwardDistance:
    """``distance()``: the graph's output distance from its output when this was made, as it stands
    now, on ``samples`` sensitivity samples — the reference taken once, then one output held at a
    time (a 262k-token vocabulary's logits are 2 GB per 8 x 256 positions)."""

    def __init__(self, gm: GraphModule, calibration: list, samples: int, kl: bool):
        self.batches = sensitivity_samples(calibration, samples)
        self.masks = [kwargs.get("attention_mask") for _args, kwargs in self.batches]
        self.runner = StoredWeights(gm)  # one interpreter (it maps each node's last use once) for every forward
        self.kl = kl
        with torch.no_grad():
            self.reference = [first_output(self.runner, batch) for batch in self.batches]

    def __call__(self) -> float:
        with torch.no_grad():
            parts = [
                output_distance(ref, first_output(self.runner, batch), mask, self.kl)
                for batch, ref, mask in zip(self.batches, self.reference, self.masks)
            ]
        return sum(parts) / len(parts)


def measure_sensitivities(
    gm: GraphModule,
    ctx: PassContext,
    candidates: dict[str, "WeightQuantizer"],
    *,
    samples: int,
    kl: bool,
    eligible: Callable[[str], bool] = lambda _path: True,
    together: Optional[Callable] = None,
) -> dict[str, dict[str, CandidateScore]]:
    """``{layer path: {candidate: score}}`` for every eligible block linear; a candidate the layer's
    shape cannot take is left out of its row. The graph's weights are unchanged afterwards.
    ``together``: as ``score_candidates`` takes it."""
    distance = ForwardDistance(gm, ctx.calibration, samples, kl)

    @contextmanager
    def forward_damage(layer: LinearLayer, stored: torch.Tensor, _W: torch.Tensor, _stats: LayerStats):
        original = get_raw_tensor(gm, layer.weight_node.target)  # a streamed weight: its placeholder

        def damage(result: LayerQuant) -> float:
            store_dequantized(gm, layer, result.dequantized, stored)
            return distance()

        try:
            yield damage
        finally:
            set_tensor(gm, layer.weight_node.target, original, parameter=isinstance(original, torch.nn.Parameter))

    return score_candidates(gm, ctx, candidates, eligible, forward_damage, together=together)


def score_candidates(
    gm: GraphModule,
    ctx: PassContext,
    candidates: dict[str, "WeightQuantizer"],
    eligible: Callable[[str], bool],
    layer_damage: Callable[
        [LinearLayer, torch.Tensor, torch.Tensor, LayerStats], ContextManager[Callable[[LayerQuant], float]]
    ],
    keep_rows: int = 0,
    row_sample: Optional[dict[str, torch.Tensor]] = None,
    together: Optional[Callable[..., dict]] = None,
    walk_on: Optional[list] = None,
) -> dict[str, dict[str, CandidateScore]]:
    """The walk both measures share: block by block on FP inputs (nothing is quantized while
    measuring; ``keep_rows`` input rows kept per layer), every eligible linear quantized by every
    candidate its shape can take, each result scored by the damage function ``layer_damage(layer,
    stored weight, its float32 copy W, stats)`` opens for the layer (and closes after its last candidate).
    ``row_sample[path]``: the weight rows a layer's candidates are solved on (``quantize_rows``: those
    rows of the whole solve); ``W`` is then those rows, and the damage and stored bits are scaled by
    ``out / rows`` — an unbiased estimate of the whole layer's sums. ``together(candidates, members, H)``
    (``members``: ``(layer, W, whole)`` of layers reading one input): ``{path: {name: result}}`` for the
    candidates it can solve at once (None: cannot hold the shape), the same as each one's own solve
    (``whole``: the layer's weight when ``W`` is a sample of its rows).
    ``walk_on``: the batches the walk (and so each layer's Hessian) runs on instead of the whole
    calibration. Layers that read one input (q/k/v, gate/up: one Hessian) are handed to ``together``
    at once, so their candidates share a sweep too.
    """
    engine = CalibrationEngine.for_pass(gm, ctx if walk_on is None else replace(ctx, calibration=walk_on))
    table: dict[str, dict[str, CandidateScore]] = {}
    for seg in engine.blocks():
        layers = [layer for layer in seg.linears if eligible(layer.path)]
        if not layers:
            continue
        stats = engine.collect(seg, layers, keep_rows=keep_rows)
        for siblings in _by_input(gm, layers, stats):
            start = time.perf_counter()
            members = [_Member.of(gm, ctx, layer, stats[layer.path], row_sample) for layer in siblings]
            H = members[0].H  # one input: one Hessian
            parts = [(m.layer, m.scored, None if m.rows is None else m.W) for m in members]
            solved = {} if together is None or H is None else together(candidates, parts, H)
            for m in members:
                row = _score_layer(m, candidates, layer_damage, solved.get(m.layer.path, {}))
                table[m.layer.path] = row
                best = min(row, key=lambda c: row[c].distance)
                on = "" if m.rows is None else f" on {m.rows.numel()} of {m.W.shape[0]} rows"
                ctx.log(
                    f"  sensitivity {m.layer.path}: {len(row)} candidates{on}, "
                    f"least damage {best} {row[best].distance:.3g}, {time.perf_counter() - start:.1f}s"
                )
                start = time.perf_counter()
        del stats
    return table


@dataclass
class _Member:
    """One layer as ``score_candidates`` solves it: its stored weight, the float32 copy ``W``, the rows
    its candidates are solved on (None: all) and those rows ``scored``, its statistics and ``H``."""

    layer: LinearLayer
    stored: torch.Tensor
    W: torch.Tensor
    rows: Optional[torch.Tensor]
    scored: torch.Tensor
    stats: LayerStats
    H: Optional[torch.Tensor]

    @classmethod
    def of(cls, gm, ctx, layer: LinearLayer, stats: LayerStats, row_sample: Optional[dict]) -> "_Member":
        stored = layer.weight(gm)  # read (from disk when streamed): dtype and device of what is stored
        W = stored.detach().float().to(ctx.device or stored.device)
        H = None if stats.hessian is None else stats.hessian.to(W.device)
        rows = (row_sample or {}).get(layer.path)
        rows = None if rows is None else rows.to(W.device)
        return cls(layer, stored, W, rows, W if rows is None else W.index_select(0, rows), stats, H)


_SIBLING_WEIGHTS = 1 << 26  # float32 copies held at once when siblings are solved together (256 MB)


def _by_input(gm: GraphModule, layers: list[LinearLayer], stats: dict) -> list[list[LinearLayer]]:
    """``layers`` grouped by the statistics they share (one input: q/k/v, gate/up), in graph order;
    a group whose weights together exceed ``_SIBLING_WEIGHTS`` stays one layer at a time (each
    member's float32 copy is held until its candidates are scored)."""
    groups: dict[int, list[LinearLayer]] = {}
    for layer in layers:
        groups.setdefault(id(stats[layer.path]), []).append(layer)
    out = []
    for group in groups.values():
        size = sum(math.prod(layer.weight_shape(gm)) for layer in group)
        out += [group] if size <= _SIBLING_WEIGHTS else [[layer] for layer in group]
    return out


def _score_layer(m: _Member, candidates: dict, layer_damage: Callable, solved: dict) -> dict[str, CandidateScore]:
    """Every candidate that can hold ``m``'s shape, scored: its stored bits and damage (scaled by
    ``out / rows`` when solved on a sample of the rows); ``solved``: results already solved together."""
    share = 1.0 if m.rows is None else m.W.shape[0] / m.rows.numel()
    row = {}
    with layer_damage(m.layer, m.stored, m.scored, m.stats) as damage:
        for name, quantizer in candidates.items():
            try:
                if name in solved:
                    result = solved.pop(name)
                elif m.rows is None:
                    result = quantizer.quantize_layer(m.layer, m.W, m.H)
                else:
                    result = quantizer.quantize_rows(m.layer, m.W, m.H, m.rows)
            except (UnpackableLayer, QuantizationError):
                continue  # this candidate cannot hold this layer's shape
            if result is not None:  # None: solved together, and its layout cannot hold the shape
                row[name] = CandidateScore(stored_bits(result.tensors) * share, damage(result) * share)
    if not row:
        raise QuantizationError(f"layer {m.layer.path}: no candidate can quantize its shape {tuple(m.W.shape)}")
    return row
