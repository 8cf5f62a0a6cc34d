"""Floating-point element grids, the formats GPUs serve today: FP8 (e4m3 elements with an fp32 scale
per output channel or per 128 × 128 block), NVFP4 (e2m1 elements, an e4m3 scale per 16 inputs and
one fp32 global scale) and MXFP4 (e2m1 elements, a power-of-two e8m0 scale per 32 inputs).

A weight ``w`` is stored as ``element · scale``: ``element`` is ``round(w / scale)`` on the element
type's grid (round to nearest, ties to even, saturating at its largest value), ``scale`` is its
cell's. The arithmetic is compressed-tensors' (its decompressor is the reference for these
checkpoints): NVFP4's stored group scale is in global-scaled units, ``scale = stored / global``
with ``global = 448 · 6 / max|W|`` (compressed-tensors' convention; ModelOpt stores the reciprocal);
MXFP4's min-max exponent rounds ``max|w|`` to a power of two the way compressed-tensors does.

``kind="mse"`` searches each cell's scale among the min-max one shrunk by a few factors (and, for
power-of-two scales, the next one up) for the least squared error weighted by how much each input
column matters — the Hessian's diagonal for round-to-nearest, ``1/[H⁻¹]_jj`` for GPTQ.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

__all__ = [
    "FloatFormat",
    "FLOAT_FORMATS",
    "ELEMENT_MAX",
    "E2M1_VALUES",
    "round_to_element",
    "pack_e2m1",
    "unpack_e2m1",
    "global_scale",
    "fit_scales",
    "effective_scales",
    "per_element",
    "quantize_elements",
    "dequantize",
    "FloatQuant",
    "float_rtn",
]

ELEMENT_MAX = {"e4m3": 448.0, "e2m1": 6.0}
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of the 3 low bits of an e2m1 code
# Scale factors the "mse" kind tries on each cell's max|w|: 1 (min-max) down to 0.7 (the elements are
# floats: clipping buys less than on an integer grid); power-of-two scales also try the next one up.
SCALE_FACTORS = tuple(1.0 - 0.025 * i for i in range(13))


class FloatFormat(NamedTuple):
    """One format: its element type, the cell a scale covers (``rows`` × ``group`` inputs; group -1:
    the whole row) and how the scale is stored."""

    name: str
    element: str  # "e4m3" | "e2m1"
    group: int  # input columns per scale; -1: one scale per output row
    rows: int  # output rows per scale (FP8 block: 128)
    scale_dtype: str  # "fp32" | "e4m3" | "e8m0"
    has_global: bool  # NVFP4: an fp32 global scale per tensor

    @property
    def bits(self) -> int:
        """Bits per stored element."""
        return 8 if self.element == "e4m3" else 4


FLOAT_FORMATS = {
    "fp8": FloatFormat("fp8", "e4m3", -1, 1, "fp32", False),
    "fp8-block": FloatFormat("fp8-block", "e4m3", 128, 128, "fp32", False),
    "nvfp4": FloatFormat("nvfp4", "e2m1", 16, 1, "e4m3", True),
    "mxfp4": FloatFormat("mxfp4", "e2m1", 32, 1, "e8m0", False),
}


_SCALE_BITS = {"fp32": 32, "e4m3": 8, "e8m0": 8}


def float_stored_bits(fmt: FloatFormat, n_out: int, n_in: int) -> int:
    """Bits a ``[n_out, n_in]`` weight stores in format ``fmt``: its elements, one scale per
    ``rows x group`` cell (per row when ``group`` is -1), and NVFP4's fp32 global scale."""
    cols = 1 if fmt.group == -1 else -(-n_in // fmt.group)
    cells = cols * -(-n_out // fmt.rows)
    return n_out * n_in * fmt.bits + cells * _SCALE_BITS[fmt.scale_dtype] + (32 if fmt.has_global else 0)


def round_to_element(x: Tensor, element: str) -> Tensor:
    """``x`` (float32) rounded to the nearest value of ``element``, ties to even, saturating."""
    if element == "e4m3":
        return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    # e2m1's steps are 0.5 below 2, 1 below 4, 2 above: rounding half to even at the step is ties to
    # the even code (0.25 -> 0, 0.75 -> 1, 5 -> 4; tested against compressed-tensors' thresholds)
    a = x.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    q = torch.round(a / step).mul_(step).clamp_(max=6.0)
    return torch.where(x < 0, -q, q)


def _e2m1_codes(values: Tensor) -> Tensor:
    """The 4-bit codes (sign bit 3, magnitude index bits 0–2) of values already on the e2m1 grid."""
    index = torch.searchsorted(torch.tensor(E2M1_VALUES, device=values.device), values.abs())
    return (index | (torch.signbit(values).to(torch.int64) << 3)).to(torch.uint8)


def pack_e2m1(values: Tensor) -> Tensor:
    """e2m1 values ``[rows, n]`` (n even) as ``uint8 [rows, n/2]``: column ``2k`` in the low nibble,
    ``2k + 1`` in the high one (compressed-tensors' and vLLM's order)."""
    codes = _e2m1_codes(values)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_e2m1(packed: Tensor, n: int) -> Tensor:
    """The float32 e2m1 values ``[rows, n]`` that ``pack_e2m1`` stored."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)[:, :n]
    values = torch.tensor(E2M1_VALUES, device=packed.device)[(codes & 0x07).long()]
    return torch.where((codes & 0x08) != 0, -values, values)


def global_scale(W: Tensor, fmt: FloatFormat, amax: Optional[float] = None) -> Optional[Tensor]:
    """NVFP4's fp32 ``[1]`` global scale ``448 · 6 / max|W|`` (1 for an all-zero W; ``amax``: the
    max|W| of every layer sharing the scale, when ``W`` is one of several); None for the others."""
    if not fmt.has_global:
        return None
    amax = W.detach().abs().amax().float() if amax is None else torch.tensor(float(amax), device=W.device)
    g = 448.0 * 6.0 / amax.clamp(min=torch.finfo(torch.float32).tiny)
    return torch.where(torch.isfinite(g), g, torch.ones_like(g)).reshape(1)


def _cells(x: Tensor, fmt: FloatFormat, reduce: str) -> Tensor:
    """``x`` ``[out, in]`` reduced over each scale cell (``amax`` of |x| or ``sum``): ``[row cells, col cells]``."""
    out, n = x.shape
    rows = fmt.rows
    group = n if fmt.group == -1 else fmt.group
    pr, pc = -out % rows, -n % group
    if pr or pc:
        x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    x = x.reshape((out + pr) // rows, rows, (n + pc) // group, group)
    return x.abs().amax(dim=(1, 3)) if reduce == "amax" else x.sum(dim=(1, 3))


def per_element(cells: Tensor, fmt: FloatFormat, shape: torch.Size) -> Tensor:
    """Each element's value of a per-cell tensor ``[row cells, col cells]``, as ``shape`` ``[out, in]``."""
    out, n = shape
    group = n if fmt.group == -1 else fmt.group
    return cells.repeat_interleave(fmt.rows, 0)[:out].repeat_interleave(group, 1)[:, :n]


def _stored_from_amax(amax: Tensor, fmt: FloatFormat, g: Optional[Tensor]) -> Tensor:
    """The stored scale of cells whose largest magnitude is ``amax`` (min-max rule)."""
    top = ELEMENT_MAX[fmt.element]
    if fmt.scale_dtype == "fp32":
        scale = amax / top
        return torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero cell: codes 0 on any scale
    if fmt.scale_dtype == "e4m3":  # in global-scaled units
        return (amax / top * g).clamp(max=448.0).to(torch.float8_e4m3fn)
    # e8m0: max|w| rounded to a power of two at e2m1's mantissa width (up from 1.75 · 2^e), minus e2m1's 2
    bits = amax.clamp(min=2.0**-126).view(torch.int32)
    rounded = ((bits + (1 << 21)) & ~((1 << 23) - 1)).view(torch.float32)
    exponent = torch.floor(torch.log2(rounded)) - 2
    return (exponent + 127).clamp(0, 254).to(torch.uint8)


def effective_scales(stored: Tensor, fmt: FloatFormat, g: Optional[Tensor]) -> Tensor:
    """The float32 scale each cell's elements are multiplied by (compressed-tensors' arithmetic)."""
    if fmt.scale_dtype == "fp32":
        return stored.float()
    if fmt.scale_dtype == "e4m3":
        return stored.float() / g
    return torch.exp2(stored.to(torch.int32).float() - 127.0)


def quantize_elements(W: Tensor, scale: Tensor, element: str) -> Tensor:
    """``W / scale`` on the element grid (``scale`` per element; where it is 0, the element is 0)."""
    divisor = torch.where(scale != 0, scale, torch.full_like(scale, float("inf")))
    return round_to_element(W / divisor, element)


def dequantize(elements: Tensor, stored: Tensor, fmt: FloatFormat, g: Optional[Tensor] = None) -> Tensor:
    """The float32 weight ``[out, in]`` that element values and stored scales stand for (the plain-torch
    twin of every float layout's op)."""
    return elements.float() * per_element(effective_scales(stored, fmt, g), fmt, elements.shape)


def fit_scales(
    W: Tensor, fmt: FloatFormat, g: Optional[Tensor], kind: str = "minmax", importance: Optional[Tensor] = None
) -> Tensor:
    """Each cell's stored scale for ``W`` ``[out, in]``: min-max, or (``kind="mse"``) the candidate with
    the least ``Σ importance_j (w − ŵ)²`` over the cell (``importance`` ``[in]``; None: plain error)."""
    W = W.detach().float()
    amax = _cells(W, fmt, "amax")
    best = _stored_from_amax(amax, fmt, g)
    if kind == "minmax":
        return best
    if kind != "mse":
        raise ValueError(f"scale kind {kind!r} is not 'minmax' or 'mse'")
    factors = SCALE_FACTORS + ((1.3,) if fmt.scale_dtype == "e8m0" else ())
    best_err = _cell_error(W, best, fmt, g, importance)
    for p in factors[1:]:
        candidate = _stored_from_amax(amax * p, fmt, g)
        err = _cell_error(W, candidate, fmt, g, importance)
        best = _choose(err < best_err, candidate, best)
        best_err = torch.minimum(err, best_err)
    return best


def _choose(better: Tensor, candidate: Tensor, best: Tensor) -> Tensor:
    """``torch.where`` for stored scales (float8 has no ``where``: its bytes are chosen as uint8)."""
    if candidate.dtype != torch.float8_e4m3fn:
        return torch.where(better, candidate, best)
    return torch.where(better, candidate.view(torch.uint8), best.view(torch.uint8)).view(torch.float8_e4m3fn)


def _cell_error(W: Tensor, stored: Tensor, fmt: FloatFormat, g, importance) -> Tensor:
    scale = per_element(effective_scales(stored, fmt, g), fmt, W.shape)
    err = (W - quantize_elements(W, scale, fmt.element) * scale).square_()
    if importance is not None:
        err.mul_(importance)
    return _cells(err, fmt, "sum")


class FloatQuant(NamedTuple):
    """One matrix on a float grid."""

    elements: Tensor  # float32 [out, in], on the element grid
    scales: Tensor  # stored scales per cell: float32, float8_e4m3fn or uint8 (e8m0)
    global_scale: Optional[Tensor]  # NVFP4: float32 [1]
    dequantized: Tensor  # float32 [out, in]: what the stored tensors stand for
    damped_error: Optional[tuple[float, float]] = None  # GPTQ's (‖E‖², λ)


def float_rtn(
    W: Tensor,
    fmt: FloatFormat,
    kind: str = "minmax",
    importance: Optional[Tensor] = None,
    global_amax: Optional[float] = None,
) -> FloatQuant:
    """Round-to-nearest of ``W`` ``[out, in]`` on ``fmt``'s grid (``global_amax``: see ``global_scale``)."""
    W = W.detach().float()
    g = global_scale(W, fmt, global_amax)
    stored = fit_scales(W, fmt, g, kind, importance)
    scale = per_element(effective_scales(stored, fmt, g), fmt, W.shape)
    elements = quantize_elements(W, scale, fmt.element)
    return FloatQuant(elements, stored, g, elements * scale)
