"""GPTQ on a floating-point grid (FP8, NVFP4, MXFP4): the same Hessian sweep as
``qcompiler.algorithms.gptq``, each column rounded to its cell's ``element · scale`` values.

The scales are fixed before a column is rounded, as on integer grids: with act-order, every cell's
scale from the original weights up front (static: the cells stay contiguous in the original column
order, which these formats need — they have no per-column group index); in natural order, each
column group's scales when the sweep reaches it, from weights that already carry every earlier
column's update (llm-compressor's GPTQ does NVFP4 this way). NVFP4's global scale comes from the
original weights. ``kind="mse"`` weighs each column's error by ``1/[H⁻¹]_jj``, GPTQ's own cost of it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from qcompiler.algorithms.float_grid import (
    FloatFormat,
    FloatQuant,
    effective_scales,
    fit_scales,
    global_scale,
    per_element,
    quantize_elements,
    round_to_element,
)
from qcompiler.algorithms.gptq import HessianFactor, hessian_factor
from qcompiler.errors import QuantizationError

__all__ = ["gptq_float_quantize", "gptq_float_reference"]


def gptq_float_quantize(
    W: Tensor,
    H: Optional[Tensor],
    fmt: FloatFormat,
    *,
    act_order: bool = True,
    static_groups: bool = True,
    damp: float = 0.01,
    block_size: int = 128,
    factor: Optional[HessianFactor] = None,
    kind: str = "mse",
    global_amax: Optional[float] = None,
) -> FloatQuant:
    """GPTQ with lazy batch updates on ``fmt``'s grid. ``W`` ``[out, in]``, ``H`` ``[in, in]`` (or
    ``factor``, shared by linears reading one input); ``global_amax``: NVFP4's max|W| over the
    layers that share its global scale (default: ``W``'s own)."""
    if act_order and not static_groups and fmt.group != -1:
        raise QuantizationError(
            f"grid={fmt.name!r} with act-order needs static groups: its scales cover contiguous input columns"
        )
    f = factor if factor is not None else hessian_factor(H, damp, act_order)
    W = W.detach().float().clone()
    W[:, f.dead] = 0.0
    out, n_in = W.shape
    perm, U = f.perm, f.U
    g = global_scale(W, fmt, global_amax)
    cost = None if kind == "minmax" else 1.0 / torch.diagonal(U).square()  # processing order
    static = perm is not None or fmt.group == -1
    if static:
        original_cost = None if cost is None or perm is None else cost[torch.argsort(perm)]
        stored = fit_scales(W, fmt, g, kind, cost if perm is None else original_cost)
        scaleT = per_element(effective_scales(stored, fmt, g), fmt, W.shape).t()
        scaleT = scaleT.contiguous() if perm is None else scaleT[perm].contiguous()
    else:
        group = fmt.group
        stored = None
        scaleT = torch.empty(n_in, out, device=W.device)
        cells: list[Tensor] = []
        block_size = max(group, block_size // group * group)  # a lazy block holds whole groups
    WT = W.t().contiguous() if perm is None else W.t().contiguous()[perm]
    del W
    QT, ET = torch.empty_like(WT), torch.empty_like(WT)
    diag = torch.diagonal(U).tolist()
    error_sq = torch.zeros((), dtype=torch.float64, device=WT.device)
    for i1 in range(0, n_in, block_size):
        i2 = min(i1 + block_size, n_in)
        W1, U1 = WT[i1:i2], U[i1:i2, i1:i2]
        Err1 = torch.empty_like(W1)
        for i in range(i2 - i1):
            j = i1 + i
            if not static and j % group == 0:  # this group's scales, from the weights as they are now
                upcoming = W1[i : i + group].t()
                imp = None if cost is None else cost[j : j + group]
                cell = fit_scales(upcoming, fmt, g, kind, imp)
                cells.append(cell)
                scaleT[j : j + upcoming.shape[1]] = per_element(effective_scales(cell, fmt, g), fmt, upcoming.shape).t()
            e = quantize_elements(W1[i], scaleT[j], fmt.element)
            ET[j] = e
            torch.mul(e, scaleT[j], out=QT[j])
            err = torch.sub(W1[i], QT[j], out=Err1[i]).div_(diag[j])
            W1[i + 1 :].addr_(U1[i, i + 1 :], err, alpha=-1)
        WT[i2:].addmm_(U[i1:i2, i2:].t(), Err1, alpha=-1)
        error_sq += torch.linalg.vector_norm(Err1).double() ** 2
    if stored is None:
        stored = torch.cat(cells, dim=1)
    if perm is not None:
        inv = torch.argsort(perm)
        QT, ET = QT[inv], ET[inv]
    return FloatQuant(ET.t().contiguous(), stored, g, QT.t().contiguous(), (float(error_sq), f.lam))


def gptq_float_reference(W: Tensor, H: Tensor, fmt: FloatFormat, damp: float = 0.01) -> Tensor:
    """The paper's algorithm written straightforwardly (natural order, min-max scales fitted when a
    group starts, no lazy batches, explicit inverse): the dequantized weight, for tests."""
    W = W.detach().double().clone()
    H = H.double().clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damp * torch.diagonal(H).mean() * torch.eye(H.shape[0], dtype=H.dtype)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    g = global_scale(W.float(), fmt)
    group = W.shape[1] if fmt.group == -1 else fmt.group
    Q = torch.zeros_like(W)
    scale = None
    for j in range(W.shape[1]):
        if j % group == 0:
            cell = fit_scales(W[:, j : j + group].float(), fmt, g, "minmax")
            scale = per_element(effective_scales(cell, fmt, g), fmt, (W.shape[0], group))[:, 0].double()
        safe = torch.where(scale != 0, scale, torch.full_like(scale, float("inf")))
        Q[:, j] = round_to_element((W[:, j] / safe).float(), fmt.element).double() * scale
        err = (W[:, j] - Q[:, j]) / Hinv[j, j]
        W[:, j:] -= err.unsqueeze(1) * Hinv[j, j:].unsqueeze(0)
    return Q.float()
