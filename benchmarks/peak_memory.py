"""Peak resident memory of this process, for benchmarks that run each case in a fresh child."""

from __future__ import annotations

import re
import resource
from pathlib import Path


def peak_rss_mb() -> float:
    """``VmHWM``, the high-water mark of this process image. Not getrusage's ``ru_maxrss`` alone:
    Linux keeps that across ``exec``, so a child started by a big parent reported at least the
    parent's size (scale.py: 1631 MB for every depth after the first). Without /proc, ``ru_maxrss``."""
    status = Path("/proc/self/status")
    found = re.search(r"VmHWM:\s+(\d+)", status.read_text()) if status.exists() else None
    return int(found.group(1)) / 1024 if found else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
