"""AWQ (Lin et al., MLSys 2024): activation-aware per-input-channel scales for weight quantization.

``Y = X Wᵀ = (X diag(s)⁻¹)(W diag(s))ᵀ``: scaling up the weight columns that meet large
activations lets the quantizer's grid spend its steps where the output is most sensitive. With
``a_j`` the typical magnitude of input channel ``j``, ``s = a^α`` (normalized so that
``max(s)·min(s) = 1``) and ``α`` is searched on a grid for the least quantized output error
``‖X Wᵀ − (X/s) Q(W·s)ᵀ‖²``, computed here from the inputs' Hessian ``H = 2/n XᵀX`` as
``tr(ΔW H ΔWᵀ)`` with ``ΔW = W − Q(W·s)/s`` (no activations kept). ``α = 0`` is no scaling, so the
search is never worse than plain rounding on this objective.

``a_j`` is the root mean square of channel ``j`` (``sqrt(H_jj / 2)``, read off the Hessian the
calibration already streams); the paper uses the mean absolute value.

``Q`` is round-to-nearest on the grid the weight pass after AWQ will use: an integer grid of
``bits`` / ``group_size`` (min-max by default), or a floating-point format (``grid="nvfp4"``,
``"mxfp4"``, ``"fp8"``, ...: ModelOpt's NVFP4_AWQ idea) — for NVFP4 the group's weights share one
global scale, as the layers vLLM fuses do.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from qcompiler.algorithms.float_grid import FLOAT_FORMATS, float_rtn
from qcompiler.algorithms.gptq import rtn_quantize
from qcompiler.algorithms.output_error import quadratic_form

__all__ = ["AWQ_ALPHAS", "awq_scales", "scaled_output_error", "scaled_output_error_reference", "search_awq_scales"]

AWQ_ALPHAS = tuple(round(0.05 * i, 2) for i in range(21))  # 0.0 … 1.0, the paper's grid of 20 steps


def awq_scales(act_magnitude: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s = a^α / sqrt(max(a^α)·min(a^α))`` per input channel; dead channels keep ``s = 1``."""
    a = act_magnitude.float()
    live = a > 0
    s = torch.where(live, a.clamp(min=1e-8).pow(alpha), torch.ones_like(a))
    if bool(live.any()):
        s = s / (s[live].max() * s[live].min()).sqrt()
    return torch.where(live, s.clamp(min=1e-4, max=1e4), torch.ones_like(s))


def _rounded(W: torch.Tensor, bits: int, group_size: int, grid: str, global_amax: Optional[float]) -> torch.Tensor:
    """``W`` rounded to the nearest point of the grid (dequantized)."""
    if grid in FLOAT_FORMATS:
        return float_rtn(W, FLOAT_FORMATS[grid], global_amax=global_amax).dequantized
    return rtn_quantize(W, bits=bits, group_size=group_size, grid=grid).dequantized


def _group_amax(weights: Sequence[torch.Tensor], s: torch.Tensor, grid: str) -> Optional[float]:
    """NVFP4: the largest scaled weight of the group (its shared global scale); else None."""
    if grid != "nvfp4":
        return None
    return max(float((W * s).abs().amax()) for W in weights)


def _quantized_over_s(W, s, bits: int, group_size: int, grid: str = "minmax", global_amax=None) -> torch.Tensor:
    return _rounded(W * s, bits, group_size, grid, global_amax) / s


def scaled_output_error(
    weights: Sequence[torch.Tensor],
    H: torch.Tensor,
    s: torch.Tensor,
    bits: int,
    group_size: int,
    energy: Optional[float] = None,
    grid: str = "minmax",
) -> float:
    """Relative output error of the consumers ``weights`` quantized after scaling by ``s``, from ``H``;
    ``energy``: their FP output energy ``Σ tr(W H Wᵀ)`` when the caller has it (the α search: once)."""
    amax = _group_amax(weights, s, grid)
    num = sum(quadratic_form(W - _quantized_over_s(W, s, bits, group_size, grid, amax), H) for W in weights)
    den = sum(quadratic_form(W, H) for W in weights) if energy is None else energy
    return (max(num, 0.0) / den) ** 0.5 if den > 0 else 0.0


def scaled_output_error_reference(
    X: torch.Tensor, weights: Sequence[torch.Tensor], s: torch.Tensor, bits: int, group_size: int, grid: str = "minmax"
) -> float:
    """The same error from the activations themselves: ``‖X Wᵀ − (X/s) Q(W·s)ᵀ‖ / ‖X Wᵀ‖``."""
    num = den = 0.0
    amax = _group_amax(weights, s, grid)
    for W in weights:
        ref = X @ W.t()
        out = (X / s) @ _rounded(W * s, bits, group_size, grid, amax).t()
        num += (ref - out).double().pow(2).sum().item()
        den += ref.double().pow(2).sum().item()
    return (num / den) ** 0.5 if den > 0 else 0.0


def search_awq_scales(
    weights: Sequence[torch.Tensor],
    H: torch.Tensor,
    bits: int,
    group_size: int,
    alphas: Sequence[float] = AWQ_ALPHAS,
    grid: str = "minmax",
) -> tuple[torch.Tensor, float, float, float]:
    """The scales of the best ``α``: ``(s, α, error, error without scaling)``."""
    act = (torch.diagonal(H).float().clamp(min=0) / 2).sqrt()
    energy = sum(quadratic_form(W, H) for W in weights)  # the same for every α
    best = None
    plain = None
    for alpha in alphas:
        s = awq_scales(act, alpha)
        err = scaled_output_error(weights, H, s, bits, group_size, energy, grid)
        if alpha == 0:
            plain = err
        if best is None or err < best[2]:
            best = (s, alpha, err)
    if plain is None:
        plain = scaled_output_error(weights, H, torch.ones_like(act), bits, group_size, energy, grid)
    return best[0], best[1], best[2], plain
