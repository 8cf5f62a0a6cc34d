"""The weight layout the low-bit kernels read, repacked once from the stored one when a graph is
prepared for the ``triton`` backend (the stored artifact layout never changes).

The stored GPTQ layout asks a kernel to gather each row's group through ``g_idx`` (act-order) and
to follow 3-bit codes across word boundaries; SpQR's asks it to dequantize bi-level statistics and
to gather activation columns through ``perm``. Here every weight is one shape:

* rows (input features) in the order the codes are grouped: act-order rows are sorted by group once,
  and ``perm`` says which activation column each row reads (the host gathers ``x`` by it, a
  ``rows × in`` copy, instead of the kernel gathering statistics per weight);
* groups of ``group_rows`` consecutive rows, so a tile's group is arithmetic, never a lookup;
* codes in bit planes of 2, 4 or 8 bits whose values never straddle a word — one int32 load yields
  16, 8 or 4 consecutive rows of one column; 3-bit codes are a 2-bit plane plus a 1-bit plane
  (still 3 bits per weight);
* scales and zeros unpacked to floats ``[groups, out]`` beside the codes (GPTQ's fp16 scales and
  integer zeros exactly; SpQR's statistics dequantized in the activations' precision).

:func:`dequantize_layout` is the plain-torch twin the kernels are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

import torch
import torch.nn.functional as F

from qcompiler.algorithms.packing import SUPPORTED_BITS, unpack_cols, unpack_rows
from qcompiler.kernels.tuning import UnsupportedKernel
from qcompiler.layouts.spqr import spqr_group_stats

__all__ = [
    "KernelLayout",
    "Outliers",
    "layout_from_gptq",
    "layout_from_spqr",
    "outliers_from_csr",
    "stack_experts",
    "dequantize_layout",
    "layout_linear_reference",
    "ROW_ALIGN",
]

ROW_ALIGN = 32  # rows are padded to a multiple of this: one word of the 1-bit plane


def plane_widths(bits: int) -> tuple[int, ...]:
    """Bit planes a ``bits``-bit code is stored in (low bits first)."""
    if bits not in SUPPORTED_BITS:
        raise UnsupportedKernel(f"kernel layout: {bits}-bit codes are not supported (supported: {SUPPORTED_BITS})")
    return (2, 1) if bits == 3 else (bits,)


def rows_per_word(bits: int) -> int:
    """Consecutive rows one word of the first plane holds (the kernels' unpack width)."""
    return 32 // plane_widths(bits)[0]


@dataclass(frozen=True)
class KernelLayout:
    """One quantized linear (or a stack of experts on a leading dim) in the kernels' layout.

    ``low`` is the first plane ``[*E, rows·w/32, out]``; ``high`` the 1-bit plane of 3-bit codes
    (``[*E, rows/32, out]``), else None. ``scales``/``zeros`` are ``[*E, groups, out]``; row ``r``
    belongs to group ``r // group_rows``. ``perm`` (``[*E, in]``) maps row → activation column,
    None when rows are already in column order. Rows past ``in_features`` are padding (code 0).
    """

    low: torch.Tensor
    high: Optional[torch.Tensor]
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: Optional[torch.Tensor]
    bits: int
    group_rows: int
    in_features: int
    out_features: int

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields that are set (what a graph stores as attributes)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def statics(self) -> dict:
        """The non-tensor fields (what a graph keeps as constants)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _TENSOR_FIELDS}

    def expert(self, e: int) -> "KernelLayout":
        """Expert ``e``'s layout out of a stack."""
        return replace(self, **{k: v[e] for k, v in self.tensors().items()})


_TENSOR_FIELDS = ("low", "high", "scales", "zeros", "perm")


@dataclass(frozen=True)
class Outliers:
    """SpQR's sparse outliers for the layout: CSR over output rows (``row_ptr`` ``[out + 1]``), each
    entry's output row (``rows``, for the fused decode kernel) and its column as a *layout row*
    (``cols``: the permuted position, since the kernels read the permuted activations)."""

    row_ptr: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    values: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every field by name (all are tensors)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def expert(self, e: int) -> "Outliers":
        """Expert ``e``'s outliers: its row of the experts' ``row_ptr`` ``[E, out + 1]`` points into
        the shared entry arrays, so nothing is sliced (or synchronized) per call."""
        return replace(self, row_ptr=self.row_ptr[e])


def _pack_plane(codes: torch.Tensor, width: int) -> torch.Tensor:
    """int codes ``[rows, out]`` (each < 2**width) → int32 words ``[rows·width/32, out]``, row r at bit
    ``(r mod 32/width)·width`` of word ``r // (32/width)``."""
    per_word = 32 // width
    grouped = codes.to(torch.int64).reshape(codes.shape[0] // per_word, per_word, *codes.shape[1:])
    shifts = (torch.arange(per_word, device=codes.device) * width).view(1, per_word, *(1,) * (codes.dim() - 1))
    words = (grouped << shifts).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _unpack_plane(words: torch.Tensor, width: int) -> torch.Tensor:
    per_word = 32 // width
    shifts = (torch.arange(per_word, device=words.device, dtype=torch.int32) * width).view(1, per_word, 1)
    return ((words.unsqueeze(1) >> shifts) & ((1 << width) - 1)).reshape(-1, words.shape[-1])


def _planes(codes: torch.Tensor, bits: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Codes ``[in, out]`` padded to ``ROW_ALIGN`` rows and cut into the layout's bit planes."""
    pad = -codes.shape[0] % ROW_ALIGN
    codes = F.pad(codes.to(torch.int32), (0, 0, 0, pad))
    if bits == 3:
        return _pack_plane(codes & 3, 2), _pack_plane(codes >> 2, 1)
    return _pack_plane(codes, bits), None


def _group_rows(group_size: int, in_features: int, bits: int) -> int:
    rows = -(-in_features // ROW_ALIGN) * ROW_ALIGN if group_size == -1 else group_size
    if group_size != -1 and (group_size <= 0 or group_size % rows_per_word(bits)):
        raise UnsupportedKernel(
            f"kernel layout: groups of {group_size} rows are not a multiple of the {rows_per_word(bits)} "
            f"rows one word holds at {bits} bits"
        )
    return rows


def layout_from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    group_size: int,
) -> KernelLayout:
    """The kernel layout of one ``qc.quant_linear`` weight. Act-order rows are sorted by group (stable);
    groups that are then not ``group_size`` consecutive rows (a hand-made ``g_idx``) are refused."""
    plane_widths(bits)
    K, N = g_idx.numel(), scales.shape[1]
    group_rows = _group_rows(group_size, K, bits)
    codes = unpack_rows(qweight, bits, K)  # [in, out]
    zeros = unpack_cols(qzeros, bits, N).to(scales.dtype)  # small integers: exact in fp16
    g = g_idx.long()
    perm = None
    if group_size != -1 and not torch.equal(g, torch.arange(K, device=g.device) // group_size):
        perm = torch.argsort(g, stable=True)
        if not torch.equal(g[perm], torch.arange(K, device=g.device) // group_size):
            raise UnsupportedKernel(
                f"kernel layout: g_idx does not assign {group_size} rows to each group (it is not a permutation "
                "of contiguous groups)"
            )
        codes = codes[perm]
    elif group_size == -1 and bool((g != 0).any()):
        raise UnsupportedKernel("kernel layout: per-channel weights (group_size -1) need g_idx all zero")
    low, high = _planes(codes, bits)
    return KernelLayout(low, high, scales.contiguous(), zeros.contiguous(), _as_index(perm), bits, group_rows, K, N)


def layout_from_spqr(
    codes: torch.Tensor,
    scale_codes: torch.Tensor,
    zero_codes: torch.Tensor,
    scale_stats: torch.Tensor,
    zero_stats: torch.Tensor,
    perm: torch.Tensor,
    bits: int,
    group_size: int,
    stat_bits: int,
    stat_group_size: int,
    stat_dtype: torch.dtype = torch.float32,
) -> KernelLayout:
    """The kernel layout of SpQR's dense branch: its codes are already in act-order rows; the bi-level
    statistics are dequantized once (``stat_dtype``: float32 for fp32 models, the activations'
    half type otherwise — 2 bits per weight of extra traffic at groups of 16, the price of no
    second-level dequantization per tile)."""
    plane_widths(bits)
    K = perm.numel()
    scales = spqr_group_stats(scale_codes, scale_stats, stat_bits, stat_group_size).clamp(min=1e-8)
    zeros = spqr_group_stats(zero_codes, zero_stats, stat_bits, stat_group_size)
    low, high = _planes(unpack_rows(codes, bits, K), bits)
    identity = torch.equal(perm.long(), torch.arange(K, device=perm.device))
    return KernelLayout(
        low,
        high,
        scales.to(stat_dtype).contiguous(),
        zeros.to(stat_dtype).contiguous(),
        None if identity else _as_index(perm),
        bits,
        _group_rows(group_size, K, bits),
        K,
        scales.shape[1],
    )


def _as_index(perm: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if perm is None else perm.to(torch.int64).contiguous()


def outliers_from_csr(
    row_ptr: torch.Tensor, col_idx: torch.Tensor, values: torch.Tensor, perm: Optional[torch.Tensor], value_dtype
) -> Outliers:
    """SpQR's CSR outliers with their columns renumbered to layout rows (``perm``'s inverse).

    ``row_ptr`` may be the experts' ``[E, out + 1]`` (each row pointing into the shared entries);
    ``perm`` is then ``[E, in]`` (or None)."""
    ptr = row_ptr.reshape(-1, row_ptr.shape[-1]).long()
    cols = col_idx.long()
    rows = torch.empty_like(cols)
    for e, expert_ptr in enumerate(ptr):
        start, end = int(expert_ptr[0]), int(expert_ptr[-1])
        counts = expert_ptr[1:] - expert_ptr[:-1]
        rows[start:end] = torch.repeat_interleave(torch.arange(counts.numel(), device=cols.device), counts)
        if perm is not None:
            expert_perm = perm.reshape(-1, perm.shape[-1])[e].long()
            inverse = torch.empty_like(expert_perm)
            inverse[expert_perm] = torch.arange(expert_perm.numel(), device=expert_perm.device)
            cols[start:end] = inverse[cols[start:end]]
    return Outliers(
        row_ptr.to(torch.int32).contiguous(),
        rows.to(torch.int32),
        cols.to(torch.int32),
        values.to(value_dtype).contiguous(),
    )


def stack_experts(layouts: list[KernelLayout]) -> KernelLayout:
    """Experts' layouts on a leading dim; experts without a permutation get the identity when
    another has one."""
    first = layouts[0]
    for other in layouts[1:]:
        if other.statics() != first.statics():
            raise UnsupportedKernel(f"kernel layout: experts differ in shape or grouping ({other.statics()})")
    if any(layout.perm is not None for layout in layouts):
        identity = torch.arange(first.in_features, device=first.low.device)
        layouts = [replace(x, perm=identity if x.perm is None else x.perm) for x in layouts]
    stacked = {name: torch.stack([layout.tensors()[name] for layout in layouts]) for name in layouts[0].tensors()}
    return replace(first, **stacked)


def dequantize_layout(layout: KernelLayout) -> torch.Tensor:
    """The float32 weight ``[out, in]`` (original column order) the layout stands for."""
    codes = _unpack_plane(layout.low, plane_widths(layout.bits)[0])
    if layout.high is not None:
        codes = codes | (_unpack_plane(layout.high, 1) << 2)
    codes = codes[: layout.in_features]  # rows past it are padding
    g = torch.arange(codes.shape[0], device=codes.device) // layout.group_rows
    w_rows = (codes.float() - layout.zeros[g].float()) * layout.scales[g].float()  # [rows, out]
    if layout.perm is None:
        return w_rows.t()
    w = torch.empty_like(w_rows)
    w[layout.perm] = w_rows
    return w.t()


def layout_linear_reference(
    x: torch.Tensor, layout: KernelLayout, bias: Optional[torch.Tensor], outliers: Optional[Outliers] = None
) -> torch.Tensor:
    """The plain-torch twin of :func:`qcompiler.kernels.layout_linear`."""
    y = F.linear(x, dequantize_layout(layout).to(x.dtype), None if bias is None else bias.to(x.dtype))
    if outliers is not None:
        xs = x if layout.perm is None else x.index_select(-1, layout.perm)
        contrib = xs[..., outliers.cols.long()] * outliers.values.to(x.dtype)
        y = y.index_add(-1, outliers.rows.long(), contrib)
    return y
