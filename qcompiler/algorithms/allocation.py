"""Bits per layer under a budget: a multiple-choice knapsack.

Each layer ``l`` has candidates ``c`` with a stored size ``cost[l][c]`` (bits, counted from the
tensors the candidate stores) and a measured damage ``distortion[l][c]`` (its effect on the model's
output when it alone is quantized that way). The allocation picks one candidate per layer so that
the summed cost stays within ``budget`` and the summed distortion is least (per-layer distortions are
taken as additive, the usual assumption of mixed-precision search: HAWQ, AutoQuantize, AutoScheme).

Solved exactly on a cost grid by dynamic programming: costs are rounded *up* to units of
``budget / resolution`` bits, so the allocation never exceeds the budget and leaves at most one unit
per layer unused (default resolution: 1e-5 of the budget per layer, 0.1 % over 100 layers).
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import torch

from qcompiler.errors import QuantizationError

__all__ = ["allocate", "allocate_reference", "smallest_cost"]

RESOLUTION = 100_000  # cost units per budget


def smallest_cost(cost: Sequence[Sequence[float]]) -> float:
    """The least total size any allocation can have (every layer at its cheapest candidate)."""
    return sum(min(row) for row in cost)


def allocate(
    cost: Sequence[Sequence[float]], distortion: Sequence[Sequence[float]], budget: float, resolution: int = RESOLUTION
) -> list[int]:
    """The candidate index per layer with the least total distortion whose total cost is <= ``budget``."""
    _check(cost, distortion, budget)
    unit = budget / resolution
    capacity = resolution
    inf = float("inf")
    # best[b]: least distortion of the layers so far using exactly b units; choice[l][b]: its candidate
    best = torch.full((capacity + 1,), inf, dtype=torch.float64)
    best[0] = 0.0
    choices = []
    for row_cost, row_dist in zip(cost, distortion):
        new = torch.full_like(best, inf)
        pick = torch.full((capacity + 1,), -1, dtype=torch.int16)
        for c, (bits, d) in enumerate(zip(row_cost, row_dist)):
            units = math.ceil(bits / unit - 1e-9)
            if units > capacity:
                continue
            shifted = torch.full_like(best, inf)
            shifted[units:] = best[: capacity + 1 - units] + d
            better = shifted < new
            new = torch.where(better, shifted, new)
            pick = torch.where(better, torch.tensor(c, dtype=torch.int16), pick)
        best = new
        choices.append(pick)
    end = int(torch.argmin(best))
    if not math.isfinite(best[end].item()):
        raise QuantizationError(
            f"no allocation fits {budget:.6g} bits: the cheapest candidates need {smallest_cost(cost):.6g}"
        )
    picked = []
    for layer in range(len(cost) - 1, -1, -1):
        c = int(choices[layer][end])
        picked.append(c)
        end -= math.ceil(cost[layer][c] / unit - 1e-9)
    return picked[::-1]


def allocate_reference(
    cost: Sequence[Sequence[float]], distortion: Sequence[Sequence[float]], budget: float
) -> list[int]:
    """The same problem by trying every combination (tests: a handful of layers and candidates)."""
    _check(cost, distortion, budget)
    best, best_pick = float("inf"), None
    for pick in itertools.product(*(range(len(row)) for row in cost)):
        if sum(cost[i][c] for i, c in enumerate(pick)) <= budget:
            d = sum(distortion[i][c] for i, c in enumerate(pick))
            if d < best:
                best, best_pick = d, list(pick)
    if best_pick is None:
        raise QuantizationError(
            f"no allocation fits {budget:.6g} bits: the cheapest candidates need {smallest_cost(cost):.6g}"
        )
    return best_pick


def _check(cost, distortion, budget: float) -> None:
    if len(cost) != len(distortion) or any(len(a) != len(b) for a, b in zip(cost, distortion)):
        raise QuantizationError("allocation: cost and distortion tables differ in shape")
    if not cost or any(not row for row in cost):
        raise QuantizationError("allocation: every layer needs at least one candidate")
    if not budget > 0:
        raise QuantizationError(f"allocation: the budget must be positive, got {budget}")
