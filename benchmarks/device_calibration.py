"""GPTQ calibration on the GPU vs the CPU: whole-model time, peak memory, and the same result.

    python benchmarks/device_calibration.py                 # cpu vs cuda on a 4-layer LLaMA (1024 wide),
                                                            # then cuda alone on 2 LLaMA-7B-shaped blocks
    python benchmarks/device_calibration.py --quick         # tiny shapes, cpu only (checks the script)
    python benchmarks/device_calibration.py --cases llama70b-block   # one Llama-3-70B-shaped block on the
                                                            # GPU, and the projection to 8B / 70B / 235B

Each case runs in a fresh process (clean peak-memory counters): a randomly initialized LLaMA
(seeded, so every process builds the same weights) is compiled with ``gptq-w4g128`` on seeded
random token windows with ``device=`` cpu or cuda; the model stays on the CPU, one block at a time
is onloaded. Reported: seconds, peak GPU memory, peak RSS, the quantized model's relative logit
error against FP32 on held-out windows, and the relative distance between the cpu- and
cuda-compiled models' logits (float reductions round differently on the two devices).
For the block cases (two blocks of a real model's shape; the first is timed, as the last skips the
advance), each block's seconds split into solves (the layers' own seconds in the pass's log) and
the rest (forward passes, Hessian products, block advance). From these and the GPTQ solve of one
expert of Qwen3-235B-A22B's shape, the projection (``benchmarks/distributed.py``'s shapes and cost
model) gives whole-model hours on 1, 4 and 8 GPUs: calibration splits by windows across ranks,
solves are packed on ranks longest first (the makespan, not an even split: the down projection
bounds a dense block). Writes benchmarks/results/device_calibration.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from peak_memory import peak_rss_mb
from results_file import results_file

CASES = {  # name: (hidden, ffn, layers, nsamples, seqlen, devices, kv heads or None for all)
    "llama-1024x4": (1024, 2816, 4, 32, 512, ("cpu", "cuda"), None),
    "llama7b-shape-x2": (4096, 11008, 2, 128, 2048, ("cuda",), None),
    "llama70b-block": (8192, 28672, 2, 128, 2048, ("cuda",), 8),  # Llama-3-70B: 64 heads, 8 KV heads
    "quick": (128, 352, 2, 8, 64, ("cpu",), None),
    "quick-block": (256, 704, 2, 8, 64, ("cpu",), 2),
}
BLOCK_CASES = ("llama70b-block", "quick-block")
EXPERT_SHAPES = {"llama70b-block": [(1536, 4096), (4096, 1536)], "quick-block": [(96, 256), (256, 96)]}  # (out, in)


def build(hidden: int, ffn: int, layers: int, kv_heads=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = max(1, hidden // 128)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        vocab_size=32000,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(config).eval()


def one(case: str, device: str, logits_path: str) -> dict:
    import qcompiler as qc

    hidden, ffn, layers, nsamples, seqlen, _, kv_heads = CASES[case]
    model = build(hidden, ffn, layers, kv_heads)
    gen = torch.Generator().manual_seed(1)
    windows = torch.randint(0, 32000, (nsamples, seqlen), generator=gen)
    calib = [{"input_ids": windows[i : i + 8]} for i in range(0, nsamples, 8)]
    held_out = {"input_ids": torch.randint(0, 32000, (2, min(seqlen, 256)), generator=gen)}
    log = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stderr(log):  # the pass's per-block and per-layer lines
        cm = qc.compile(model, calib[0], recipe="gptq-w4g128", calibration=calib, device=device)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        fp = model(**held_out).logits
    q = cm(**held_out)
    q = q["logits"] if isinstance(q, dict) else getattr(q, "logits", q[0] if isinstance(q, (tuple, list)) else q)
    torch.save(q, logits_path)
    out = {
        "case": case,
        "device": device,
        "seconds": seconds,
        "threads": torch.get_num_threads(),
        "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
        "calibration_tokens": nsamples * seqlen,
        "rel_logit_error_vs_fp32": ((q - fp).norm() / fp.norm()).item(),
        "peak_rss_MB": peak_rss_mb(),
    }
    if device.startswith("cuda"):
        out["peak_gpu_MB"] = torch.cuda.max_memory_allocated() / 2**20
        out["gpu"] = torch.cuda.get_device_name()
    if case in BLOCK_CASES:
        from distributed import block_log

        if not (blocks := block_log(log.getvalue())):
            sys.exit(f"no per-block lines in the pass's log:\n{log.getvalue()[-2000:]}")
        out["blocks"] = blocks
        out["expert_solve_s"] = {f"{o}x{i}": solve_seconds(o, i, device) for o, i in EXPERT_SHAPES[case]}
    return out


def solve_seconds(rows: int, columns: int, device: str) -> float:
    """One GPTQ solve with the pass's defaults (act-order, static groups, searched grid) at this shape."""
    from qcompiler.algorithms.gptq import gptq_quantize

    gen = torch.Generator().manual_seed(2)
    X = torch.randn(2 * columns, columns, generator=gen)
    H, W = (2 * X.T @ X / X.shape[0]).to(device), torch.randn(rows, columns, generator=gen).to(device)
    kw = dict(bits=4, group_size=128, act_order=True, static_groups=True, grid="mse")
    gptq_quantize(W[:, :256], H[:256, :256], **kw)  # warm-up
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    start = time.perf_counter()
    gptq_quantize(W, H, **kw)
    sync()
    return time.perf_counter() - start


