"""SpQR (Dettmers et al., ICLR 2024): small-group GPTQ with quantized statistics and fp16 outliers.

The sweep is GPTQ's (act-order permutation, Cholesky of ``H⁻¹``, lazy block updates) with three
changes, each per group of ``β1`` consecutive (permuted) columns:

1. Outlier-aware statistics: for every weight, the OBS error of the group
   ``Σ_k ((w_k − q(w_k)) / U_kk)²`` is compared with the error when that weight is left out of
   the grid fit (leave-one-out). Weights whose removal cuts the error by more than ``τ`` are
   excluded from the fit (replaced by the row's mean of the others).
2. Bi-level statistics: the group's per-row scale and zero are min-max quantized to
   ``stat_bits`` over ``β2`` consecutive output rows, each such run storing an fp16 step and
   fp16 minimum (``v ≈ step · code + minimum``) — separately for scales and zeros.
3. Outliers: a weight whose OBS error ``((w − q(w)) / U_jj)²`` under those statistics still exceeds
   ``τ`` is kept in fp16 at its GPTQ-updated value (the sparse branch stores ``w − dense(w)``, so
   dense + sparse reproduce it) and propagates no error.

``τ`` is relative, as in the reference: ``τ_abs = τ · mean_j(var_rows(W[:, j]) / U_jj²)``.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from qcompiler.algorithms.gptq import HessianFactor, hessian_factor, swept_copy
from qcompiler.algorithms.quant_grid import Grid, _grid_for_range
from qcompiler.errors import QuantizationError

__all__ = [
    "SpQRResult",
    "SpQRPart",
    "spqr_quantize",
    "spqr_quantize_many",
    "spqr_quantize_reference",
    "leave_one_out_reduction",
    "quantize_stats",
    "check_spqr_spec",
]


class SpQRResult(NamedTuple):
    """One SpQR layer: dense codes and quantized statistics, outlier mask and values, dequantized weight."""

    codes: torch.Tensor  # int32 [out, in] weight codes, permuted column order
    scale_codes: torch.Tensor  # int32 [groups, out] (stat_bits) — or None-like empty when unquantized
    zero_codes: torch.Tensor  # int32 [groups, out]
    scale_stats: torch.Tensor  # float16 [groups, out/β2, 2]: (step, minimum) of the scales
    zero_stats: torch.Tensor  # float16 [groups, out/β2, 2]: (step, minimum) of the zeros
    scales: torch.Tensor  # float32 [groups, out]: dequantized first-level scales
    zeros: torch.Tensor  # float32 [groups, out]: dequantized first-level zeros
    perm: torch.Tensor  # int64 [in]: processing order (act-order), identity otherwise
    outliers: torch.Tensor  # bool [out, in], original column order
    outlier_values: torch.Tensor  # float16 [out, in]: w − dense(w) where outliers, else 0
    dense: torch.Tensor  # float32 [out, in]: the dense branch's weight, original order
    dequantized: torch.Tensor  # float32 [out, in]: dense + outliers (what the layer computes)
    damp: float
    damp_steps: int
    threshold: float  # absolute τ used


def check_spqr_spec(bits: int, group_size: int, stat_bits: Optional[int], stat_group_size: int) -> None:
    """Refuse SpQR settings the stored layout cannot hold."""
    if bits not in (2, 3, 4, 8):
        raise QuantizationError(f"bits={bits} is not supported; choose 2, 3, 4 or 8")
    if group_size < 2:
        raise QuantizationError(f"group_size={group_size} is not supported; SpQR needs groups of >= 2 columns")
    if stat_bits is not None and stat_bits not in (2, 3, 4, 8):
        raise QuantizationError(f"stat_bits={stat_bits} is not supported; choose 2, 3, 4, 8 or None")
    if stat_group_size < 1:
        raise QuantizationError(f"stat_group_size={stat_group_size} must be positive")


def quantize_stats(v: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min-max quantize a per-row statistic ``v`` [out] in runs of ``group`` rows.

    Returns (codes [out] int32, stats [out/group, 2] fp16 = (step, minimum), v̂ [out] float32).
    """
    runs = v.float().reshape(-1, group)
    lo, hi = runs.min(dim=1).values, runs.max(dim=1).values
    step = ((hi - lo) / (2**bits - 1)).half()
    minimum = lo.half()
    s, m = step.float().unsqueeze(1), minimum.float().unsqueeze(1)
    codes = torch.where(
        s > 0, torch.round((runs - m) / torch.where(s > 0, s, torch.ones_like(s))), torch.zeros_like(runs)
    ).clamp(0, 2**bits - 1)
    v_hat = (s * codes + m).reshape(-1)
    return codes.reshape(-1).to(torch.int32), torch.stack([step, minimum], dim=1), v_hat


