"""Who this process is among the ranks of a run, which calibration windows it calibrates, and which
rank solves which layer (or which rows of a big layer).

Outside an initialized ``torch.distributed`` process group there is one rank, and every method
here is the single-process behaviour (no collective is ever called).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, NamedTuple, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from qcompiler.errors import DistributedError

__all__ = ["Ranks", "SolveJob", "Piece", "current_ranks", "join_from_environment", "leave", "solve_cost"]

T = TypeVar("T")

# What a solve costs, up to a constant: factoring the Hessian (in³, once per Hessian and rank: q/k/v
# and gate/up share one) plus the sweep (out · in², SWEEP times dearer per term: the sweep's column
# updates are vector and matrix-vector work, the factor is LAPACK's). SWEEP measured on one CPU
# thread: a 1536 x 4096 down_proj's factor 1.35 s, sweep 1.70 s (docs/results.md "Many ranks").
SWEEP = 3.0


class SolveJob(NamedTuple):
    """One layer to solve: its shape, the row multiple its rows may be split at (None: whole), and
    the Hessian it reads (jobs with equal ``hessian`` share one factor on a rank)."""

    rows: int
    cols: int
    unit: Optional[int]
    hessian: Hashable


class Piece(NamedTuple):
    """Rows ``[start, stop)`` of one job, solved by ``rank``."""

    rank: int
    start: int
    stop: int


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: ``rank`` of ``world`` (``world == 1``: no process group)."""

    rank: int = 0
    world: int = 1
    split_rows: bool = True  # False: whole layers only (QCOMPILER_ROW_SPLIT=0)

    @property
    def distributed(self) -> bool:
        """Whether collectives run (more than one rank)."""
        return self.world > 1

    @property
    def is_root(self) -> bool:
        """Rank 0: the one that writes outputs and prints the progress bar."""
        return self.rank == 0

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's contiguous share of ``items`` (sizes differ by at most one): rank order is the
        items' order, which is what makes the gathered statistics equal one process's."""
        n = len(items)
        if self.distributed and n < self.world:
            from qcompiler.errors import CalibrationError

            raise CalibrationError(
                f"the calibration set has {n} batch{'es' if n != 1 else ''} for {self.world} ranks: "
                "give at least one per rank (more --samples, or fewer ranks)"
            )
        base, extra = divmod(n, self.world)
        start = self.rank * base + min(self.rank, extra)
        return list(items[start : start + base + (1 if self.rank < extra else 0)])

    def owners(self, costs: Sequence[float]) -> list[int]:
        """The rank that solves each job: longest job first onto the least loaded rank (ties to the
        lower rank), so a block's solves finish together. Deterministic: every rank computes the
        same assignment from the same costs."""
        load = [0.0] * self.world
        owner = [0] * len(costs)
        for job in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
            rank = min(range(self.world), key=lambda r: (load[r], r))
            owner[job] = rank
            load[rank] += costs[job]
        return owner

    def pieces(self, jobs: Sequence[SolveJob]) -> list[list[Piece]]:
        """Who solves which rows of each job: whole jobs placed longest first onto the rank they
        load least, then, while it shortens the slowest rank, one job more split into equal row
        ranges (multiples of its ``unit``) on several ranks — each of them factors that Hessian, so a
        split pays only where a rank would otherwise wait (a down_proj alone in its group, more
        ranks than big layers). Deterministic: every rank computes the same pieces."""
        parts = [1] * len(jobs)
        best = _placed(jobs, parts, self.world)
        while self.distributed and self.split_rows:
            trials = []
            for j, job in enumerate(jobs):
                if job.unit and parts[j] < min(self.world, job.rows // job.unit):
                    trial = parts[:j] + [parts[j] + 1] + parts[j + 1 :]
                    trials.append((_placed(jobs, trial, self.world), j, trial))
            if not trials:
                break
            placed, _, trial = min(trials, key=lambda t: (t[0][0], t[1]))
            if placed[0] >= best[0] * (1 - 1e-9):
                break
            best, parts = placed, trial
        return best[1]

    def device(self, requested: Optional[torch.device]) -> Optional[torch.device]:
        """The compute device of this rank: a bare ``cuda`` becomes this rank's local GPU."""
        if requested is None or requested.type != "cuda" or requested.index is not None or not self.distributed:
            return requested
        import os

        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", self.rank)) % torch.cuda.device_count())


