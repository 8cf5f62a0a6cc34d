"""Finished results parked on disk while a long pass runs.

A streamed model's quantized blocks are not read again until the pass rewrites the graph at the
end, yet holding them grew the peak with depth (4-bit codes and grids: ~0.26x the bf16 weights,
140 MB by the last block of a 0.44 B LLaMA). Once its block is done, each layer's (and each 3-D
expert parameter's) tensors go to a temporary safetensors file (no pickle). The rewrite reads a
layer's file back, stores its tensors in the graph and swaps them for placeholders that read the
file again on use (``lazy_weights.adopt_parked``): saving such a graph writes one tensor at a time.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qcompiler.files.atomic import left_by_dead_processes

__all__ = ["Spill", "Parked"]


class Parked:
    """One parked file: read all of it back, or one tensor."""

    def __init__(self, path: Path):
        self.path = path

    def read(self) -> dict[str, torch.Tensor]:
        """Every tensor of the file."""
        return load_file(str(self.path))

    def read_one(self, key: str) -> torch.Tensor:
        """The tensor ``key`` alone (the file is mapped, not read whole)."""
        with safe_open(str(self.path), framework="pt") as f:
            return f.get_tensor(key)


_PREFIX = "qcompiler-spill-"


def _sweep_stale() -> None:
    """Remove the spill folders of runs that were killed (``kill -9`` skips every cleanup): the PID
    in the name no longer runs. Gigabytes on a large model, otherwise left in TMPDIR for good."""
    for entry in left_by_dead_processes(Path(tempfile.gettempdir()), _PREFIX):
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


class Spill:
    """A private temporary folder of safetensors files; removed by ``close()``, or silently when
    collected or at exit (a ``compile(materialize=False)`` result dropped after its save)."""

    def __init__(self):
        _sweep_stale()
        self._folder = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-"))
        self._remove = weakref.finalize(self, shutil.rmtree, self._folder, ignore_errors=True)
        self._count = 0

    def park(self, tensors: dict[str, torch.Tensor]) -> Parked:
        """Write ``tensors`` (CPU) out."""
        path = self._folder / f"{self._count}.safetensors"
        self._count += 1
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(path))
        return Parked(path)

    def close(self) -> None:
        """Delete the spill files."""
        self._remove()
