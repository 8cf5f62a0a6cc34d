"""Finished results parked on disk while a long pass runs.

A streamed model's quantized blocks are not read again until the pass rewrites the graph at the
end, yet holding them grew the peak with depth (4-bit codes and grids: ~0.26x the bf16 weights,
140 MB by the last block of a 0.44 B LLaMA). Once its block is done, each layer's (and each 3-D
expert parameter's) tensors go to a temporary safetensors file (no pickle) and come back, one at a
time, when the rewrite stores them.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

__all__ = ["Spill"]


class Spill:
    """A private temporary folder of safetensors files; removed by ``close()`` (or when collected)."""

    def __init__(self):
        self._folder = tempfile.TemporaryDirectory(prefix="qcompiler-spill-")
        self._count = 0

    def park(self, tensors: dict[str, torch.Tensor]) -> Callable[[], dict[str, torch.Tensor]]:
        """Write ``tensors`` (CPU) out; the returned function reads them back."""
        path = Path(self._folder.name) / f"{self._count}.safetensors"
        self._count += 1
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(path))
        return lambda: load_file(str(path))

    def close(self) -> None:
        """Delete the spill file."""
        self._folder.cleanup()
