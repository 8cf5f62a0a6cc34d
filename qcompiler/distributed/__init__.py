"""Quantizing in several processes (``torchrun`` or ``qcompiler quantize --nproc N``): each rank
calibrates its shard of the windows, statistics are summed exactly across ranks, each layer is
solved by one owner rank and its result sent to all (``ranks.py``, ``collectives.py``,
``launch.py``; docs/guide.md, "Many processes and machines")."""

from qcompiler.distributed.ranks import Ranks, current_ranks

__all__ = ["Ranks", "current_ranks"]
