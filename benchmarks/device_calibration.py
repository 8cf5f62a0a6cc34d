"""GPTQ calibration on the GPU vs the CPU: whole-model time, peak memory, and the same result.

    python benchmarks/device_calibration.py                 # cpu vs cuda on a 4-layer LLaMA (1024 wide),
                                                            # then cuda alone on 2 LLaMA-7B-shaped blocks
    python benchmarks/device_calibration.py --quick         # tiny shapes, cpu only (checks the script)

Each case runs in a fresh process (clean peak-memory counters): a randomly initialized LLaMA
(seeded, so every process builds the same weights) is compiled with ``gptq-w4g128`` on seeded
random token windows with ``device=`` cpu or cuda; the model stays on the CPU, one block at a time
is onloaded. Reported: seconds, peak GPU memory, peak RSS, the quantized model's relative logit
error against FP32 on held-out windows, and the relative distance between the cpu- and
cuda-compiled models' logits (float reductions round differently on the two devices).
Writes benchmarks/results/device_calibration.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from peak_memory import peak_rss_mb
from results_file import results_file

CASES = {  # name: (hidden, ffn, layers, nsamples, seqlen, devices)
    "llama-1024x4": (1024, 2816, 4, 32, 512, ("cpu", "cuda")),
    "llama7b-shape-x2": (4096, 11008, 2, 128, 2048, ("cuda",)),
    "quick": (128, 352, 2, 8, 64, ("cpu",)),
}


def build(hidden: int, ffn: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 128),
        num_key_value_heads=max(1, hidden // 128),
        vocab_size=32000,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(config).eval()


def one(case: str, device: str, logits_path: str) -> dict:
    import qcompiler as qc

    hidden, ffn, layers, nsamples, seqlen, _ = CASES[case]
    model = build(hidden, ffn, layers)
    gen = torch.Generator().manual_seed(1)
    windows = torch.randint(0, 32000, (nsamples, seqlen), generator=gen)
    calib = [{"input_ids": windows[i : i + 8]} for i in range(0, nsamples, 8)]
    held_out = {"input_ids": torch.randint(0, 32000, (2, min(seqlen, 256)), generator=gen)}
    start = time.perf_counter()
    cm = qc.compile(model, calib[0], recipe="gptq-w4g128", calibration=calib, device=device, progress=False)
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
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--one", nargs=3, metavar=("CASE", "DEVICE", "LOGITS"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help="default: results/device_calibration.json (results/quick/ with --quick)")
    args = ap.parse_args()
    args.out = args.out or results_file("device_calibration", args.quick)
    if args.one:
        print(json.dumps(one(*args.one)))
        return
    cases = ["quick"] if args.quick else ["llama-1024x4", "llama7b-shape-x2"]
    from qcompiler.store.atomic import write_text_atomically

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
