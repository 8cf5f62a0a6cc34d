"""Host memory: give the buffers calibration frees back to the operating system.

glibc keeps what a process frees for reuse: the tens-of-MB activations and solver buffers of
calibration come from its heap, where a freed one stays resident until the heap is trimmed.
``return_freed_memory`` trims it between phases (after a block, after a collect, after each layer's
solve): measured on the 1024-wide LLaMA, the resident size otherwise grew ~60 MB per block with
nothing alive. Not done: fixing glibc's mmap threshold (every large buffer its own mapping,
unmapped when freed) took the 0.44 B LLaMA's peak further down (1.61 -> 1.28 GB, before the other
reductions) but made calibration 20-30 % slower on these VMs (page faults and unmaps on every
allocation). Other allocators (musl, jemalloc via LD_PRELOAD, macOS) are left as they are.

``bound_kernel_cache`` caps the per-shape matmul caches for the CLI's process (see there).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional

__all__ = ["return_freed_memory", "bound_kernel_cache", "KERNEL_CACHE_ENTRIES"]

KERNEL_CACHE_ENTRIES = 64


@functools.cache
def _malloc_trim() -> Optional[ctypes._CFuncPtr]:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to do
        return None


def return_freed_memory() -> None:
    """Return the heap's free pages to the OS."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def bound_kernel_cache() -> None:
    """Cap the two per-shape caches of CPU bf16/fp16 matmuls at ``KERNEL_CACHE_ENTRIES`` each:
    PyTorch's ideep computation cache (``LRU_CACHE_CAPACITY``) and oneDNN's primitive cache
    (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), 1024 entries each by default.

    A mixture-of-experts model's experts see new row counts on every calibration batch, so both
    only fill. Streaming an 8-layer bf16 Mixtral (512 wide, 8 experts, 8 x 2 x 512 tokens), resident
    memory after each block grew ~20-35 MB per block with the defaults (float32, which takes neither
    cache, stayed flat); with both capped it stays flat (capping one of them is not enough), the peak
    went 1248-1267 -> 861-884 MB, time ratios 0.89-1.30 (median 1.05 of four pairs on a noisy VM).
    Dense models repeat a few shapes, which stay cached. Both are read when the first such
    matmul runs, so this only works before that: the CLI calls it; values the user set are kept."""
    for name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(KERNEL_CACHE_ENTRIES))
