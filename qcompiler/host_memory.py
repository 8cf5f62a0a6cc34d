"""Host memory: give the buffers calibration frees back to the operating system.

glibc keeps what a process frees for reuse: the tens-of-MB activations and solver buffers of
calibration come from its heap, where a freed one stays resident until the heap is trimmed.
``return_freed_memory`` trims it between phases (after a block, after a collect, after each layer's
solve): measured on the 1024-wide LLaMA, the resident size otherwise grew ~60 MB per block with
nothing alive. Not done: fixing glibc's mmap threshold (every large buffer its own mapping,
unmapped when freed) took the 0.44 B LLaMA's peak further down (1.61 -> 1.28 GB, before the other
reductions) but made calibration 20-30 % slower on these VMs (page faults and unmaps on every
allocation). Other allocators (musl, jemalloc via LD_PRELOAD, macOS) are left as they are.

``bound_kernel_cache`` caps oneDNN's primitive cache for the CLI's process (see there).
"""
from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional

__all__ = ["return_freed_memory", "bound_kernel_cache", "ONEDNN_CACHE_ENTRIES"]

ONEDNN_CACHE_ENTRIES = 64


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
    """Cap oneDNN's primitive cache (it runs CPU bf16/fp16 matmuls) at ``ONEDNN_CACHE_ENTRIES``.

    It keeps one compiled primitive per matmul shape, 1024 by default; a mixture-of-experts
    model's experts see new row counts on every calibration batch, so the cache only fills:
    streaming an 8-layer bf16 Mixtral (512 wide, 8 experts) it held ~25 MB more per block, and the
    peak went 951-982 -> 853-860 MB with the cap at no clear cost in time (dense models repeat a
    few shapes, which stay cached). oneDNN reads the setting when it first runs, so this only works
    before the process's first such matmul: the CLI calls it; a value the user set is kept."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_ENTRIES))
