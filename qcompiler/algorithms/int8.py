"""Symmetric int8 grids: per output row for weights, per token for activations (SmoothQuant's W8A8)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["quantize_weight_per_channel", "quantize_per_token", "fake_quantize_weight_per_channel"]


def quantize_weight_per_channel(W: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per output row: ``W ≈ W_q · scale``, ``scale = max|W_row| / 127``."""
    scale = (W.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
    return torch.clamp(torch.round(W / scale.unsqueeze(1)), -127, 127).to(torch.int8), scale


def fake_quantize_weight_per_channel(W: Tensor) -> Tensor:
    """``W`` rounded to its per-row int8 grid, in floating point."""
    q, scale = quantize_weight_per_channel(W)
    return q.to(W.dtype) * scale.unsqueeze(1).to(W.dtype)


def quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row of the last dim: ``x ≈ q · scale``, ``scale = max|x_row| / 127``."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / 127.0).clamp(min=1e-8)
    return torch.clamp(torch.round(x.float() / scale), -127, 127).to(torch.int8), scale
