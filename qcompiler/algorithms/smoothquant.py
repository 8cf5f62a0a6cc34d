"""SmoothQuant (Xiao et al., 2023): the smoothing scales and the per-group α search.

``Y = X W^T = (X diag(s)^-1)(W diag(s))^T`` for any ``s > 0``. With
``s_j = max|X_j|^α / max|W_j|^(1−α)`` activation outliers move into the weights, where int8 copes.
Where each ``diag(s)^-1`` goes in a graph is ``qcompiler.pipeline.smoothing_plan``'s question.
"""

from __future__ import annotations

from typing import Sequence

import torch

from qcompiler.algorithms.int8 import fake_quantize_weight_per_channel, quantize_per_token

__all__ = ["smoothing_scales", "int8_output_error", "search_alpha", "ALPHA_GRID"]

ALPHA_GRID = tuple(round(0.05 * i, 2) for i in range(2, 20))  # 0.10 … 0.95


def smoothing_scales(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s = max|X|^α / max|W|^(1−α)`` per input channel; channels never activated keep ``s = 1``."""
    act = act_absmax.float()
    w = weight_absmax.float()
    s = act.clamp(min=1e-5).pow(alpha) / w.clamp(min=1e-5).pow(1 - alpha)
    s = torch.where((act > 0) & (w > 0), s, torch.ones_like(s))
    return s.clamp(min=1e-5, max=1e5)


def int8_output_error(X: torch.Tensor, weights: Sequence[torch.Tensor], s: torch.Tensor) -> float:
    """Relative error of W8A8 (per-token activations, per-channel weights) after smoothing by ``s``."""
    xq, sx = quantize_per_token(X / s)
    Xh = xq.float() * sx
    num = den = 0.0
    for W in weights:
        ref = X @ W.t()
        num += (ref - Xh @ fake_quantize_weight_per_channel(W * s).t()).pow(2).sum().item()
        den += ref.pow(2).sum().item()
    return (num / den) ** 0.5 if den > 0 else num**0.5


def search_alpha(
    X: torch.Tensor, weights: Sequence[torch.Tensor], act_absmax: torch.Tensor, grid: Sequence[float] = ALPHA_GRID
) -> tuple[float, float]:
    """The α of ``grid`` whose smoothing minimises the consumers' int8 output error on rows ``X``."""
    wmax = torch.stack([W.abs().amax(dim=0) for W in weights]).amax(dim=0)
    best = min(((int8_output_error(X, weights, smoothing_scales(act_absmax, wmax, a)), a) for a in grid))
    return best[1], best[0]