def makespan(costs: list[float], ranks: int) -> float:
    """The busiest rank's total when jobs go longest first to the least loaded rank (the owner rule)."""
    loads = [0.0] * ranks
    for c in sorted(costs, reverse=True):
        loads[loads.index(min(loads))] += c
    return max(loads)


def projection(row: dict, rows: list) -> None:
    """Whole-model hours on N GPUs from one measured block (the first: it includes the advance)."""
    from distributed import TARGETS, _block_work

    hidden, ffn, _, nsamples, seqlen, _, kv_heads = CASES[row["case"]]
    kv = hidden * kv_heads // max(1, hidden // 128)
    flops, _ = _block_work(dict(hidden=hidden, kv=kv, ffn=ffn, experts=1, active=1), nsamples * seqlen)
    block = row["blocks"][0]
    calib_rate = flops / (block["seconds"] - block["solve_seconds"])
    shapes = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (ffn, hidden), (ffn, hidden)]
    shapes.append((hidden, ffn))  # (out, in) in the log's order: q k v o gate up down
    layer_s = list(block["layers"].values())
    rate = sum(i**3 + o * i * i for o, i in shapes) / sum(layer_s)  # solve cost per second, for the MoE attention
    expert = row["expert_solve_s"]
    print(
        f"\nprojection from one {row['case']} block on {row.get('gpu', row['device'])}: {block['seconds']:.1f}s, of "
        f"which solves {block['solve_seconds']:.1f}s; calibration rate {calib_rate / 1e12:.1f} TFLOP/s "
        f"(forward + Hessian products at {nsamples} x {seqlen} tokens); T(N) = layers x (calibration / N + "
        "makespan of the solves on N ranks); communication not counted"
    )
    for name, shape in TARGETS.items():
        f, _ = _block_work(shape, 128 * 2048)
        h, q, kvt, e = shape["hidden"], shape.get("q", shape["hidden"]), shape["kv"], shape["experts"]
        attention = [(i**3 + o * i * i) / rate for o, i in [(q, h), (kvt, h), (kvt, h), (h, q)]]
        if e == 1 and (h, shape["ffn"]) == (hidden, ffn):
            solves = layer_s  # the measured block itself
        elif e == 1:  # a dense block of another shape: the cost model at the measured rate
            solves = attention + [(i**3 + o * i * i) / rate for o, i in [(shape["ffn"], h)] * 2 + [(h, shape["ffn"])]]
        else:  # each expert's three solves, timed at their real shape (the cost model for --quick)
            timed = [(shape["ffn"], h)] * 2 + [(h, shape["ffn"])]
            per_expert = [expert.get(f"{o}x{i}", (i**3 + o * i * i) / rate) for o, i in timed]
            solves = attention + per_expert * e
        for n in (1, 4, 8):
            hours = shape["layers"] * (f / calib_rate / n + makespan(solves, n)) / 3600
            rows.append({"projection": name, "gpus": n, "hours": hours, "from_case": row["case"]})
            print(f"  {name:16s} {n} GPU{'s' if n > 1 else ' '}: {hours:7.2f} h")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cases", nargs="+", choices=sorted(CASES), help="default: llama-1024x4 llama7b-shape-x2")
    ap.add_argument("--one", nargs=3, metavar=("CASE", "DEVICE", "LOGITS"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help="default: results/device_calibration.json (results/quick/ with --quick)")
    args = ap.parse_args()
    args.out = args.out or results_file("device_calibration", args.quick)
    if args.one:
        print(json.dumps(one(*args.one)))
        return
    cases = args.cases or (["quick", "quick-block"] if args.quick else ["llama-1024x4", "llama7b-shape-x2"])
    from qcompiler.files.atomic import write_text_atomically

    rows = []

    def write() -> None:  # after every case: a time limit keeps what was measured
        write_text_atomically(
            args.out,
            json.dumps({"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "rows": rows}, indent=1) + "\n",
        )

    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            logits = {}
            for device in CASES[case][5]:
                if device == "cuda" and not torch.cuda.is_available():
                    print(f"{case}: no CUDA GPU, cuda skipped", file=sys.stderr)
                    continue
                path = f"{tmp}/{case}-{device}.pt"
                done = subprocess.run(
                    [sys.executable, __file__, "--one", case, device, path], capture_output=True, text=True
                )
                if done.returncode:
                    sys.exit(f"{case} on {device} failed:\n{done.stderr[-3000:]}")
                row = json.loads(done.stdout.strip().splitlines()[-1])
                logits[device] = torch.load(path, weights_only=True)
                rows.append(row)
                if case in BLOCK_CASES:
                    projection(row, rows)
                write()
                print(
                    f"{case:18s} {device:5s} {row['seconds']:8.1f}s  logit error vs fp32 "
                    f"{row['rel_logit_error_vs_fp32']:.4f}  peak GPU {row.get('peak_gpu_MB', 0):8.0f} MB  "
                    f"peak RSS {row['peak_rss_MB']:8.0f} MB",
                    flush=True,
                )
            if len(logits) == 2:
                a, b = logits["cpu"], logits["cuda"]
                rows.append(
                    {
                        "case": case,
                        "cpu_over_cuda_seconds": rows[-2]["seconds"] / rows[-1]["seconds"],
                        "rel_distance_cpu_vs_cuda_logits": ((a - b).norm() / a.norm()).item(),
                    }
                )
                print(
                    f"{case:18s} cuda is {rows[-1]['cpu_over_cuda_seconds']:.1f}x faster; cpu vs cuda logits "
                    f"differ by {rows[-1]['rel_distance_cpu_vs_cuda_logits']:.4f} (relative)",
                    flush=True,
                )
    write()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
