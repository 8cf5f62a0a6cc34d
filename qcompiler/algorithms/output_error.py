"""A quantized layer's output error over the calibration inputs, from their Hessian alone:
``‖WX − ŴX‖ / ‖WX‖`` with ``H = 2/n X Xᵀ`` (every weight method's report figure, and what the
methods that search a setting minimize), in float32 GEMMs with float64 sums, a few rows at a time.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["output_error", "relative_error", "output_error_terms", "quadratic_form"]


def output_error(
    W: torch.Tensor,
    W_hat: torch.Tensor,
    H: torch.Tensor,
    damped_error: Optional[tuple[float, float]] = None,
    energy: Optional[float] = None,
) -> float:
    """‖WX − ŴX‖ / ‖WX‖ over the calibration inputs, from their Hessian (no activations needed):
    ``relative_error(*output_error_terms(...))``."""
    return relative_error(*output_error_terms(W, W_hat, H, damped_error, energy))


def relative_error(num: float, den: float) -> float:
    """``sqrt(num / den)`` (``sqrt(num)`` when the layer's outputs are all zero)."""
    return (num / den) ** 0.5 if den > 0 else num**0.5


def output_error_terms(
    W: torch.Tensor,
    W_hat: torch.Tensor,
    H: torch.Tensor,
    damped_error: Optional[tuple[float, float]] = None,
    energy: Optional[float] = None,
) -> tuple[float, float]:
    """``(‖WX − ŴX‖², ‖WX‖²)``: sums over rows, so a layer solved in row ranges adds its ranges' terms.

    The quadratic forms are float32 GEMMs with the row dot products summed in float64. With GPTQ's
    ``damped_error`` = (‖E‖², λ) the numerator needs no GEMM: the sweep's scaled errors E satisfy
    ``ΔW = E·U`` with ``UᵀU = (H + λI)⁻¹``, so ``tr(ΔW (H + λI) ΔWᵀ) = ‖E‖²`` exactly; subtract
    λ‖ΔW‖² (and the unit diagonal GPTQ gave dead inputs, whose weights it zeroed). ``energy``, when
    the caller has it (the calibration pass's own FP outputs, ``2/n Σ ‖W x‖²``), is the denominator
    ``tr(W H Wᵀ)`` without its GEMM."""
    W = W.float()
    if damped_error is None:
        num = max(quadratic_form(W - W_hat.float(), H), 0.0)
    else:
        dead = torch.diagonal(H) == 0
        swept_sq = _squared_distance(W, W_hat)
        dead_sq = 0.0
        if bool(dead.any()):  # GPTQ zeroed these weights and gave them H_ii = 1: it saw 0 − Ŵ there
            dead_sq = torch.linalg.vector_norm(W_hat[:, dead], dtype=torch.float64).item() ** 2
            swept_sq += dead_sq - _squared_distance(W[:, dead], W_hat[:, dead])
        error_sq, lam = damped_error
        num = max(error_sq - lam * swept_sq - dead_sq, 0.0)
    return num, (quadratic_form(W, H) if energy is None else energy)


def quadratic_form(W: torch.Tensor, H: torch.Tensor, rows: int = 256) -> float:
    """``tr(W H Wᵀ)`` in float32 GEMMs with the row dot products summed in float64, a few rows of
    ``W`` at a time (no out x in product in memory)."""
    H = H.float()
    total = torch.zeros((), dtype=torch.float64, device=W.device)
    for i in range(0, W.shape[0], rows):
        part = W[i : i + rows]
        total += torch.mul(part @ H, part).sum(dtype=torch.float64)
    return total.item()


def _squared_distance(A: torch.Tensor, B: torch.Tensor, rows: int = 256) -> float:
    """``‖A − B‖²`` summed in float64, a few rows at a time: no full-size difference or float64
    copy (they were 3x the weight's fp32 size at the peak of a down_proj's solve)."""
    total = torch.zeros((), dtype=torch.float64, device=A.device)
    for i in range(0, A.shape[0], rows):
        total += torch.linalg.vector_norm(A[i : i + rows] - B[i : i + rows], dtype=torch.float64) ** 2
    return total.item()
