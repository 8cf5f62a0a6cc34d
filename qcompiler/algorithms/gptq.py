"""GPTQ (Frantar et al., 2023) and round-to-nearest as pure tensor functions.

GPTQ picks ``Q`` minimising ``‖WX − QX‖²`` column by column: after quantizing column ``j`` the
error ``(w_j − q_j)/[H⁻¹]_jj`` is spread over the not-yet-quantized columns through the upper
Cholesky factor of ``H⁻¹`` (``W[:, k] −= err · U[j, k]``). "Lazy batch" updates apply this inside
a block of ``block_size`` columns and push the block's accumulated error to all later columns in
one matmul. Groups get their grid when their first column is reached, from weights that already
carry every earlier update (block sizes are rounded to whole groups so that is always true).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from qcompiler.algorithms.finite import all_finite
from qcompiler.algorithms.float_grid import FLOAT_FORMATS
from qcompiler.algorithms.gguf_grids import FORMATS, BlockGrid, fit_grid, quantize_codes, sub_block_grid
from qcompiler.algorithms.packing import SUPPORTED_BITS
from qcompiler.algorithms.quant_grid import GRID_KINDS, Grid, dequantize_codes, fit, quantize
from qcompiler.errors import QuantizationError

__all__ = [
    "QuantResult",
    "HessianFactor",
    "hessian_factor",
    "check_spec",
    "inverse_hessian_cholesky",
    "gptq_quantize",
    "gptq_quantize_reference",
    "rtn_quantize",
    "group_index",
    "groups_in_column_order",
    "swept_copy",
    "GGUF_GRIDS",
    "FLOAT_GRIDS",
]

# floating-point grids (``qcompiler.algorithms.float_grid``): FP8, NVFP4, MXFP4, each in a layout of its own
FLOAT_GRIDS = tuple(FLOAT_FORMATS)

# llama.cpp's block grids (``qcompiler.algorithms.gguf_grids``): codes on sub-blocks of 32 (Q6_K, Q3_K: 16), each
# with its own scale·q − offset (K types: integer scales per super-block of 256; Q4_1: fp16); qc.gguf_linear.
GGUF_GRIDS = tuple(FORMATS)


class QuantResult(NamedTuple):
    """One quantized matrix: codes, per-group grid, column groups, its dequantized value, damping used."""

    codes: torch.Tensor  # int32 [out, in], original column order
    scales: torch.Tensor  # float32 [groups, out] (fp16-representable)
    zeros: torch.Tensor  # float32 [groups, out] (integers)
    g_idx: torch.Tensor  # int32 [in]: group of each input column
    dequantized: torch.Tensor  # float32 [out, in]: what the stored tensors stand for
    damp: float  # relative damping that made H positive definite (0 for RTN)
    damp_steps: int  # how many times damping was raised (0: the default sufficed)
    # GPTQ only: (‖E‖², λ) with E the sweep's scaled errors: tr(ΔW (H + λI) ΔWᵀ) = ‖E‖² (output_error)
    damped_error: Optional[tuple[float, float]] = None
    gguf_grid: Optional[BlockGrid] = None  # a llama.cpp grid (codes from 0, zeros 0): its stored scales


def check_spec(bits: int, group_size: int, grid: str = "minmax", float_grids: bool = False) -> None:
    """Refuse bit widths, group sizes and grid kinds the packed layout and kernels cannot hold
    (``float_grids``: the caller also takes FP8 / NVFP4 / MXFP4, as RTN and GPTQ do)."""
    kinds = GRID_KINDS + GGUF_GRIDS + (FLOAT_GRIDS if float_grids else ())
    if grid not in kinds:
        also = f" (the floating-point grids {FLOAT_GRIDS} are RTN's and GPTQ's)" if grid in FLOAT_GRIDS else ""
        raise QuantizationError(f"grid={grid!r} is not a grid kind; choose one of {kinds}{also}")
    if grid in FLOAT_GRIDS:
        fmt = FLOAT_FORMATS[grid]
        if (bits, group_size) != (fmt.bits, fmt.group):
            raise QuantizationError(
                f"grid={grid!r} stores {fmt.bits}-bit {fmt.element} elements with a scale per "
                f"{'output channel' if fmt.group == -1 else f'{fmt.group} inputs'}: it needs bits={fmt.bits} and "
                f"group_size={fmt.group}, got bits={bits}, group_size={group_size}"
            )
        return
    if grid in GGUF_GRIDS and (bits, group_size) != (FORMATS[grid].bits, FORMATS[grid].sub_block):
        need, width = FORMATS[grid].bits, FORMATS[grid].sub_block
        raise QuantizationError(
            f"grid={grid!r} is llama.cpp's {need}-bit codes in sub-blocks of {width}: it needs bits={need} and "
            f"group_size={width}, got bits={bits}, group_size={group_size}"
        )
    if bits not in SUPPORTED_BITS and grid not in GGUF_GRIDS:  # llama.cpp's bytes: any width it defines
        raise QuantizationError(f"bits={bits} is not supported; choose one of {SUPPORTED_BITS}")
    if group_size != -1 and group_size < 1:
        raise QuantizationError(f"group_size={group_size} is not supported; use -1 (per channel) or a positive size")


def group_index(in_features: int, group_size: int, perm: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Group of each original column. Contiguous groups of ``group_size`` (the last may be shorter)
    along the processing order ``perm`` (identity unless act-order without static groups)."""
    if group_size == -1:
        return torch.zeros(in_features, dtype=torch.int32)
    position = torch.arange(in_features)
    g = (position // group_size).to(torch.int32)
    if perm is None:
        return g
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[perm] = g
    return g_idx


def groups_in_column_order(g_idx: torch.Tensor, group_size: int) -> bool:
    """Whether ``g_idx`` is ``group_index``'s natural order (contiguous groups, no act-order gather)."""
    return group_size == -1 or torch.equal(g_idx.long(), group_index(g_idx.numel(), group_size).long())


def invert_lower_triangular_(L: torch.Tensor, parts: int = 4) -> torch.Tensor:
    """``L⁻¹`` in place of the lower-triangular ``L``, by column blocks: block ``[s, e)`` of ``L⁻¹``
    is zero above row ``s``, so only the trailing system ``L[s:, s:]`` is solved for it. torch has
    no triangular inverse (LAPACK trtri); one solve against the identity costs n³, four blocks
    ~0.5 n³ (measured 2.0x faster at n = 2816 and 4096, one thread; same values to 1e-7). Later
    blocks read only columns ``>= e`` of ``L``, so each solved block overwrites its own columns:
    no second n x n buffer (67 MB at n = 4096)."""
    n = L.shape[0]
    edges = [round(n * i / parts) for i in range(parts + 1)]
    for s, e in zip(edges[:-1], edges[1:]):
        if e > s:
            rhs = torch.zeros(n - s, e - s, dtype=L.dtype, device=L.device)
            rhs[: e - s].fill_diagonal_(1.0)
            L[s:, s:e] = torch.linalg.solve_triangular(L[s:, s:], rhs, upper=False)
    return L


def inverse_hessian_cholesky(H: torch.Tensor, damp: float, max_steps: int = 6) -> tuple[torch.Tensor, float, int]:
    """Upper Cholesky factor of ``(H + λI)⁻¹`` with ``λ = damp·mean(diag H)``; damping ×10 until it works."""
    mean_diag = torch.diagonal(H).mean().item()
    for step in range(max_steps + 1):
        lam = damp * (10**step) * mean_diag
        # The upper factor of H⁻¹ without forming H⁻¹: with J the order reversal, chol(J H J) = L' gives
        # H = V Vᵀ for the upper V = J L' J, so H⁻¹ = (V⁻¹)ᵀ V⁻¹ and U = V⁻¹ = J L'⁻¹ J (one Cholesky and
        # one triangular solve instead of Cholesky, inverse, Cholesky: ~20 % faster, same U to 4e-7).
        damped = H.flip(0, 1)  # a copy; the reversal keeps the diagonal on the diagonal
        damped.diagonal().add_(lam)  # no n x n identity: this one copy of H is all the damping costs
        L, info = torch.linalg.cholesky_ex(damped)
        del damped
        if info.item() == 0:
            U = invert_lower_triangular_(L).flip(0, 1)  # two n x n buffers at a time besides H
            del L
            if all_finite(U):
                return U, damp * (10**step), step
    raise QuantizationError(f"the Hessian is not positive definite even with damping {damp * 10**max_steps:g}")


def _condition(H: torch.Tensor, act_order: bool):
    """``H`` with dead inputs (``H_ii = 0``) set to 1, in processing order (a copy when either
    changes it; callers never write to the result); the dead mask (original order) and the order
    (None: natural)."""
    dead = torch.diagonal(H) == 0
    if bool(dead.any()) or H.dtype != torch.float32:  # the caller's H is not modified: copy only to change it
        H = H.detach().clone().float()
        H[dead, dead] = 1.0
    perm = torch.argsort(torch.diagonal(H), descending=True) if act_order else None
    # index_select, not H[perm][:, perm]: the column gather by advanced indexing was 4x slower
    return (H if perm is None else H.index_select(0, perm).index_select(1, perm)), dead, perm


def _prepare(W: torch.Tensor, H: torch.Tensor, act_order: bool):
    H, dead, perm = _condition(H, act_order)
    W = W.detach().clone().float()
    W[:, dead] = 0.0
    return (W if perm is None else W[:, perm]), H, perm


class HessianFactor(NamedTuple):
    """What GPTQ needs from ``H``: linears that read one input (q/k/v, gate/up) share it, so the
    GPTQ pass factors their Hessian once (the O(in³) Cholesky steps were ~15 % of a run)."""

    dead: torch.Tensor  # [in] bool, original order: columns no calibration row reached
    perm: Optional[torch.Tensor]  # processing order (act-order), None: natural order
    U: torch.Tensor  # upper Cholesky factor of (H + λI)⁻¹, processing order
    damp: float
    damp_steps: int
    lam: float  # the absolute λ = damp · mean(diag H) (dead inputs' H_ii counted as 1)


def hessian_factor(H: torch.Tensor, damp: float, act_order: bool) -> HessianFactor:
    """The damped Hessian's inverse Cholesky factor (act-order permuted), shared by layers reading one input."""
    H, dead, perm = _condition(H, act_order)
    U, damp_used, steps = inverse_hessian_cholesky(H, damp)
    return HessianFactor(dead, perm, U, damp_used, steps, damp_used * torch.diagonal(H).mean().item())


def swept_copy(W: torch.Tensor, f: HessianFactor) -> tuple[torch.Tensor, torch.Tensor]:
    """``W`` in float32 with the inputs no calibration row reached zeroed, and the copy a sweep
    writes to: ``Wᵀ`` with its rows in ``f``'s processing order. Transpose first, then gather whole
    rows: gathering rows of the strided view was 3x slower (0.15 vs 0.05 s at 5632 x 1024). Always a
    copy: ``W.t().contiguous()`` is ``W``'s own storage when ``W`` is a transposed view (a GPT-2
    Conv1D weight: a sweep once overwrote the user's parameter)."""
    W = W.detach().float()
    if bool(f.dead.any()):
        W = W.clone()
        W[:, f.dead] = 0.0
    WT = W.t().clone(memory_format=torch.contiguous_format) if f.perm is None else W.t().contiguous()[f.perm]
    return W, WT


class _Groups:
    """Which grid column ``j`` (in processing order) uses, fitting it when a group starts."""

    def __init__(
        self,
        W0: torch.Tensor,
        bits: int,
        group_size: int,
        sym: bool,
        static: bool,
        perm: Optional[torch.Tensor],
        original: Optional[torch.Tensor] = None,
        grid: str = "minmax",
        importance: Optional[torch.Tensor] = None,
    ):
        """``importance`` [in], processing order: what an error in each column costs ("mse" grids)."""
        self.bits, self.group_size, self.sym = bits, group_size, sym
        self.kind, self.importance = grid, importance
        self.maxq = 2**bits - 1
        n_in = W0.shape[1]
        self.static = static and group_size != -1
        # Group bookkeeping stays on the CPU (read per column: no device sync); grids live with W.
        order = perm.cpu() if perm is not None else torch.arange(n_in)
        self.g_idx = group_index(n_in, group_size, None if self.static else order)
        self.col_group = self.g_idx[order].tolist()  # group of the j-th processed column
        n_groups = int(self.g_idx.max().item()) + 1
        self.scales = torch.zeros(n_groups, W0.shape[0], device=W0.device)
        self.zeros = torch.zeros(n_groups, W0.shape[0], device=W0.device)
        self.offsets: Optional[torch.Tensor] = None  # llama.cpp grids: value = scale · code − offset
        self.gguf_grid: Optional[BlockGrid] = None
        if grid in GGUF_GRIDS:
            self._init_gguf(W0, perm, original, importance)
        elif self.static:  # every grid from the original weights, groups contiguous in original order
            W_orig = original if original is not None else W0 if perm is None else W0[:, torch.argsort(perm)]
            imp = importance if importance is None or perm is None else importance[torch.argsort(perm)]
            whole = n_in // group_size  # the whole groups' grids in one call, the partial last one alone
            if whole:
                cut = whole * group_size
                tiled = None if imp is None else imp[:cut].view(1, whole, group_size).expand(W0.shape[0], -1, -1)
                grid = fit(
                    W_orig[:, :cut].reshape(-1, group_size),
                    bits,
                    sym,
                    grid,
                    None if tiled is None else tiled.reshape(-1, group_size),
                )
                self.scales[:whole] = grid.scale.view(-1, whole).t()
                self.zeros[:whole] = grid.zero.view(-1, whole).t()
            if whole < n_groups:
                rest = None if imp is None else imp[whole * group_size :]
                self._store(whole, fit(W_orig[:, whole * group_size :], bits, sym, grid, rest))
        self._rows: list = [None] * n_groups
        if self.static and self.gguf_grid is None:
            self._rows = list(zip(self.scales.unbind(0), (-self.zeros).unbind(0), (self.maxq - self.zeros).unbind(0)))

    def _store(self, g: int, grid: Grid) -> None:
        self.scales[g], self.zeros[g] = grid.scale[:, 0], grid.zero[:, 0]

    def _init_gguf(self, W0: torch.Tensor, perm, original, importance) -> None:
        """A llama.cpp grid: fitted whole from the original weights (static), or per stored block
        when the sweep reaches it (natural column order only: its sub-blocks are contiguous)."""
        rows, n_in = W0.shape
        self.block = FORMATS[self.kind].super_block
        if n_in % self.block:
            raise QuantizationError(f"grid={self.kind!r} needs a multiple of {self.block} input columns, got {n_in}")
        if perm is not None and not self.static:
            raise QuantizationError(f"grid={self.kind!r} with act-order needs static groups (contiguous sub-blocks)")
        self.offsets = torch.zeros_like(self.scales)
        floats = self.scales.new_zeros(rows, n_in // self.block)
        ints = torch.zeros(rows, n_in // self.group_size, dtype=torch.int32, device=W0.device)
        self.gguf_grid = BlockGrid(floats, floats.clone(), ints, ints.clone())
        if self.static:
            W_orig = original if original is not None else W0 if perm is None else W0[:, torch.argsort(perm)]
            imp = importance if importance is None or perm is None else importance[torch.argsort(perm)]
            self._store_gguf(0, fit_grid(self.kind, W_orig, imp))

    def _store_gguf(self, col: int, grid: BlockGrid) -> None:
        """Put ``grid`` (of the stored blocks from input column ``col`` on) into place."""
        sb, g = col // self.block, col // self.group_size
        for name, part in zip(BlockGrid._fields, grid):
            start = sb if name in ("d", "dmin") else g
            getattr(self.gguf_grid, name)[:, start : start + part.shape[1]] = part
        scale, offset = sub_block_grid(grid)
        self.scales[g : g + scale.shape[1]], self.offsets[g : g + scale.shape[1]] = scale.t(), offset.t()

    def grid_for(self, j: int, upcoming: torch.Tensor) -> Grid:
        """``upcoming``: current weights of the processed columns ``j, j+1, …`` (at least one group)."""
        g = self.col_group[j]
        starts_group = j == 0 or self.col_group[j - 1] != g
        if self.gguf_grid is not None:
            if not self.static and j % self.block == 0:  # natural order: column j is input column j
                imp = None if self.importance is None else self.importance[j : j + self.block]
                self._store_gguf(j, fit_grid(self.kind, upcoming[:, : self.block], imp))
            return Grid(self.scales[g].unsqueeze(1), self.offsets[g].unsqueeze(1))
        if not self.static and starts_group:
            width = upcoming.shape[1] if self.group_size == -1 else min(self.group_size, upcoming.shape[1])
            imp = None if self.importance is None else self.importance[j : j + width]
            self._store(g, fit(upcoming[:, :width], self.bits, self.sym, self.kind, imp))
        return Grid(self.scales[g].unsqueeze(1), self.zeros[g].unsqueeze(1))

    def sweep_rows(self, j: int, upcoming: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Column ``j``'s grid as the sweep uses it: rows ``scale``, ``−zero``, ``maxq − zero``
        (codes are clamped around 0 and shifted by ``zero`` once at the end). Static grids are
        looked up; the others are fitted on ``upcoming()`` when their group starts."""
        g = self.col_group[j]
        rows = self._rows[g]
        if rows is None:
            grid = self.grid_for(j, upcoming())
            scale, zero = grid.scale[:, 0], grid.zero[:, 0]
            rows = self._rows[g] = (scale, -zero, self.maxq - zero)
        return rows

    def gguf_rows(self, j: int, upcoming: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Column ``j``'s llama.cpp grid as the sweep uses it: rows ``scale`` (symmetric types': of either
        sign), ``offset`` and the divisor (the scale, or +inf where it is 0, so that such codes are 0)."""
        g = self.col_group[j]
        rows = self._rows[g]
        if rows is None:
            grid = self.grid_for(j, upcoming())
            scale, offset = grid.scale[:, 0], grid.zero[:, 0]
            rows = self._rows[g] = (scale, offset, torch.where(scale != 0, scale, torch.full_like(scale, float("inf"))))
        return rows


def _column_cost(U: torch.Tensor, grid: str) -> Optional[torch.Tensor]:
    """What an error in each column costs GPTQ once later columns compensate it: ``1/[H⁻¹]_jj``
    = ``1/U_jj²`` (processing order); None for min-max grids, which need no weights."""
    return None if grid == "minmax" else 1.0 / torch.diagonal(U).square()


def _finish(Q: torch.Tensor, codes: torch.Tensor, perm, groups: _Groups, damp: float, steps: int) -> QuantResult:
    if perm is not None:
        inv = torch.argsort(perm)
        Q, codes = Q[:, inv], codes[:, inv]
    g_idx = groups.g_idx.to(Q.device)
    return QuantResult(codes, groups.scales, groups.zeros, g_idx, Q, damp, steps, None, groups.gguf_grid)


def _sweep_block(
    WT: torch.Tensor,
    U: torch.Tensor,
    i1: int,
    i2: int,
    groups: "_Groups",
    QT: torch.Tensor,
    codesT: torch.Tensor,
    diag: list[float],
    group_size: int,
) -> torch.Tensor:
    """GPTQ's sweep over columns ``[i1, i2)`` of one lazy block (rows of ``WT``): quantize each,
    write its codes and dequantized value, spread its scaled error over the block's later columns;
    returns the block's scaled errors ``E`` (the caller spreads them past the block)."""
    W1, U1 = WT[i1:i2], U[i1:i2, i1:i2]
    Err1 = torch.empty(i2 - i1, WT.shape[1], device=WT.device)
    gguf_grid = groups.gguf_grid is not None
    for i in range(i2 - i1):
        j = i1 + i
        upcoming = lambda: W1[i:].t() if group_size != -1 else WT[j:].t()  # noqa: E731
        if gguf_grid:  # value = scale · code − offset, the offset a free value (not an integer zero)
            scale, offset, divisor = groups.gguf_rows(j, upcoming)
            q = torch.add(W1[i], offset, out=codesT[j]).div_(divisor).round_().clamp_(0, groups.maxq)
            torch.mul(q, scale, out=QT[j]).sub_(offset)
        else:
            scale, low, high = groups.sweep_rows(j, upcoming)
            # clamp(round(w/s), −z, maxq − z) + z is clamp(round(w/s) + z, 0, maxq) exactly (integers):
            # the zero is added to all codes at once below, and the dequantized value needs no subtraction
            q = torch.div(W1[i], scale, out=codesT[j]).round_().clamp_(low, high)
            torch.mul(q, scale, out=QT[j])
        err = torch.sub(W1[i], QT[j], out=Err1[i]).div_(diag[j])
        W1[i + 1 :].addr_(U1[i, i + 1 :], err, alpha=-1)
    return Err1


def gptq_quantize(
    W: torch.Tensor,
    H: Optional[torch.Tensor],
    *,
    bits: int,
    group_size: int = 128,
    sym: bool = False,
    act_order: bool = False,
    static_groups: bool = False,
    damp: float = 0.01,
    block_size: int = 128,
    factor: Optional[HessianFactor] = None,
    grid: str = "minmax",
) -> QuantResult:
    """GPTQ with lazy batch updates. ``W`` ``[out, in]``, ``H`` ``[in, in]`` (undamped, fp32).

    The sweep runs on ``Wᵀ`` so that a column of ``W`` is a contiguous row: each column's
    quantize / error / rank-1 update is a handful of in-place vector ops (``addr_``, no
    temporaries), the block's spill onto later columns one ``addmm_``. Same arithmetic as
    ``gptq_quantize_reference``, column by column. ``factor``: ``hessian_factor(H, damp,
    act_order)`` computed once for several linears with the same ``H`` (then ``H`` may be None).
    ``grid="mse"``: each group's range searched for the least error weighted by ``1/[H⁻¹]_jj``.
    """
    check_spec(bits, group_size, grid)
    f = factor if factor is not None else hessian_factor(H, damp, act_order)
    perm, U = f.perm, f.U
    W, WT = swept_copy(W, f)
    n_in = W.shape[1]
    groups = _Groups(WT.t(), bits, group_size, sym, static_groups, perm, W, grid, _column_cost(U, grid))
    del W
    if group_size != -1 and not groups.static:  # blocks hold whole groups (llama.cpp grids: whole stored blocks)
        unit = groups.block if groups.gguf_grid is not None else group_size
        block_size = max(unit, block_size // unit * unit)
    QT = torch.empty_like(WT)  # dequantized weight, transposed
    codesT = torch.empty_like(WT)  # integer codes as floats until the end
    diag = torch.diagonal(U).tolist()  # one sync per layer, not one per column
    error_sq = torch.zeros((), dtype=torch.float64, device=WT.device)  # ‖E‖², read once at the end (no sync per block)
    for i1 in range(0, n_in, block_size):
        i2 = min(i1 + block_size, n_in)
        Err1 = _sweep_block(WT, U, i1, i2, groups, QT, codesT, diag, group_size)
        WT[i2:].addmm_(U[i1:i2, i2:].t(), Err1, alpha=-1)
        error_sq += torch.linalg.vector_norm(Err1).double() ** 2
    WT = None  # the swept weights: freed before the outputs are converted
    codesT += groups.zeros[torch.tensor(groups.col_group, device=codesT.device)]  # each processed column's zero
    if perm is not None:  # back to the original column order: whole rows of the transposed tensors
        inv = torch.argsort(perm)
        QT, codesT = QT[inv], codesT[inv]
    # codes stay a transposed view: packing wants exactly [in, out] (pack_gptq's .t().contiguous() is free);
    # each float [in, out] buffer goes as soon as its copy exists (one out x in buffer less at the peak)
    codes = codesT.to(torch.int32).t()
    del codesT
    dequantized = QT.t().contiguous()
    del QT
    return QuantResult(
        codes,
        groups.scales,
        groups.zeros,
        groups.g_idx.to(dequantized.device),
        dequantized,
        f.damp,
        f.damp_steps,
        (error_sq.item(), f.lam),
        groups.gguf_grid,
    )


def gptq_quantize_reference(
    W: torch.Tensor,
    H: torch.Tensor,
    *,
    bits: int,
    group_size: int = 128,
    sym: bool = False,
    act_order: bool = False,
    static_groups: bool = False,
    damp: float = 0.01,
    grid: str = "minmax",
) -> QuantResult:
    """The same algorithm written straightforwardly: after each column, update every later column."""
    check_spec(bits, group_size, grid)
    W, H, perm = _prepare(W, H, act_order)
    n_out, n_in = W.shape
    U, damp_used, steps = inverse_hessian_cholesky(H, damp)
    groups = _Groups(W, bits, group_size, sym, static_groups, perm, None, grid, _column_cost(U, grid))
    Q = torch.zeros_like(W)
    codes = torch.zeros(n_out, n_in, dtype=torch.int32, device=W.device)
    for j in range(n_in):
        grid = groups.grid_for(j, W[:, j:])
        if groups.gguf_grid is not None:  # scale · code − offset (the Grid's zero holds the offset)
            scale, offset = grid.scale[:, 0], grid.zero[:, 0]
            safe = torch.where(scale != 0, scale, torch.ones_like(scale))
            q = torch.where(scale != 0, torch.round((W[:, j] + offset) / safe).clamp(0, 2**bits - 1), 0)
            codes[:, j] = q.to(torch.int32)
            Q[:, j] = q * scale - offset
        else:
            q = quantize(W[:, j : j + 1], grid, bits)
            codes[:, j] = q[:, 0]
            Q[:, j] = dequantize_codes(q, grid)[:, 0]
        err = (W[:, j] - Q[:, j]) / U[j, j]
        W[:, j + 1 :] -= err.unsqueeze(1) * U[j, j + 1 :].unsqueeze(0)
    return _finish(Q, codes, perm, groups, damp_used, steps)


def rtn_quantize(
    W: torch.Tensor,
    *,
    bits: int,
    group_size: int = 128,
    sym: bool = False,
    grid: str = "minmax",
    importance: Optional[torch.Tensor] = None,
) -> QuantResult:
    """Round-to-nearest on the same grid and groups: the baseline every method is measured against.
    ``grid="mse"`` searches each group's range for the least squared error, weighted per input column by
    ``importance`` (the Hessian's diagonal when calibrating)."""
    check_spec(bits, group_size, grid)
    W = W.detach().float()
    groups = _Groups(W, bits, group_size, sym, group_size != -1, None, None, grid, importance)
    if group_size == -1:
        groups._store(0, fit(W, bits, sym, grid, importance))
    g_idx = groups.g_idx.to(W.device)
    g = g_idx.long()
    scale, zero = groups.scales[g].t(), groups.zeros[g].t()  # [out, in]
    if groups.gguf_grid is not None:
        codes = quantize_codes(W, groups.gguf_grid, bits)
        offset = groups.offsets[g].t()
        return QuantResult(
            codes, groups.scales, groups.zeros, g_idx, scale * codes.float() - offset, 0.0, 0, None, groups.gguf_grid
        )
    codes = torch.clamp(torch.round(W / scale) + zero, 0, 2**bits - 1).to(torch.int32)
    return QuantResult(codes, groups.scales, groups.zeros, g_idx, scale * (codes.float() - zero), 0.0, 0)
