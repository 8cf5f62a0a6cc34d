"""Several GPTQ grids of one layer solved in one sweep (``auto:B``'s candidates).

GPTQ's rows are independent given ``H``: each row's columns are rounded on its own grid and its error
spread with the same factor ``U`` of ``(H + λI)⁻¹``. Candidates that differ only in bits, group size
and symmetry — with static groups, whose grids are fitted up front from the original weights — are
therefore one GPTQ over the candidates' copies of ``W`` stacked as rows, each row rounded on its own
candidate's grid. On a 640 x 2048 layer one solve is dominated by the per-column Python loop (2,048
columns of a few vector ops), not by arithmetic, so nine candidates in one sweep cost little more
than one (benchmarks/auto_sensitivity.py); wide layers are batched only up to ``max_elements``
stacked weights, where arithmetic dominates anyway.

Same arithmetic as ``gptq_quantize`` row by row (tests/test_gptq_many.py compares codes and values).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from qcompiler.algorithms.gptq import (
    HessianFactor,
    QuantResult,
    _column_cost,
    _Groups,
    _sweep_block,
    check_spec,
    swept_copy,
)

__all__ = ["GridSpec", "gptq_quantize_many", "gptq_quantize_parts", "batchable"]


class GridSpec(NamedTuple):
    """One candidate's integer grid: bits, group size (a positive width: static groups), symmetry, kind."""

    bits: int
    group_size: int
    sym: bool
    grid: str  # "minmax" or "mse"


def batchable(spec: GridSpec) -> bool:
    """Whether ``spec`` can share a sweep: an integer grid on static groups (per-channel grids are
    fitted when the sweep starts, llama.cpp's and the float grids store other tensors)."""
    return spec.grid in ("minmax", "mse") and spec.group_size > 0


class _StackedGrids:
    """``_Groups``' sweep interface over the stacked candidates: column ``j``'s rows ``scale``,
    ``−zero``, ``maxq − zero`` of every candidate, concatenated (built once per distinct tuple of
    groups: the groups are contiguous, so at most ``in / smallest group`` of them)."""

    gguf_grid = None

    def __init__(self, groups: list[_Groups]):
        self.groups = groups
        self._rows: dict[tuple, tuple] = {}

    def sweep_rows(self, j: int, _upcoming) -> tuple[torch.Tensor, ...]:
        key = tuple(g.col_group[j] for g in self.groups)
        rows = self._rows.get(key)
        if rows is None:
            parts = [g._rows[k] for g, k in zip(self.groups, key)]
            rows = self._rows[key] = tuple(torch.cat(column) for column in zip(*parts))
        return rows


def gptq_quantize_many(
    W: torch.Tensor, factor: HessianFactor, specs: list[GridSpec], block_size: int = 128
) -> list[QuantResult]:
    """``[gptq_quantize(W, None, bits=…, group_size=…, sym=…, grid=…, static_groups=True,
    factor=factor)]`` for every spec, from one sweep over the stacked copies of ``W`` (act-order as
    ``factor`` was made)."""
    return gptq_quantize_parts([(W, spec) for spec in specs], factor, block_size)


def gptq_quantize_parts(
    parts: list[tuple[torch.Tensor, GridSpec]], factor: HessianFactor, block_size: int = 128
) -> list[QuantResult]:
    """``gptq_quantize(W, …)`` for every ``(W, spec)`` part — weights that read the same inputs (one
    ``H``: q/k/v, gate/up, a layer's candidates) — from one sweep over their stacked rows."""
    for _W, spec in parts:
        check_spec(spec.bits, spec.group_size, spec.grid)
        if not batchable(spec):
            raise ValueError(f"{spec} cannot share a sweep (integer grids on static groups only)")
    perm, U = factor.perm, factor.U
    cost = _column_cost(U, "mse")
    copies, groups, bounds = [], [], [0]  # bounds: each part's columns of the stack
    for W, s in parts:
        W, WT = swept_copy(W, factor)
        copies.append(WT)
        bounds.append(bounds[-1] + WT.shape[1])
        groups.append(
            _Groups(WT.t(), s.bits, s.group_size, s.sym, True, perm, W, s.grid, None if s.grid == "minmax" else cost)
        )
    stacked = _StackedGrids(groups)
    WT = torch.cat(copies, dim=1) if len(copies) > 1 else copies[0]  # [in, Σ rows]
    del copies
    n_in = WT.shape[0]
    QT, codesT = torch.empty_like(WT), torch.empty_like(WT)
    diag = torch.diagonal(U).tolist()
    error_sq = torch.zeros(len(parts), dtype=torch.float64, device=WT.device)
    for i1 in range(0, n_in, block_size):
        i2 = min(i1 + block_size, n_in)
        Err1 = _sweep_block(WT, U, i1, i2, stacked, QT, codesT, diag, -1)
        WT[i2:].addmm_(U[i1:i2, i2:].t(), Err1, alpha=-1)
        for c in range(len(parts)):  # as gptq_quantize sums it: the float32 norm, squared in float64
            error_sq[c] += torch.linalg.vector_norm(Err1[:, bounds[c] : bounds[c + 1]]).double() ** 2
    del WT
    inv = None if perm is None else torch.argsort(perm)
    results = []
    for c, g in enumerate(groups):
        cols = slice(bounds[c], bounds[c + 1])
        codes_c = codesT[:, cols] + g.zeros[torch.tensor(g.col_group, device=codesT.device)]
        Q_c = QT[:, cols]
        if inv is not None:
            codes_c, Q_c = codes_c[inv], Q_c[inv]
        results.append(
            QuantResult(
                codes_c.to(torch.int32).t(),
                g.scales,
                g.zeros,
                g.g_idx.to(QT.device),
                Q_c.t().contiguous(),
                factor.damp,
                factor.damp_steps,
                (float(error_sq[c]), factor.lam),
            )
        )
    return results
