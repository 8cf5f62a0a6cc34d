"""One inverse-Hessian Cholesky factor per Hessian, shared by every solve that reads it.

q/k/v and gate/up get the same Hessian object, and ``auto:B`` solves each layer once per candidate:
all of them (GPTQ on any grid, SpQR) need the same act-order permutation and factor of ``(H + λI)⁻¹``
for a given damping. It is computed once and kept only while that Hessian lives (a down_proj's H and
factor, 2 x 67 MB at width 4096, would otherwise stay through the next block's calibration).
"""

from __future__ import annotations

import weakref

import torch

from qcompiler.algorithms.gptq import HessianFactor, hessian_factor

__all__ = ["shared_hessian_factor"]

_FACTORS: dict[int, dict] = {}  # id(H) -> {(damp, act_order): factor}


def shared_hessian_factor(H: torch.Tensor, damp: float, act_order: bool) -> HessianFactor:
    """``hessian_factor(H, damp, act_order)``, computed once per live ``H`` and setting."""
    if id(H) not in _FACTORS:
        _FACTORS[id(H)] = {}
        weakref.finalize(H, _FACTORS.pop, id(H), None)
    per_setting = _FACTORS[id(H)]
    if (damp, act_order) not in per_setting:
        per_setting[(damp, act_order)] = hessian_factor(H, damp, act_order)
    return per_setting[(damp, act_order)]
