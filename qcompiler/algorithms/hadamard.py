"""Randomized Hadamard rotations (QuaRot, Ashkboos et al. 2024; QuIP#, Tseng et al. 2024).

A rotation here is ``R = diag(s) · (I ⊗ H_b / √b)``: random signs ``s`` (±1, from a seed), then
a Walsh–Hadamard transform on each block of ``b`` consecutive channels, ``b`` the largest power
of two dividing the width (a 4096-wide stream is one block; 1536 is three blocks of 512). ``R`` is
orthogonal, so ``(x R)(W R)ᵀ = x Wᵀ`` exactly in real arithmetic, and it spreads an outlier
channel over ``b`` channels: weights and activations become "incoherent", which is what makes
them easier to round.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

__all__ = ["block_size", "hadamard_matrix", "random_signs", "rotation_matrix", "rotate_last_dim"]


def block_size(width: int) -> int:
    """The largest power of two that divides ``width`` (the Hadamard block)."""
    return width & -width


@functools.lru_cache(maxsize=16)
def _sylvester(b: int) -> Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_matrix(b: int, dtype=torch.float32, device=None) -> Tensor:
    """``H_b / √b`` (Sylvester's construction; symmetric and orthogonal), ``b`` a power of two."""
    if b < 1 or b & (b - 1):
        raise ValueError(f"a Hadamard block must be a power of two, got {b}")
    return (_sylvester(b) / math.sqrt(b)).to(dtype=dtype, device=device)


def random_signs(width: int, seed: int) -> Tensor:
    """``width`` random ±1 (int8) from ``seed``: the same rotation on every machine."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (width,), generator=g, dtype=torch.int8) * 2 - 1).to(torch.int8)


def rotation_matrix(signs: Tensor, block: int) -> Tensor:
    """The dense ``R = diag(s) · blockdiag(H_b/√b)`` in float64 (for rotating stored weights)."""
    width = signs.numel()
    h = hadamard_matrix(block, torch.float64)
    return signs.double().unsqueeze(1) * torch.block_diag(*([h] * (width // block)))


def rotate_last_dim(x: Tensor, signs: Tensor, block: int) -> Tensor:
    """``x @ R`` along the last dimension, computed in float32 (or float64 for float64 ``x``)."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    xs = x.to(dtype) * signs.to(dtype=dtype, device=x.device)
    return (xs.unflatten(-1, (-1, block)) @ hadamard_matrix(block, dtype, x.device)).flatten(-2)