def solve_cost(out_features: int, in_features: int) -> float:
    """What solving one ``[out, in]`` matrix against an ``[in, in]`` Hessian costs, up to a
    constant: the factorization (in³) plus the error propagation (``SWEEP`` · out · in²)."""
    return float(in_features) ** 3 + SWEEP * float(out_features) * float(in_features) ** 2


def row_ranges(rows: int, parts: int, unit: int) -> list[tuple[int, int]]:
    """``rows`` in ``parts`` contiguous ranges, each a multiple of ``unit`` rows but the last
    (sizes differ by at most one unit)."""
    units = -(-rows // unit)
    base, extra = divmod(units, parts)
    edges, at = [0], 0
    for k in range(parts):
        at += base + (1 if k < extra else 0)
        edges.append(min(at * unit, rows))
    return list(zip(edges[:-1], edges[1:]))


def _placed(jobs: Sequence[SolveJob], parts: list[int], world: int) -> tuple[float, list[list[Piece]]]:
    """The slowest rank's load and the pieces, each job cut into ``parts[j]`` row ranges: pieces
    longest first onto the rank whose load grows least to the smallest total (a rank that already
    factors the piece's Hessian pays only the sweep), ties to the lower rank."""
    cut = [
        (j, start, stop)
        for j, job in enumerate(jobs)
        for start, stop in (row_ranges(job.rows, parts[j], job.unit) if parts[j] > 1 else [(0, job.rows)])
    ]
    load, factored = [0.0] * world, [set() for _ in range(world)]
    pieces: list[list[Piece]] = [[] for _ in jobs]
    for j, start, stop in sorted(cut, key=lambda c: (-solve_cost(c[2] - c[1], jobs[c[0]].cols), c[0], c[1])):
        job = jobs[j]
        sweep = solve_cost(stop - start, job.cols) - float(job.cols) ** 3

        def after(r: int) -> float:
            return load[r] + sweep + (0.0 if job.hessian in factored[r] else float(job.cols) ** 3)

        rank = min(range(world), key=lambda r: (after(r), r))
        load[rank] = after(rank)
        factored[rank].add(job.hessian)
        pieces[j].append(Piece(rank, start, stop))
    return max(load), [sorted(p, key=lambda piece: piece.start) for p in pieces]


def current_ranks() -> Ranks:
    """The ranks of the initialized default process group, or a single rank. ``QCOMPILER_ROW_SPLIT=0``
    in the environment keeps every layer whole on one rank: on CUDA a row range's GEMMs may round
    differently from the whole layer's (cuBLAS picks kernels by shape), so only whole layers are
    bit-identical to one process there; on CPU both are (tested with one thread per rank)."""
    import os

    if dist.is_available() and dist.is_initialized():
        split = os.environ.get("QCOMPILER_ROW_SPLIT", "1") != "0"
        return Ranks(dist.get_rank(), dist.get_world_size(), split)
    return Ranks()


def join_from_environment(device: Optional[torch.device], timeout_s: float) -> Ranks:
    """Join the process group torchrun (or ``--nproc``) described in the environment (``WORLD_SIZE``,
    ``RANK``, ``MASTER_ADDR``/``MASTER_PORT``): NCCL when this run computes on CUDA, gloo otherwise.
    A peer that stops answering for ``timeout_s`` seconds makes the collectives fail."""
    import datetime
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or dist.is_initialized():
        return current_ranks()
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    try:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    except dist.DistStoreError as exc:  # the rendezvous never filled: say who waited for whom
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise DistributedError(
            f"rank {os.environ.get('RANK', '?')} of WORLD_SIZE={world} waited {timeout_s:g} s at {where} and "
            f"the other ranks did not all join ({str(exc).split('. ', 1)[-1].rstrip('.')}): start every rank "
            "(torchrun, or --nproc), or leave WORLD_SIZE unset for one process"
        ) from None
    return current_ranks()


def leave() -> None:
    """Leave the process group this process joined (if any)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
