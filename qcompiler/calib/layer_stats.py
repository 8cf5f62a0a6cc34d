"""One observed linear's streamed input statistics: the Hessian ``H = 2/n Σ x xᵀ`` (summed in
float64 by blocked GEMMs of its upper triangle, read as float32), per-channel ``max|x|``, the row
count and the layer's own output energy; combined exactly across ranks (``reduce_across_ranks``).
Rows reach them in float32 chunks, never as a float32 copy of the whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from qcompiler.errors import CalibrationError

__all__ = ["LayerStats", "float_row_chunks", "check_finite_stats"]


_HESSIAN_BLOCKS = 4  # x xᵀ as 4 x 4 blocks, upper triangle only: 10 of 16 GEMM blocks (measured
_BLOCKED_FROM = 512  # 1.5-2.2x faster than one full addmm at widths 1024-4096; below 512 no gain)


def _block_starts(width: int) -> tuple[range, int]:
    """Row blocks of an ``[width, width]`` sum: 4 x 4 blocks from ``_BLOCKED_FROM`` up, one below."""
    step = -(-width // _HESSIAN_BLOCKS) if width >= _BLOCKED_FROM else width
    return range(0, width, step), step


def _mirror_upper(H: torch.Tensor) -> None:
    """Copy the block upper triangle onto the lower one: H becomes exactly symmetric."""
    starts, step = _block_starts(H.shape[0])
    for i in starts:
        H[i + step :, i : i + step].copy_(H[i : i + step, i + step :].t())
        diagonal = H[i : i + step, i : i + step]
        diagonal.copy_(torch.triu(diagonal) + torch.triu(diagonal, 1).t())


_CHUNK_ELEMENTS = 1 << 22  # rows are upcast to float32 in chunks of 16 MB, not a copy of the whole batch


def float_row_chunks(rows: torch.Tensor) -> Iterator[torch.Tensor]:
    """``rows`` ``[n, width]`` as float32 chunks of consecutive rows: statistics of a bf16 batch
    need no float32 copy of all of it (a down_proj input at 8 x 512 tokens: 67 MB)."""
    step = max(1, _CHUNK_ELEMENTS // max(1, rows.shape[-1]))
    for i in range(0, rows.shape[0], step):
        yield rows[i : i + step].float()


def _add_batch_products(total: torch.Tensor, rows: torch.Tensor) -> None:
    """``total += xᵀx`` for one batch's rows: the product in float32 (GEMMs over row chunks), then
    added to the float64 ``total``, on the block upper triangle only (a symmetric rank-k update,
    which torch has no call for: 10 of 16 GEMM blocks, 1.5-2.2x faster than one full GEMM at widths
    1024-4096).

    Why float64: each batch's float32 product is one number per entry, and a float64 sum of B
    float32 numbers is exact while they span less than 2^(28 - log2 B) in magnitude (2^24 at 16
    batches; only an entry that is nearly 0 in some batch but not in others exceeds it), so the total
    does not depend on the order batches are added in: a run split over ranks sums to the bits of
    one process's run (``qcompiler/distributed/``)."""
    starts, step = _block_starts(total.shape[0])
    for i in starts:
        part = None
        for chunk in float_row_chunks(rows):
            a, b = chunk[:, i : i + step].t(), chunk[:, i:]
            part = a @ b if part is None else part.addmm_(a, b)
        total[i : i + step, i:].add_(part)


