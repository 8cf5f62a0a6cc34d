"""GPTQ over ranks: wall time and each rank's peak memory, and what that projects to at scale.

    python benchmarks/distributed.py           # the 0.44 B LLaMA (1536 wide, 12 layers, bf16), 16 x 512 tokens (~25 min)
    python benchmarks/distributed.py --quick   # a tiny LLaMA (checks the script)
    python benchmarks/distributed.py --recipe spqr-w3g16 --layers 4 --compare-split   # rows split vs whole layers

The model (benchmarks/scale.py's: random weights, sharded bf16 safetensors, a byte-level tokenizer)
is quantized with ``gptq-w4g128`` by the CLI a user runs, calibration windows from real text, in
three configurations per round, rounds interleaved so that drift of this shared machine hits all
alike: 1 rank x 1 thread, 1 rank x 2 threads, 2 ranks x 1 thread (``--nproc 2``); ``--compare-split``
adds 2 ranks x 1 thread with every layer whole on one rank (``QCOMPILER_ROW_SPLIT=0``), the
behaviour before a layer alone in its group was split by rows (SpQR's true-sequential groups). Every rank
reports its own quantize seconds and its own peak RSS (VmHWM: benchmarks/peak_memory.py); the wall
is the whole command's, start-up and save included. The 2-rank artifact is checked bit-identical
to the 1 rank x 1 thread one (same threads per process).

From rank 0's per-block log of the 1 x 1 runs, each block's time splits into solves (the layers'
own seconds) and the rest (calibration forward passes, Hessian products, block advance); the
projection table scales both by FLOPs to real model shapes on N ranks, the solves as the planner
places them (``Ranks.pieces``: the slowest rank's load; the formula is printed with the table).
Writes benchmarks/results/distributed.json (``distributed-RECIPE-N-blocks.json`` for another recipe or
``--layers N``).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_file import write_rows
from scale import SIZES, cli_model_folder, same_artifact_tensors, write_calibration_text

from qcompiler.distributed.ranks import SWEEP, Ranks, SolveJob, solve_cost

HERE = Path(__file__).resolve().parent
CONFIGS = [("1 rank x 1 thread", 1, 1, True), ("1 rank x 2 threads", 1, 2, True), ("2 ranks x 1 thread", 2, 1, True)]
WHOLE = ("2 ranks x 1 thread, whole layers", 2, 1, False)
RANK = (  # one rank: the CLI, then its own seconds and peak
    f"import sys, time; sys.path.insert(0, {str(HERE)!r}); "
    "from peak_memory import peak_rss_mb; from qcompiler.cli import main; "
    "t = time.perf_counter(); rc = main(sys.argv[1:]); "
    "import os; print('RESULT', os.environ.get('RANK', '0'), time.perf_counter() - t, peak_rss_mb(), rc, flush=True)"
)
LAUNCH = "import sys; from qcompiler.distributed.launch import run_ranks; sys.exit(run_ranks(sys.argv[2:], int(sys.argv[1])))"


def run(
    folder: Path, calib: Path, out: Path, size: dict, nproc: int, threads: int, recipe: str, split: bool = True
) -> dict:
    rank = [sys.executable, "-c", RANK, "quantize", str(folder), "--recipe", recipe, "--calib", str(calib)]
    rank += ["--samples", str(size["nsamples"]), "--seqlen", str(size["seqlen"]), "--device", "cpu", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "QCOMPILER_ROW_SPLIT": "1" if split else "0"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", LAUNCH, str(nproc), *rank], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    results = [line.split() for line in done.stdout.splitlines() if line.startswith("RESULT")]
    if done.returncode or len(results) != nproc or any(r[4] != "0" for r in results):
        sys.exit(f"quantize failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    ranks = sorted((int(r[1]), float(r[2]), float(r[3])) for r in results)
    return {
        "wall_s": wall,
        "quantize_s": ranks[0][1],
        "peak_rss_MB_per_rank": [r[2] for r in ranks],
        "blocks": block_log(done.stderr),
        "per_rank_work": _rank_work(done.stderr),
    }


def _rank_work(log: str) -> list[dict]:
    """Each rank's forward / solve / exchange seconds and layers solved, summed over the blocks
    (rank 0's per-block line of a distributed run; empty for one rank)."""
    totals: dict[int, dict] = {}
    for m in re.finditer(r"rank (\d+): ([\d.]+)s forward, ([\d.]+)s solving (\d+), ([\d.]+)s exchange", log):
        t = totals.setdefault(int(m[1]), {"forward_s": 0.0, "solve_s": 0.0, "exchange_s": 0.0, "solved": 0})
        t["forward_s"] += float(m[2])
        t["solve_s"] += float(m[3])
        t["solved"] += int(m[4])
        t["exchange_s"] += float(m[5])
    return [{"rank": r, **t} for r, t in sorted(totals.items())]


def block_log(log: str) -> list[dict]:
    """Per block: its seconds, and each layer's solve seconds and their sum (rank 0's log)."""
    blocks, layers = [], {}
    for line in log.splitlines():
        if m := re.search(r"\]   (\S+): .*, ([\d.]+)s$", line):
            layers[m[1]] = float(m[2])
        elif m := re.search(r"\] block \d+/\d+ \S+: \d+ linears, ([\d.]+)s(,|$)", line):
            blocks.append({"seconds": float(m[1]), "solve_seconds": sum(layers.values()), "layers": layers})
            layers = {}
    return blocks


# Real shapes (config.json of each): hidden, FFN (per expert), layers, experts, experts per token.
TARGETS = {
    "Llama-3-8B": dict(hidden=4096, kv=1024, ffn=14336, layers=32, experts=1, active=1),
    "Llama-3-70B": dict(hidden=8192, kv=1024, ffn=28672, layers=80, experts=1, active=1),
    "Qwen3-235B-A22B": dict(hidden=4096, q=8192, kv=512, ffn=1536, layers=94, experts=128, active=8),
}


def _block_jobs(shape: dict) -> list[SolveJob]:
    """One block's solves as the walk plans them (all linears of a block in one group: GPTQ's default;
    q/k/v and gate/up share a Hessian, each expert its own)."""
    h, q, kv, f, e = shape["hidden"], shape.get("q", shape["hidden"]), shape["kv"], shape["ffn"], shape["experts"]
    attention = [
        SolveJob(q, h, 32, "qkv"),
        SolveJob(kv, h, 32, "qkv"),
        SolveJob(kv, h, 32, "qkv"),
        SolveJob(h, q, 32, "o"),
    ]
    if e == 1:
        return attention + [SolveJob(f, h, 32, "mlp"), SolveJob(f, h, 32, "mlp"), SolveJob(h, f, 32, "down")]
    # experts are solved one parameter at a time, each expert whole on one rank (equal costs)
    return attention + [SolveJob(o, i, None, (x, n)) for x in range(e) for n, (o, i) in enumerate([(2 * f, h), (h, f)])]


def _slowest_rank(jobs: list[SolveJob], world: int) -> float:
    """The solve cost of the most loaded of ``world`` ranks as ``Ranks.pieces`` places ``jobs``."""
    load, factored = [0.0] * world, [set() for _ in range(world)]
    for job, pieces in zip(jobs, Ranks(0, world).pieces(jobs)):
        for p in pieces:
            load[p.rank] += solve_cost(p.stop - p.start, job.cols) - float(job.cols) ** 3
            if job.hessian not in factored[p.rank]:
                factored[p.rank].add(job.hessian)
                load[p.rank] += float(job.cols) ** 3
    return max(load)


def _block_work(shape: dict, tokens: int) -> tuple[float, float]:
    """(calibration FLOPs, solve cost: Σ in³ per Hessian + SWEEP · out · in²) of one block."""
    h, q, kv, f = shape["hidden"], shape.get("q", shape["hidden"]), shape["kv"], shape["ffn"]
    e, k = shape["experts"], shape["active"]
    params_per_token = h * (q + 2 * kv) + q * h + k * 3 * h * f  # the weights one token meets
    hessian_inputs = [h, q, h, f] if e == 1 else [h, q] + [h, f] * e  # MoE: each expert's rows
    hessian_rows = [tokens, tokens, tokens, tokens] if e == 1 else [tokens, tokens] + [tokens * k // e] * 2 * e
    flops = 2 * tokens * params_per_token + sum(2 * n * w * w for n, w in zip(hessian_rows, hessian_inputs))
    return float(flops), _slowest_rank(_block_jobs(shape), 1)


def projection(measured: dict, rows: list) -> None:
    size = measured["size"]
    here = dict(hidden=size["hidden"], kv=size["hidden"] * size["kv_heads"] // size["heads"], ffn=size["ffn"])
    here.update(layers=size["layers"], experts=1, active=1)
    flops, cost = _block_work(here, size["nsamples"] * size["seqlen"])
    calib_rate, solve_rate = flops / measured["calib_s"], cost / measured["solve_s"]
    print(
        "\nprojection: T(N) = layers x (calibration FLOPs / (N x C) + slowest rank's solve cost / S), 128 x 2048 "
        f"tokens, C = {calib_rate / 1e9:.1f} GFLOP/s and S = {solve_rate / 1e9:.2f} G(in^3 + {SWEEP:g}*out*in^2)/s "
        "measured on one thread here; the solves placed on N ranks as the planner places them (Ranks.pieces: whole "
        "layers, a big one split by rows; each rank factors each Hessian it reads), no communication cost (a "
        "block's float64 Hessians are 0.1-1 GB: seconds on a fast link) and that a rank holds one block"
    )
    for name, shape in TARGETS.items():
        f, _ = _block_work(shape, 128 * 2048)
        jobs = _block_jobs(shape)
        for n in (1, 4, 8):
            hours = shape["layers"] * (f / (n * calib_rate) + _slowest_rank(jobs, n) / solve_rate) / 3600
            rows.append({"projection": name, "ranks": n, "hours_cpu_thread_each": hours})
            print(f"  {name:16s} {n} rank{'s' if n > 1 else ' '}: {hours:9.1f} h (one CPU thread per rank)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--recipe", default="gptq-w4g128")
    ap.add_argument("--layers", type=int, help="blocks of the model (default: the size's)")
    ap.add_argument("--compare-split", action="store_true", help="add 2 ranks with every layer whole on one rank")
    args = ap.parse_args()
    size = dict(SIZES["quick" if args.quick else "big"])
    size["layers"] = args.layers or size.pop("depths")[-1]
    size.pop("depths", None)
    configs = CONFIGS + ([WHOLE] if args.compare_split else [])
    size["nsamples"] = 16 if not args.quick else 32  # batches of 1024 tokens: 8 (2) batches, shared by the ranks
    rows: list = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder, calib = tmp / "model", write_calibration_text(tmp / "calib.txt")
        disk = cli_model_folder(folder, size)
        runs: dict[str, list[dict]] = {label: [] for label, *_ in configs}
        for r in range(args.rounds):
            for label, nproc, threads, split in configs:
                out = tmp / f"out-{nproc}-{threads}-{'' if split else 'whole-'}{r}"
                result = run(folder, calib, out, size, nproc, threads, args.recipe, split)
                runs[label].append(result)
                print(
                    f"round {r + 1} {label:20s} wall {result['wall_s']:7.1f}s  quantize {result['quantize_s']:7.1f}s  "
                    f"peak RSS per rank {', '.join(f'{m:.0f}' for m in result['peak_rss_MB_per_rank'])} MB",
                    flush=True,
                )
                for w in result["per_rank_work"]:
                    print(
                        f"    rank {w['rank']}: {w['forward_s']:.1f}s forward, {w['solve_s']:.1f}s solving "
                        f"{w['solved']} layers, {w['exchange_s']:.1f}s exchange (sums over blocks)",
                        flush=True,
                    )
            same = same_artifact_tensors(tmp / f"out-1-1-{r}", tmp / f"out-2-1-{r}")
            print(f"round {r + 1}: 2-rank artifact bit-identical to 1 rank x 1 thread: {same}", flush=True)
            rows.append({"round": r + 1, "two_ranks_bit_identical_to_one": same})
            if args.compare_split:
                same = same_artifact_tensors(tmp / f"out-1-1-{r}", tmp / f"out-2-1-whole-{r}")
                print(f"round {r + 1}: whole-layer 2-rank artifact bit-identical too: {same}", flush=True)
                rows[-1]["whole_layers_bit_identical_to_one"] = same
        base = statistics.median(x["wall_s"] for x in runs["1 rank x 1 thread"])
        print(f"\n{'configuration':20s} {'wall (median)':>14s} {'spread':>8s} {'vs 1x1':>7s} {'peak RSS/rank':>14s}")
        for label, *_ in configs:
            walls = [x["wall_s"] for x in runs[label]]
            peak = max(max(x["peak_rss_MB_per_rank"]) for x in runs[label])
            row = {
                "configuration": label,
                "wall_s_median": statistics.median(walls),
                "wall_s": walls,
                "quantize_s": [x["quantize_s"] for x in runs[label]],
                "peak_rss_MB_max_rank": peak,
                "peak_over_bf16_file": peak / (disk / 2**20),
                "vs_1x1": statistics.median(walls) / base,
            }
            rows.append(row)
            print(
                f"{label:20s} {row['wall_s_median']:13.1f}s {max(walls) - min(walls):7.1f}s {row['vs_1x1']:6.2f}x "
                f"{peak:9.0f} MB ({row['peak_over_bf16_file']:.2f}x the bf16 file)"
            )
        one = runs["1 rank x 1 thread"]
        blocks = [b for x in one for b in x["blocks"]]
        measured = {
            "size": size,
            "calib_s": statistics.median(b["seconds"] - b["solve_seconds"] for b in blocks),
            "solve_s": statistics.median(b["solve_seconds"] for b in blocks),
        }
        rows.append({"per_block_1x1": measured})
        projection(measured, rows)
    name = "distributed" + ("" if args.recipe == "gptq-w4g128" else f"-{args.recipe}")
    name += f"-{args.layers}-blocks" if args.layers else ""
    path = write_rows(name, rows, args.quick, bf16_file_MB=disk / 2**20, size=size, recipe=args.recipe)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