def _grid_quant(w: torch.Tensor, grid: Grid, maxq) -> torch.Tensor:
    """Dequantized ``w`` on a grid whose zero may be fractional (bi-level statistics); ``maxq`` the
    largest code, an int or per row ``[rows, 1]`` (parts of several widths stacked)."""
    q = torch.round(w / grid.scale + grid.zero)
    q = q.clamp_(0, maxq) if isinstance(maxq, int) else q.clamp_(min=0).minimum(maxq)
    return grid.scale * (q - grid.zero), q


def leave_one_out_reduction(
    G: torch.Tensor, d: torch.Tensor, bits: int, maxq: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """For each weight of group ``G`` [out, k]: how much the group's OBS error (weights scaled by
    ``1/d``) drops when that weight is left out of the min-max fit and not quantized.

    The fit without weight ``i`` needs only the range of the others, which differs from the whole
    group's only where ``i`` is the row's minimum or maximum (then the second smallest or largest
    value bounds it). Every other weight leaves the grid as it is, so its reduction is just its own
    term of the error; only the two extremes of each row need a second rounding of the group — two
    ``[out, k]`` roundings instead of ``k`` (8x less work at groups of 16). ``maxq``: per-row largest
    codes ``[out, 1]`` instead of ``bits`` (rows of several widths stacked)."""
    levels = 2**bits - 1 if maxq is None else maxq
    v, ix = torch.sort(G, dim=1)
    base = _grid_for_range(v[:, :1], v[:, -1:], bits, sym=False, maxq=maxq)  # = fit_grid(G): the same range
    own = ((_grid_quant(G, base, levels)[0] - G) / d).square_()  # [out, k]
    base_err = own.sum(-1, keepdim=True)
    reduction = own
    for lo, hi, at in ((v[:, 1:2], v[:, -1:], ix[:, :1]), (v[:, :1], v[:, -2:-1], ix[:, -1:])):
        grid = _grid_for_range(lo, hi, bits, sym=False, maxq=maxq)
        err = ((_grid_quant(G, grid, levels)[0] - G) / d).square_()
        err.scatter_(1, at, 0.0)  # the left-out weight is not quantized under its own fit
        reduction = reduction.scatter(1, at, base_err - err.sum(-1, keepdim=True))
    return reduction


class _GroupState:
    """Fits one group's statistics (outlier-aware, optionally bi-level) and remembers them."""

    def __init__(
        self,
        n_out: int,
        n_groups: int,
        bits: int,
        stat_bits: Optional[int],
        stat_group: int,
        tau,
        device: torch.device,
        maxq: Optional[torch.Tensor] = None,
    ):
        """``tau``: a float, or per row ``[n_out, 1]``; ``maxq``: per-row largest codes (stacked parts)."""
        self.bits, self.stat_bits, self.stat_group, self.tau = bits, stat_bits, stat_group, tau
        self.maxq, self.outliers = maxq, not (isinstance(tau, float) and tau == float("inf"))
        self.scales = torch.zeros(n_groups, n_out, device=device)
        self.zeros = torch.zeros(n_groups, n_out, device=device)
        self.scale_codes = torch.zeros(n_groups, n_out, dtype=torch.int32, device=device)
        self.zero_codes = torch.zeros(n_groups, n_out, dtype=torch.int32, device=device)
        n_runs = n_out // stat_group if stat_bits is not None else 0
        self.scale_stats = torch.zeros(n_groups, n_runs, 2, dtype=torch.float16, device=device)
        self.zero_stats = torch.zeros(n_groups, n_runs, 2, dtype=torch.float16, device=device)

    def fit(self, g: int, G: torch.Tensor, d: torch.Tensor) -> Grid:
        if self.outliers:
            candidates = leave_one_out_reduction(G, d, self.bits, self.maxq) > self.tau
            keep = (~candidates).float()
            mean = (G * keep).sum(1, keepdim=True) / keep.sum(1, keepdim=True).clamp(min=1)
            G = torch.where(candidates, mean, G)
        grid = _grid_for_range(
            G.amin(dim=1, keepdim=True), G.amax(dim=1, keepdim=True), self.bits, False, maxq=self.maxq
        )
        scale, zero = grid.scale[:, 0], grid.zero[:, 0]
        if self.stat_bits is not None:
            self.scale_codes[g], self.scale_stats[g], scale = quantize_stats(scale, self.stat_bits, self.stat_group)
            self.zero_codes[g], self.zero_stats[g], zero = quantize_stats(zero, self.stat_bits, self.stat_group)
            scale = scale.clamp(min=1e-8)
        self.scales[g], self.zeros[g] = scale, zero
        return Grid(scale.unsqueeze(1), zero.unsqueeze(1))


def _quantize_column(w: torch.Tensor, grid: Grid, bits: int, d: float, tau: float):
    """Dense value, code, outlier mask and the fp16 outlier residual of one column: an outlier's OBS
    error ``((w − dense) / d)²`` exceeds ``τ``, i.e. ``|w − dense| > d·√τ``."""
    dense, code = _grid_quant(w.unsqueeze(1), grid, 2**bits - 1)
    dense, code = dense[:, 0], code[:, 0]
    outlier = (w - dense).abs() > d * math.sqrt(tau)
    residual = torch.where(outlier, w - dense, torch.zeros_like(w)).half()
    return dense, code, outlier, residual


def _check(n_out: int, n_in: int, group_size, stat_bits, stat_group_size, outlier_threshold) -> None:
    if n_in < group_size or n_in % group_size:
        raise QuantizationError(f"in_features={n_in} is not a multiple of the SpQR group size {group_size}")
    if stat_bits is not None and n_out % stat_group_size:
        raise QuantizationError(f"out_features={n_out} is not a multiple of stat_group_size={stat_group_size}")
    if not outlier_threshold > 0:
        raise QuantizationError(
            f"outlier_threshold={outlier_threshold} selects every weight as an outlier; "
            f"use a positive relative threshold (0.1-1.0 is typical) or outlier_fraction"
        )


def _absolute_tau(Wp: torch.Tensor, diag: torch.Tensor, outlier_threshold: float) -> float:
    """τ relative to the layer's column variances, ``τ · mean_j(var_rows(W[:, j]) / U_jj²)``."""
    if outlier_threshold == float("inf"):
        return float("inf")
    return outlier_threshold * (Wp.contiguous().var(dim=0) / diag.pow(2)).mean().item()


def _setup(W, H, bits, group_size, stat_bits, stat_group_size, outlier_threshold, act_order, damp):
    """The straightforward reference's start: its own factor of ``H``, ``W`` permuted."""
    check_spqr_spec(bits, group_size, stat_bits, stat_group_size)
    _check(*W.shape, group_size, stat_bits, stat_group_size, outlier_threshold)
    f = hessian_factor(H, damp, act_order)
    Wp = swept_copy(W, f)[1].t().contiguous()  # [out, in]: dead inputs zeroed, processing order
    perm = torch.arange(W.shape[1], device=Wp.device) if f.perm is None else f.perm
    tau = _absolute_tau(Wp, torch.diagonal(f.U), outlier_threshold)
    state = _GroupState(W.shape[0], W.shape[1] // group_size, bits, stat_bits, stat_group_size, tau, Wp.device)
    return Wp, f.U, perm, state, tau, f.damp, f.damp_steps


def _finish(codes, dense, residual, outlier, perm, state, rows: slice, tau, damp, steps) -> SpQRResult:
    """One part's result: its ``rows`` of the (stacked) sweep's tensors and statistics."""
    inv = torch.argsort(perm)
    dense_o, residual_o, outlier_o = dense[rows][:, inv], residual[rows][:, inv], outlier[rows][:, inv]
    deq = dense_o + residual_o.float()
    if outlier_o.all():
        raise QuantizationError("the outlier threshold selected every weight; raise it")
    runs = slice(rows.start // state.stat_group, rows.stop // state.stat_group) if state.stat_bits else slice(0, 0)
    return SpQRResult(
        codes[rows].to(torch.int32),
        state.scale_codes[:, rows],
        state.zero_codes[:, rows],
        state.scale_stats[:, runs],
        state.zero_stats[:, runs],
        state.scales[:, rows],
        state.zeros[:, rows],
        perm,
        outlier_o,
        residual_o,
        dense_o,
        deq,
        damp,
        steps,
        tau,
    )


class SpQRPart(NamedTuple):
    """Rows to quantize in a stacked SpQR sweep: ``W`` at ``bits``, with the outlier threshold relative
    to ``tau_weight`` (the whole layer's weight when ``W`` is some of its rows; None: ``W`` itself)."""

    W: torch.Tensor
    bits: int
    tau_weight: Optional[torch.Tensor] = None


def spqr_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    *,
    bits: int = 3,
    group_size: int = 16,
    stat_bits: Optional[int] = 3,
    stat_group_size: int = 16,
    outlier_threshold: float = 0.2,
    act_order: bool = True,
    damp: float = 0.01,
    block_size: int = 128,
    tau_weight: Optional[torch.Tensor] = None,
    factor: Optional[HessianFactor] = None,
) -> SpQRResult:
    """SpQR with lazy batch updates (blocks hold whole groups). ``tau_weight``: the whole layer's
    weight when ``W`` is a range of its rows (the relative threshold is the whole layer's; every
    other step is row by row, so the range's result equals those rows of the whole one's).
    ``factor``: ``hessian_factor(H, damp, act_order)`` when it is already computed (shared)."""
    return spqr_quantize_many(
        [SpQRPart(W, bits, tau_weight)],
        H,
        group_size=group_size,
        stat_bits=stat_bits,
        stat_group_size=stat_group_size,
        outlier_threshold=outlier_threshold,
        act_order=act_order,
        damp=damp,
        block_size=block_size,
        factor=factor,
    )[0]


def spqr_quantize_many(
    parts: list[SpQRPart],
    H: torch.Tensor,
    *,
    group_size: int = 16,
    stat_bits: Optional[int] = 3,
    stat_group_size: int = 16,
    outlier_threshold: float = 0.2,
    act_order: bool = True,
    damp: float = 0.01,
    block_size: int = 128,
    factor: Optional[HessianFactor] = None,
) -> list[SpQRResult]:
    """``[spqr_quantize(part.W, H, bits=part.bits, tau_weight=part.tau_weight, ...)]`` for every part,
    from one sweep over their stacked rows: every step is row by row given ``H``'s factor, so each
    part's result is its own solve's, bit for bit, while the sweep's per-column loop — the cost of a
    solve on a few hundred rows — runs once (``auto:B``'s two SpQR candidates of a layer)."""
    for part in parts:
        check_spqr_spec(part.bits, group_size, stat_bits, stat_group_size)
        _check(*part.W.shape, group_size, stat_bits, stat_group_size, outlier_threshold)
    if len({part.W.shape[1] for part in parts}) != 1:
        raise QuantizationError("spqr_quantize_many: the parts read different numbers of inputs")
    f = factor if factor is not None else hessian_factor(H, damp, act_order)
    perm = torch.arange(parts[0].W.shape[1], device=f.U.device) if f.perm is None else f.perm
    WT, bounds, taus = _stacked(parts, f, outlier_threshold)
    limits = _row_limits(parts, bounds, taus, torch.diagonal(f.U), WT.device)
    n_in, n_out = WT.shape
    state = _GroupState(
        n_out, n_in // group_size, parts[0].bits, stat_bits, stat_group_size,
        limits.tau, WT.device, None if isinstance(limits.top, int) else limits.top[:, None],
    )  # fmt: skip
    codes, dense, residual, outlier = _sweep(WT, f.U, state, group_size, block_size, limits)
    return [
        _finish(codes, dense, residual, outlier, perm, state, rows, tau, f.damp, f.damp_steps)
        for rows, tau in zip(bounds, taus)
    ]


def _stacked(parts: list[SpQRPart], f: HessianFactor, outlier_threshold: float):
    """The parts' ``Wᵀ`` side by side ``[in, Σ rows]`` in processing order, each part's rows (a slice of
    the stack) and its absolute τ (relative to its ``tau_weight``)."""
    diag = torch.diagonal(f.U)
    taus, columns, bounds = [], [], []
    for part in parts:
        WT = swept_copy(part.W, f)[1]  # [in, rows] in processing order
        Ws = WT.t() if part.tau_weight is None else swept_copy(part.tau_weight, f)[1].t()
        taus.append(_absolute_tau(Ws, diag, outlier_threshold))
        start = bounds[-1].stop if bounds else 0
        bounds.append(slice(start, start + WT.shape[1]))
        columns.append(WT)
    return (columns[0] if len(columns) == 1 else torch.cat(columns, dim=1)), bounds, taus


class _RowLimits(NamedTuple):
    """What the sweep bounds each row by: its largest code (an int when every part has the same width,
    else ``[rows]`` with ``low`` its zeros) and its outlier test (``root``·d for one τ, else ``bound[j]``,
    the per-row ``d_j·√τ`` formed in double as a part's own solve forms it, then rounded to float32)."""

    top: object
    low: Optional[torch.Tensor]
    tau: object
    root: float
    bound: Optional[torch.Tensor]


def _row_limits(parts, bounds, taus, diag: torch.Tensor, device) -> _RowLimits:
    def per_row(values) -> torch.Tensor:
        return torch.cat([torch.full((b.stop - b.start,), float(v), device=device) for b, v in zip(bounds, values)])

    one_width, one_tau = len({part.bits for part in parts}) == 1, len(set(taus)) == 1
    top = 2 ** parts[0].bits - 1 if one_width else per_row(2**part.bits - 1 for part in parts)
    low = None if one_width else torch.zeros_like(top)
    bound = None
    if not one_tau:
        root = torch.tensor([math.sqrt(t) for t in taus], dtype=torch.float64)[None, :] * diag.double()[:, None]
        bound = torch.cat([root[:, k : k + 1].expand(-1, b.stop - b.start) for k, b in enumerate(bounds)], 1).float()
    return _RowLimits(top, low, taus[0] if one_tau else per_row(taus)[:, None], math.sqrt(taus[0]), bound)


def _sweep(WT: torch.Tensor, U: torch.Tensor, state: _GroupState, group_size: int, block_size: int, limits):
    """SpQR's sweep over ``Wᵀ`` (rows in processing order, updated in place): codes, dense values, fp16
    outlier residuals and the outlier mask, each ``[out, in]``. As GPTQ's, a column is a contiguous
    row, each column's rounding and rank-1 update in-place vector ops (the column-strided version
    spent 0.7 of its 0.85 s at 640 x 2048 in temporaries); the same arithmetic as
    ``spqr_quantize_reference``, column by column."""
    n_in, n_out = WT.shape
    block_size = max(group_size, block_size // group_size * group_size)
    top, low, root, bound = limits.top, limits.low, limits.root, limits.bound
    codesT, denseT = torch.empty_like(WT), torch.empty_like(WT)
    residualT = torch.empty_like(WT, dtype=torch.float16)
    outlierT = torch.empty_like(WT, dtype=torch.bool)
    for i1 in range(0, n_in, block_size):
        i2 = min(i1 + block_size, n_in)
        W1, U1 = WT[i1:i2], U[i1:i2, i1:i2]
        d1 = torch.diagonal(U1)
        diag1 = d1.tolist()
        Err1 = torch.empty(i2 - i1, n_out, device=WT.device)
        for i in range(i2 - i1):  # 13 tensor ops per column: the loop's cost is their count
            j = i1 + i
            if j % group_size == 0:
                grid = state.fit(j // group_size, W1[i : i + group_size].t(), d1[i : i + group_size])
                scale, zero = grid.scale[:, 0], grid.zero[:, 0]
            w, d = W1[i], diag1[i]
            code = torch.div(w, scale, out=codesT[j]).add_(zero).round_()
            code = code.clamp_(0, top) if low is None else code.clamp_(min=low, max=top)
            diff = w - torch.sub(code, zero, out=denseT[j]).mul_(scale)
            outlier = torch.gt(diff.abs(), d * root if bound is None else bound[j], out=outlierT[j])
            residualT[j] = torch.where(outlier, diff, 0.0)
            torch.sub(diff, residualT[j], out=Err1[i]).div_(d)  # what the outlier's fp16 value leaves
            W1[i + 1 :].addr_(U1[i, i + 1 :], Err1[i], alpha=-1)
        WT[i2:].addmm_(U[i1:i2, i2:].t(), Err1, alpha=-1)
    return codesT.t(), denseT.t(), residualT.t(), outlierT.t()


def spqr_quantize_reference(
    W: torch.Tensor,
    H: torch.Tensor,
    *,
    bits: int = 3,
    group_size: int = 16,
    stat_bits: Optional[int] = 3,
    stat_group_size: int = 16,
    outlier_threshold: float = 0.2,
    act_order: bool = True,
    damp: float = 0.01,
) -> SpQRResult:
    """The same algorithm written straightforwardly: every column updates all later columns."""
    Wp, U, perm, state, tau, damp_used, steps = _setup(
        W, H, bits, group_size, stat_bits, stat_group_size, outlier_threshold, act_order, damp
    )
    n_out, n_in = Wp.shape
    codes, dense = torch.zeros_like(Wp), torch.zeros_like(Wp)
    residual = torch.zeros_like(Wp, dtype=torch.float16)
    outlier = torch.zeros_like(Wp, dtype=torch.bool)
    for j in range(n_in):
        if j % group_size == 0:
            grid = state.fit(j // group_size, Wp[:, j : j + group_size], torch.diagonal(U)[j : j + group_size])
        w = Wp[:, j].clone()
        dense[:, j], codes[:, j], outlier[:, j], residual[:, j] = _quantize_column(w, grid, bits, U[j, j].item(), tau)
        err = (w - dense[:, j] - residual[:, j].float()) / U[j, j]
        Wp[:, j + 1 :] -= err.unsqueeze(1) * U[j, j + 1 :].unsqueeze(0)
    return _finish(codes, dense, residual, outlier, perm, state, slice(0, n_out), tau, damp_used, steps)
