"""Automatic mixed precision under a bit budget (``recipe="auto:3.25"``).

Three steps, each visible in the report:
1. **Measure**: every candidate (method × bits × group size) on every block linear, alone, and its
   effect on the model's final output on calibration samples (``qcompiler/pipeline/sensitivity.py``).
2. **Allocate**: one candidate per layer, least summed damage with stored bits within
   ``budget × parameters`` — a multiple-choice knapsack solved exactly
   (``qcompiler/algorithms/allocation.py``). Bits are counted from the tensors each candidate stores,
   as ``bits_per_parameter`` counts them, so the budget is met as the report measures it.
3. **Quantize**: the plan run as ``MixedPrecision`` (true-sequential: each layer calibrated on the
   outputs of the already quantized ones), one graph with per-node bits that every backend runs;
   with ``finish="signround"`` (``auto-signround:B``) the same plan is quantized by SignRound
   instead, each layer at its planned bits and group size, tuned jointly per block (GPTQ
   candidates only: SignRound stores the GPTQ layout; the allocation still measures by GPTQ).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

from qcompiler.algorithms.allocation import allocate
from qcompiler.algorithms.float_grid import FLOAT_FORMATS, float_stored_bits
from qcompiler.algorithms.gguf_grids import FORMATS
from qcompiler.errors import QuantizationError
from qcompiler.ir.graph import block_of, find_linears, is_router, source_of
from qcompiler.passes.auto_embeddings import KEEP, TABLE_SETTINGS, measure_tables, parse_table_setting, table_shapes
from qcompiler.passes.embeddings import QuantizeEmbeddings, lookup_tables, table_path
from qcompiler.passes.gptq import GPTQ
from qcompiler.passes.gptq_candidates import solve_gptq_candidates
from qcompiler.passes.mixed_precision import MixedPrecision, candidate_grid, candidate_quantizer, parse_candidate
from qcompiler.passes.rtn import RTN
from qcompiler.passes.signround import SignRound
from qcompiler.passes.spqr_candidates import solve_spqr_candidates
from qcompiler.pipeline.block_walk import quantize_block_linears
from qcompiler.pipeline.fisher_sensitivity import FisherUnavailable, measure_fisher_sensitivities
from qcompiler.pipeline.layer_filter import ignore_reason
from qcompiler.pipeline.sensitivity import measure_sensitivities
from qcompiler.pipeline.weight_quantizer import WeightQuantizer

__all__ = ["AutoBits", "DEFAULT_CANDIDATES", "GGUF_CANDIDATES", "FLOAT_CANDIDATES", "MAX_BUDGET"]

# Measured on MiniLM at 4.16 bits: adding the g64 and SpQR candidates to the GPTQ ones took 1 − cosine
# from 0.0134 to 0.0118 (docs/methods/auto.md); at 3.25 bits it changed nothing.
DEFAULT_CANDIDATES = (
    "gptq-w2g32",
    "gptq-w2g128",
    "gptq-w3g32",
    "gptq-w3g64",
    "gptq-w3g128",
    "gptq-w4g32",
    "gptq-w4g64",
    "gptq-w4g128",
    "gptq-w8g128",
    "spqr-w3g16",
    "spqr-w4g16",
)
SIGNROUND_CANDIDATES = tuple(n for n in DEFAULT_CANDIDATES if n.startswith("gptq-"))
# auto-gguf:B — llama.cpp's types only, so the mix is one GGUF file that llama.cpp runs (its own Q4_K_M
# mixes Q4_K and Q6_K by a fixed rule; here each tensor's type is chosen from measured sensitivities)
GGUF_CANDIDATES = ("gptq-q2_k", "gptq-q3_k", "gptq-q4_k", "gptq-q5_k", "gptq-q6_k", "gptq-q8_0")
# auto-float:B — the floating-point formats GPUs serve (vLLM reads the mix as compressed-tensors config
# groups), as ModelOpt's AutoQuantize mixes NVFP4 and FP8 per layer
FLOAT_CANDIDATES = ("gptq-mxfp4", "gptq-nvfp4", "gptq-fp8")
FINISHERS = ("gptq", "signround")
SENSITIVITIES = ("fisher", "forward")  # one backward pass (pipeline/fisher_sensitivity.py) | a forward per candidate
SCORERS = ("solve", "rtn")  # a candidate scored by its own solve | GPTQ candidates by round-to-nearest on their grid
MAX_BUDGET = 16.0  # bits per parameter: above it a quantized layer is larger than its fp16 weight


@dataclass(frozen=True)
class AutoBits(WeightQuantizer):
    """Chooses a candidate per block linear to meet ``budget`` bits per parameter with the least output damage."""

    budget: float = 4.0  # bits per parameter over all quantized layers, every stored tensor counted
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    samples: int = 8  # calibration samples each sensitivity is measured on
    # True: linears reading one input (q/k/v, gate/up) share a candidate, as vLLM needs (it fuses them)
    tie_siblings: bool = False
    finish: str = "gptq"  # what quantizes the plan: "gptq" (each candidate's own method) or "signround"
    # how each candidate's damage is measured: "fisher" (second order from one backward pass per
    # sample) or "forward" (the whole graph run once per layer and candidate: depth x candidates forwards)
    sensitivity: str = "fisher"
    # "rtn": score GPTQ candidates by round-to-nearest on their own grid (one cheap rounding each instead
    # of a GPTQ solve; the plan is still solved by GPTQ) — for models where candidates x solves dominate
    score_with: str = "solve"
    # each layer's candidates solved on this many of its weight rows (whole packing units, chosen at
    # random; the damage and bits scaled to the layer: an unbiased estimate); 0: every row. Makes the
    # measuring cost per layer independent of its height (Fisher measure only)
    score_rows: int = 256
    # where the measuring walk's Hessians come from: "calibration" (all of it, as the plan's own solve)
    # or "samples" (the ``samples`` sensitivity sequences only: one short walk, for large calibration sets)
    measure_on: str = "calibration"
    # settings ("wBITSgGROUP") for the token-embedding table (and the tied head that reads it): with any,
    # the table is one more item of the budget, which then counts the table's parameters too; its
    # options are these settings and its stored width (passes/auto_embeddings.py). (): the linears only
    embeddings: tuple[str, ...] = ()

    needs_calibration: ClassVar = True
    TABLE_SETTINGS: ClassVar = TABLE_SETTINGS  # what --embeddings auto gives ``embeddings``
    needs_hessian: ClassVar = True
    config_version: ClassVar = 2  # 2: score_rows (version 1 solved every row of every candidate)

    def __post_init__(self):
        super().__post_init__()
        if self.sensitivity not in SENSITIVITIES:
            raise QuantizationError(f"auto: sensitivity={self.sensitivity!r}; choose one of {', '.join(SENSITIVITIES)}")
        if self.score_with not in SCORERS:
            raise QuantizationError(f"auto: score_with={self.score_with!r}; choose one of {', '.join(SCORERS)}")
        if self.finish not in FINISHERS:
            raise QuantizationError(f"auto: finish={self.finish!r}; choose one of {', '.join(FINISHERS)}")
        if self.finish == "signround" and tuple(self.candidates) == DEFAULT_CANDIDATES:
            object.__setattr__(self, "candidates", SIGNROUND_CANDIDATES)
        object.__setattr__(self, "candidates", tuple(self.candidates))
        if self.finish == "signround" and (
            odd := [n for n in self.candidates if not n.startswith("gptq-") or candidate_grid(n)]
        ):
            raise QuantizationError(f"auto: finish='signround' takes gptq- candidates only, not {', '.join(odd)}")
        if not isinstance(self.budget, (int, float)) or not 0 < self.budget <= MAX_BUDGET:
            raise QuantizationError(f"auto: budget {self.budget!r} bits per parameter is outside (0, {MAX_BUDGET:g}]")
        if not self.candidates:
            raise QuantizationError("auto: the candidate list is empty")
        for name in self.candidates:
            candidate_quantizer(name)
        if self.samples < 1:
            raise QuantizationError(f"auto: samples must be at least 1, got {self.samples}")
        if self.measure_on not in ("calibration", "samples"):
            raise QuantizationError(f"auto: measure_on={self.measure_on!r}; choose calibration or samples")
        object.__setattr__(self, "embeddings", tuple(self.embeddings))
        for setting in self.embeddings:
            parse_table_setting(setting)
        if not isinstance(self.score_rows, int) or self.score_rows < 0:
            raise QuantizationError(
                f"auto: score_rows must be 0 (every row) or a positive count, got {self.score_rows!r}"
            )

    @classmethod
    def migrate_config(cls, config: dict, version: int) -> dict:
        """Version 1 had no ``score_rows``: every candidate was solved on every row."""
        if version == 1:
            return {"score_rows": 0, **config}
        return super().migrate_config(config, version)

    def run(self, gm, ctx) -> bool:
        """Measure, allocate, then quantize the plan (the three steps of the module docstring)."""
        if ctx.calibration is None:
            raise QuantizationError("auto: calibration data is required to measure each layer's sensitivity")
        info = gm.meta.get("qcompiler")
        kl = info is not None and (info.cache is not None or info.model_class.endswith(("ForCausalLM", "LMHeadModel")))
        self._refuse_impossible_budget(gm)  # before minutes of measuring
        ctx.log(
            f"auto:{self.budget:g}: measuring {len(self.candidates)} candidates per layer on {self.samples} samples"
        )
        table = self._measure(gm, ctx, kl)
        if not table:
            ctx.record.notes.append("nothing was quantized: no eligible linear layer inside a transformer block")
            return False
        tables = measure_tables(gm, ctx, self.embeddings, self.samples, kl) if self.embeddings else []
        plan, settings = self._allocate(gm, ctx, table, tables)
        for item, setting in zip(tables, settings):  # before the linears' solves, as --embeddings orders it
            if setting != KEEP:
                bits, group = parse_table_setting(setting)
                QuantizeEmbeddings(bits=bits, group_size=group, ignore=_all_but(gm, item.path)).run(gm, ctx)
                if item.path not in ctx.record.layers:  # kept by QuantizeEmbeddings (its note says why)
                    raise QuantizationError(
                        f"auto: {item.path} could not be stored at {setting} (see the note above); the "
                        "budget counted it so: leave embeddings unset for this model"
                    )
                ctx.record.layers[item.path].update(candidate=f"embeddings {setting}")
        if self.finish == "signround":
            finisher = SignRound(plan=plan, ignore=self.ignore, true_sequential=self.true_sequential)
        else:
            finisher = MixedPrecision(plan=plan, true_sequential=self.true_sequential)
        changed = quantize_block_linears(gm, ctx, finisher)
        for p, n in plan:
            if p in ctx.record.layers:
                ctx.record.layers[p]["sensitivity"] = table[p][n].distance
        return changed

    def _allocate(self, gm, ctx, table: dict, tables: list) -> tuple[tuple, list[str]]:
        """The knapsack over the measured layers (and ``tables``' options): the plan, each table's setting."""
        measured = [layer for layer in find_linears(gm) if layer.path in table]
        total = sum(math.prod(layer.weight_shape(gm)) for layer in measured) + sum(t.weights for t in tables)
        items = self._items(measured)  # the layers that must share one candidate
        names = [[n for n in self.candidates if all(n in table[p] for p in item)] for item in items]
        for item, row in zip(items, names):
            if not row:
                raise QuantizationError(f"auto: no candidate fits every layer of {', '.join(item)}")
        cost = [[sum(table[p][n].bits for p in item) for n in row] for item, row in zip(items, names)]
        cost += [[o.bits for o in t.options] for t in tables]
        cheapest = sum(min(row) for row in cost) / total
        if self.budget < cheapest:
            raise QuantizationError(
                f"auto: budget {self.budget:g} bits per parameter is below the smallest allocation "
                f"these candidates allow ({cheapest:.4f})"
            )
        damage = [[sum(table[p][n].distance for p in item) for n in row] for item, row in zip(items, names)]
        damage += [[o.distance for o in t.options] for t in tables]
        pick = allocate(cost, damage, self.budget * total)
        plan = tuple((p, row[c]) for item, row, c in zip(items, names, pick) for p in item)
        chosen = [t.options[c] for t, c in zip(tables, pick[len(items) :])]
        planned_bits = (sum(table[p][n].bits for p, n in plan) + sum(o.bits for o in chosen)) / total
        mix = ", ".join(f"{n} x{k}" for n, k in sorted(Counter(n for _p, n in plan).items()))
        mix += "".join(f"; {t.path} {o.setting}" for t, o in zip(tables, chosen))
        ctx.record.notes.append(f"allocation for {self.budget:g} bits per parameter: {planned_bits:.4f} ({mix})")
        ctx.log(f"auto:{self.budget:g}: {planned_bits:.4f} bits per parameter: {mix}")
        return plan, [o.setting for o in chosen]

    def _items(self, measured: list) -> list[list[str]]:
        """Knapsack items: each measured layer alone, or (``tie_siblings``) the layers reading one input."""
        groups: dict = {}
        for layer in measured:
            groups.setdefault(source_of(layer.input) if self.tie_siblings else layer.path, []).append(layer.path)
        return list(groups.values())

    def _measure(self, gm, ctx, kl: bool) -> dict:
        """Every eligible layer's candidates scored by ``self.sensitivity``; a graph that cannot be
        differentiated is measured forward, and the note says so."""
        args = (gm, ctx, {name: self._scorer(name) for name in self.candidates})
        options = dict(
            samples=self.samples,
            kl=kl,
            eligible=lambda path: not is_router(path) and ignore_reason(path, self.ignore) is None,
            together=_solve_together,  # a layer's GPTQ candidates in one sweep, its SpQR ones in another
        )
        if self.sensitivity == "fisher":
            try:
                return measure_fisher_sensitivities(
                    *args,
                    **options,
                    score_rows=self.score_rows,
                    hessians_from_samples=self.measure_on == "samples",
                )
            except FisherUnavailable as e:
                note = f"auto: the graph has no derivative ({e}); sensitivities measured forward instead"
                ctx.record.notes.append(note)
                ctx.log(note)
        return measure_sensitivities(*args, **options)

    def _scorer(self, name: str):
        """What measures candidate ``name``: its own quantizer, or (``score_with="rtn"``) a GPTQ
        candidate's round-to-nearest on the same grid, which stores the same tensors."""
        quantizer = candidate_quantizer(name)
        if self.score_with == "rtn" and isinstance(quantizer, GPTQ):
            quantizer = RTN(
                bits=quantizer.bits, group_size=quantizer.group_size, sym=quantizer.sym, grid=quantizer.grid
            )
        return quantizer

    def _refuse_impossible_budget(self, gm) -> None:
        """A budget below what the cheapest candidates need at the least (codes alone for SpQR; codes,
        scales and zeros for RTN/GPTQ, exact) is refused from the shapes, with nothing measured."""
        need = weights = 0
        for layer in find_linears(gm):
            if block_of(layer.path) is None or is_router(layer.path) or ignore_reason(layer.path, self.ignore):
                continue
            n_out, n_in = layer.weight_shape(gm)
            need += min(_least_bits(name, n_out, n_in) for name in self.candidates)
            weights += n_out * n_in
        for _path, rows, hidden in table_shapes(gm) if self.embeddings else []:
            need += min(_least_bits(f"rtn-{setting}", rows, hidden) for setting in self.embeddings)
            weights += rows * hidden
        if weights and self.budget < need / weights:
            raise QuantizationError(
                f"auto: budget {self.budget:g} bits per parameter is below the smallest allocation "
                f"these candidates allow (at least {need / weights:.4f})"
            )


def _all_but(gm, path: str) -> tuple[str, ...]:
    """``ignore`` patterns for every lookup table of ``gm`` but the one at ``path``."""
    others = {table_path(lookups) for lookups in lookup_tables(gm)}
    return tuple(sorted(re.escape(p).join(("re:^", "$")) for p in others - {path}))


def _least_bits(name: str, n_out: int, n_in: int) -> float:
    """Stored bits of a layer under candidate ``name``: exact for RTN/GPTQ (codes, fp16 scales and
    packed zeros per group), a lower bound (the codes) for SpQR."""
    method, bits, group = parse_candidate(name)
    grid = candidate_grid(name)
    if grid in FLOAT_FORMATS:
        return float_stored_bits(FLOAT_FORMATS[grid], n_out, n_in)
    if grid is not None:  # llama.cpp's bytes (a width its super-block cannot hold falls back to more bits)
        fmt = FORMATS[grid]
        return fmt.block_bytes * 8 / fmt.super_block * n_out * n_in
    if method == "spqr":
        return bits * n_out * n_in
    groups = -(-n_in // group)  # the last group may be shorter
    return bits * n_out * n_in + groups * n_out * (16 + bits)


def _solve_together(candidates: dict, members: list, H) -> dict:
    """The candidates of one input's layers (``members``: ``(layer, W, whole)``) that share a sweep:
    their GPTQ ones, and their SpQR ones (each result its own solve's, bit for bit), as ``{path:
    {name: result}}``; the rest are solved one by one by the caller."""
    solved = solve_gptq_candidates(candidates, [(layer, W) for layer, W, _whole in members], H)
    for path, row in solve_spqr_candidates(candidates, members, H).items():
        solved.setdefault(path, {}).update(row)
    return solved
