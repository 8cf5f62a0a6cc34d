"""A fast "is every value finite?" for large tensors (weights, Hessian factors)."""

from __future__ import annotations

import torch

__all__ = ["all_finite"]


def all_finite(t: torch.Tensor) -> bool:
    """NaN and Inf propagate into a sum, which is one fast pass (10-25x cheaper than
    ``isfinite(t).all()`` at 3-8 M values); only a non-finite sum, which an overflow of finite
    values could also cause, is checked element by element. FP8 tensors (no sum on CPU) are
    read as float32."""
    if t.element_size() == 1 and t.is_floating_point():
        t = t.float()
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())
