"""Who this process is among the ranks of a run, which calibration windows it calibrates, and which
rank solves which layer.

Outside an initialized ``torch.distributed`` process group there is one rank, and every method
here is the single-process behaviour (no collective is ever called).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

__all__ = ["Ranks", "current_ranks", "join_from_environment", "leave", "solve_cost"]

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: ``rank`` of ``world`` (``world == 1``: no process group)."""

    rank: int = 0
    world: int = 1

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

    def device(self, requested: Optional[torch.device]) -> Optional[torch.device]:
        """The compute device of this rank: a bare ``cuda`` becomes this rank's local GPU."""
        if requested is None or requested.type != "cuda" or requested.index is not None or not self.distributed:
            return requested
        import os

        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", self.rank)) % torch.cuda.device_count())


def solve_cost(out_features: int, in_features: int) -> float:
    """What solving one ``[out, in]`` matrix against an ``[in, in]`` Hessian costs, up to a
    constant: the factorization (in³) plus the error propagation (out · in²)."""
    return float(in_features) ** 3 + float(out_features) * float(in_features) ** 2


def current_ranks() -> Ranks:
    """The ranks of the initialized default process group, or a single rank."""
    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size())
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
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return current_ranks()


def leave() -> None:
    """Leave the process group this process joined (if any)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
