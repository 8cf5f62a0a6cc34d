"""``qcompiler quantize --nproc N``: start N ranks of the same command on this machine and watch them.

Each rank is ``python -m qcompiler <the same arguments>`` with torchrun's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` / ``MASTER_PORT``) and its share of the CPU threads.
When a rank fails or dies, the others are stopped at once and one line names it; nothing is
published (rank 0 writes the output atomically at the very end). Several machines: ``torchrun``
(docs/guide.md, "Many processes and machines").
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from typing import Callable

__all__ = ["free_port", "run_ranks"]


def free_port() -> int:
    """A TCP port nothing listens on now (the rendezvous of rank 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stop(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


_PR_SET_PDEATHSIG = 1


def _dies_with(launcher: int) -> Callable[[], None]:
    """What a rank runs before its command: on Linux the kernel sends it SIGKILL when the launcher
    dies, ``kill -9`` included, so no rank computes on (or publishes ``--out``) without its launcher;
    a launcher already gone by then ends it at once. Elsewhere the ranks' process-group timeout
    (``--rank-timeout``) ends them."""

    def before_exec() -> None:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # not Linux: no prctl
            return
        if os.getppid() != launcher:
            os._exit(1)

    return before_exec


def run_ranks(command: list[str], nproc: int, *, say: Callable[[str], None] = print) -> int:
    """Run ``command`` (e.g. ``[python, -m, qcompiler, quantize, ...]``) as ranks ``0..nproc-1``; the
    exit code is 0 when all succeed, else the first failing rank's (1 when it was killed by a signal)."""
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))
    common = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "OMP_NUM_THREADS": threads,
    }
    procs = [
        subprocess.Popen(
            command,
            env={**common, "RANK": str(r), "LOCAL_RANK": str(r)},
            preexec_fn=_dies_with(os.getpid()),
        )
        for r in range(nproc)
    ]
    say(f"started {nproc} ranks ({threads} threads each): pids {' '.join(str(p.pid) for p in procs)}")
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None:
                _stop(procs)
                say(f"rank {failed} (pid {procs[failed].pid}) {_how(codes[failed])}; stopped the other ranks")
                return codes[failed] if codes[failed] > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(procs)
        raise
