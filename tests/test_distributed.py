"""Quantizing over several ranks (gloo, processes on this CPU): the tensors are the bits of one
process's run, a rank that dies stops the run with one line and publishes nothing, and the
pieces (shards, owners) behave as the docs say."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qcompiler.distributed.launch import run_ranks
from qcompiler.distributed.ranks import Ranks, solve_cost
from qcompiler.errors import CalibrationError

CASES = Path(__file__).parent / "distributed_cases.py"


def _start_one_process(out: Path, cases: list[str]) -> subprocess.Popen:
    """The reference: the same cases in one process of its own, started beside the ranks (the bits
    do not depend on how busy the cores are), one thread like each rank (float32 GEMMs round
    differently on 2 threads, in one process too)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1"}
    return subprocess.Popen([sys.executable, str(CASES), str(out), *cases], env=env)


@pytest.mark.parametrize(
    "cases",
    [
        pytest.param(["llama-gptq"], id="gptq-dense"),
        pytest.param(["mixtral-gptq", "llama-gptq-sequential"], id="gptq-moe-and-sequential", marks=pytest.mark.slow),
        pytest.param(
            ["llama-spqr", "llama-smoothquant-w8a8", "qwen2-w8a8-static", "qwen2_moe-rtn"],
            id="spqr-smoothquant-static-moe",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_two_ranks_store_the_bits_of_one_rank_and_a_killed_rank_stops_the_run(tmp_path, monkeypatch, cases):
    """Each rank calibrates its shard (3 and 2 of 5 batches, one padded), the statistics are summed
    exactly, each layer is solved by one rank and sent to the other — or, alone in its group, its
    rows split between both and joined: every stored tensor and the graph equal a one-process run's
    bit for bit. Then, in the same launch, rank 1 is killed (SIGKILL)
    in the middle of one more case: the launch ends within 60 s with one line naming it, and that
    case publishes nothing."""
    reference = _start_one_process(tmp_path / "one", cases)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    said = []
    code = run_ranks(
        [sys.executable, str(CASES), str(tmp_path / "two"), *cases, "llama-gptq+rank1-dies"], 2, say=said.append
    )
    ended = time.time()
    assert reference.wait(timeout=600) == 0
    assert code == 1
    assert re.fullmatch(r"rank 1 \(pid \d+\) was killed by SIGKILL; stopped the other ranks", said[-1]), said
    assert ended - float((tmp_path / "rank1-died-at").read_text()) < 60
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(cases)  # the killed case: nothing
    # Rank 0's progress: after each block, every rank's seconds and how many of the block's layers it solved.
    progress = (tmp_path / "two-progress.txt").read_text()
    shares = re.findall(
        r"rank 0: [\d.]+s forward, [\d.]+s solving (\d+), [\d.]+s exchange; rank 1: .* solving (\d+),", progress
    )
    blocks = re.findall(r"block \d+/\d+ \S+: (\d+) linears", progress)
    assert shares and len(shares) == len(blocks), progress[-2000:]
    # The first case is a weight pass (2 blocks): both ranks solve in each block (SmoothQuant's have no solves).
    assert all(int(a) > 0 and int(b) > 0 for a, b in shares[:2]), shares
    if "llama-gptq-sequential" in cases:  # o_proj and down_proj alone in their groups: rows on both ranks
        sequential = progress.split("true_sequential=True")[1].split("pass 1/1")[0]
        solved = re.findall(r"solving (\d+), [\d.]+s exchange; rank 1: .* solving (\d+),", sequential)
        assert [int(a) + int(b) for a, b in solved] == [7 + 2] * 2, sequential[-2000:]
        assert "o_proj: 4-bit, rows on 2 ranks" in sequential
    for case in cases:
        one, two = (load_file(str(tmp_path / run / case / "tensors.safetensors")) for run in ("one", "two"))
        assert one.keys() == two.keys()
        differ = [name for name in one if not torch.equal(one[name], two[name])]
        assert not differ, f"{case}: {len(differ)} tensors differ, e.g. {differ[:3]}"
        graphs = [json.loads((tmp_path / run / case / "graph.json").read_text()) for run in ("one", "two")]
        assert graphs[0] == graphs[1], case


@pytest.mark.slow
def test_a_run_killed_on_two_ranks_resumes_on_one_with_the_clean_runs_bits(tmp_path, monkeypatch):
    """Progress is recorded by rank 0 whatever the world size, and results do not depend on it: a
    2-rank run with ``--checkpoint`` whose rank 1 dies in block 2 resumes in one process (the
    recorded block replayed, the rest solved there) to the tensors of an uninterrupted run."""
    reference = _start_one_process(tmp_path / "clean", ["llama-gptq"])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("QC_CASES_CHECKPOINT", str(tmp_path / "progress"))
    said = []
    code = run_ranks([sys.executable, str(CASES), str(tmp_path / "two"), "llama-gptq+rank1-dies"], 2, say=said.append)
    assert code == 1 and "killed by SIGKILL" in said[-1]
    assert (tmp_path / "progress" / "pass0-block0.safetensors").is_file()
    assert not (tmp_path / "progress" / "pass0-block1.safetensors").exists()
    monkeypatch.setenv("QC_CASES_RESUME", "1")
    resumed = _start_one_process(tmp_path / "resumed", ["llama-gptq"])
    assert resumed.wait(timeout=600) == 0 and reference.wait(timeout=600) == 0
    one, two = (load_file(str(tmp_path / run / "llama-gptq" / "tensors.safetensors")) for run in ("clean", "resumed"))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


@pytest.mark.slow
def test_the_cli_killed_in_one_rank_exits_non_zero_with_one_line_and_publishes_nothing(tmp_path):
    """kill -9 of rank 1 of ``qcompiler quantize --nproc 2`` once the pass starts: the other rank is
    stopped, the command exits non-zero naming the rank (without waiting out --rank-timeout), and --out never appears."""
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "qcompiler", "quantize", "bundled:tinylm", "--recipe", "gptq-w4g128"]
    proc = subprocess.Popen(
        [*command, "--samples", "16", "--nproc", "2", "--out", str(out)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines, pids = [], None
    for line in proc.stderr:
        lines.append(line)
        if pids is None and (m := re.search(r"pids (\d+) (\d+)", line)):
            pids = int(m[1]), int(m[2])
        if "pass 1/1" in line:  # both ranks joined the process group and captured the model
            break
    assert pids is not None, "".join(lines)
    os.kill(pids[1], signal.SIGKILL)
    rest = proc.stderr.read()
    code = proc.wait(timeout=600)  # a guard against a hang only: the launcher stops rank 0 at once
    assert code != 0
    assert f"rank 1 (pid {pids[1]}) was killed by SIGKILL; stopped the other ranks" in rest
    assert not out.exists() and not list(tmp_path.iterdir())


def test_nproc_starts_the_same_command_as_ranks_and_returns_their_exit_code(tmp_path, monkeypatch):
    """``--nproc 2``: the ranks run ``python -m qcompiler`` with the same arguments minus --nproc,
    and the command's exit code is the launch's."""
    import qcompiler.distributed.launch as launch
    from qcompiler.cli import main

    started = []
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(launch, "run_ranks", lambda command, n, say: started.append((command, n)) or 3)
    argv = ["quantize", "bundled:tinylm", "--nproc", "2", "--samples", "16", "--out", str(tmp_path / "o")]
    assert main(argv) == 3
    assert started == [([sys.executable, "-m", "qcompiler", *argv[:2], *argv[4:]], 2)]


def test_shards_are_contiguous_in_order_and_cover_every_batch_once():
    items = list(range(7))
    shards = [Ranks(r, 3).shard(items) for r in range(3)]
    assert shards == [[0, 1, 2], [3, 4], [5, 6]]
    assert Ranks().shard(items) == items
    with pytest.raises(CalibrationError, match="2 batches for 3 ranks"):
        Ranks(0, 3).shard([0, 1])


def test_owners_balance_solve_cost_the_same_way_on_every_rank():
    """Longest first onto the least loaded rank: a block's four big and four small layers split
    evenly, and every rank computes the same owners."""
    costs = [solve_cost(1536, 4096), solve_cost(4096, 1536), solve_cost(4096, 1536)] + [solve_cost(1536, 1536)] * 4
    owners = [Ranks(r, 2).owners(costs) for r in range(2)]
    assert owners[0] == owners[1]
    load = [sum(c for c, o in zip(costs, owners[0]) if o == r) for r in range(2)]
    assert max(load) / sum(load) < 0.6  # the down_proj alone is 0.54 of the total
    assert Ranks().owners(costs) == [0] * len(costs)


def test_ranks_die_with_their_launcher_even_under_kill_9(tmp_path):
    """kill -9 of the ``--nproc`` launcher: the kernel ends every rank (PR_SET_PDEATHSIG), so none
    computes on or publishes ``--out`` by itself."""
    launcher = textwrap.dedent("""
        import sys
        from qcompiler.distributed.launch import run_ranks
        sys.exit(run_ranks([sys.executable, "-c", "import time; time.sleep(600)"], 2,
                           say=lambda line: print(line, flush=True)))
    """)
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    ranks = [int(p) for p in re.search(r"pids (\d+) (\d+)", line).groups()]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    for _ in range(600):  # a guard against a hang only: the kernel signals them as the launcher dies
        if not any(_alive(pid) for pid in ranks):
            break
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in ranks), f"ranks {ranks} outlived their launcher"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie reaped by init does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_rank_whose_peers_never_join_is_one_line_naming_the_rendezvous(monkeypatch):
    """WORLD_SIZE=2 with no second rank: after the rank timeout, who waited where and what to do
    (was an internal DistStoreError)."""
    import socket

    from qcompiler.distributed.ranks import join_from_environment
    from qcompiler.errors import DistributedError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(DistributedError, match=rf"rank 0 of WORLD_SIZE=2 waited 3 s at 127.0.0.1:{port} and the other"):
        join_from_environment(None, 3.0)
