"""A line every few seconds while one long call runs (capture, loading, an export, a prefill) that
has no loop of its own to report from: a user never faces a silent terminal and wonders whether the
run hung."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

__all__ = ["heartbeat"]


@contextlib.contextmanager
def heartbeat(log: Callable[[str], None], what: str, *, every: float = 4.0) -> Iterator[None]:
    """``log(what)`` now, ``log("… still <what> (Ns)")`` every ``every`` seconds until the block
    ends, then ``log("<what>: done in Ns")`` when it took longer than one beat."""
    log(what)
    start = time.monotonic()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(every):
            log(f"... still {what} ({time.monotonic() - start:.0f}s)")

    thread = threading.Thread(target=beat, name="qcompiler-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    seconds = time.monotonic() - start
    if seconds >= every:
        log(f"{what}: done in {seconds:.0f}s")