@dataclass
class LayerStats:
    """Streaming statistics of one linear's input rows."""

    in_features: int
    want_hessian: bool = True
    absmax: Optional[torch.Tensor] = None  # [in] max |x| per input channel
    rows: int = 0
    keep: int = 0  # keep up to this many input rows (first seen)
    sample: Optional[torch.Tensor] = None  # [<= keep, in] the kept rows
    output_energy: dict = field(default_factory=dict)  # path -> per-batch Σ ‖W x‖² (a layer that ran in FP)
    _sum: Optional[torch.Tensor] = None  # float64 Σ x xᵀ, block upper triangle (see _add_batch_products)
    _hessian: Optional[torch.Tensor] = None  # float32 2/n Σ x xᵀ, once read

    @property
    def hessian(self) -> Optional[torch.Tensor]:
        """``[in, in]`` float32, ``2/n Σ x xᵀ`` over the rows seen (the float64 sum is dropped)."""
        if self._hessian is None and self._sum is not None and self.rows:
            _mirror_upper(self._sum)
            self._hessian = self._sum.mul_(2.0 / self.rows).float()
            self._sum = None
        return self._hessian

    def release(self) -> None:
        """Drop the Hessian (this rank solves no layer that reads it)."""
        self._sum = self._hessian = None

    def reference_energy(self, path: str) -> Optional[float]:
        """``tr(W H Wᵀ)`` of layer ``path`` from its FP outputs, if the collect computed them."""
        parts = self.output_energy.get(path)
        return None if parts is None or self.rows == 0 else 2.0 * math.fsum(parts) / self.rows

    def add(self, x: torch.Tensor) -> None:
        """Accumulate one batch of input rows ``x`` [rows, in]."""
        rows = x.reshape(-1, self.in_features)
        m = rows.shape[0]
        if m == 0:
            return
        if self._hessian is not None:
            raise RuntimeError("statistics were read; they take no more rows")
        for chunk in float_row_chunks(rows):
            amax = chunk.abs().amax(dim=0)
            self.absmax = amax if self.absmax is None else torch.maximum(self.absmax, amax)
            have = 0 if self.sample is None else self.sample.shape[0]
            if have < self.keep:
                extra = chunk[: self.keep - have].clone()
                self.sample = extra if self.sample is None else torch.cat([self.sample, extra])
        if self.want_hessian:
            if self._sum is None:
                self._sum = torch.zeros(self.in_features, self.in_features, device=x.device, dtype=torch.float64)
            _add_batch_products(self._sum, rows)
        self.rows += m

    def reduce_across_ranks(self, device: Optional[torch.device], hessian_to: Optional[set[int]] = None) -> None:
        """Combine every rank's statistics into the whole calibration set's, on every rank: sums
        (exact, see ``_add_batch_products``), maxima, the first ``keep`` rows in rank order (the
        windows' order) and each batch's output energy (summed by ``math.fsum``, order-free). The
        Hessian goes only to the ranks ``hessian_to`` (None: all)."""
        from qcompiler.distributed.collectives import all_max, all_sum, gather_rows, sum_to

        where = device if device is not None else torch.device("cpu")
        self.rows = int(all_sum(torch.tensor([self.rows], dtype=torch.int64)))
        if self.want_hessian:
            if self._sum is None:
                self._sum = torch.zeros(self.in_features, self.in_features, device=where, dtype=torch.float64)
            if hessian_to is None or len(hessian_to) > 1:
                self._sum = all_sum(self._sum)
            elif hessian_to:  # one rank solves every layer that reads it
                self._sum = sum_to(self._sum, next(iter(hessian_to)))
            else:  # nobody reads it
                self._sum = None
        absmax = self.absmax if self.absmax is not None else torch.zeros(self.in_features, device=where)
        self.absmax = all_max(absmax) if self.rows else None
        if self.keep:
            sample = self.sample if self.sample is not None else torch.zeros(0, self.in_features, device=where)
            gathered = gather_rows(sample)[: self.keep]
            self.sample = gathered if gathered.shape[0] else None
        for path in sorted(self.output_energy):
            parts = torch.tensor(self.output_energy[path], dtype=torch.float64)
            self.output_energy[path] = gather_rows(parts).tolist()


def check_finite_stats(path: str, st: LayerStats) -> None:
    """Max |x| per channel propagates NaN and Inf: checking it after each batch is O(channels),
    not O(rows x channels)."""
    if st.absmax is not None and not bool(torch.isfinite(st.absmax).all()):
        raise CalibrationError(f"calibration activations reaching {path} contain NaN or Inf")
