"""GPTQ speed (lazy batch vs straightforward) and calibration memory (2 vs 8 blocks).

    python benchmarks/gptq_speed.py            # 4096x4096 layer, tinylm, memory probes
    python benchmarks/gptq_speed.py --quick    # 1024x1024 layer (smoke run)

1. One linear with a given Hessian: ``gptq_quantize`` (lazy blocks of 128) against
   ``gptq_quantize_reference`` (every column updates all later columns), same run, same inputs.
2. The whole bundled tinylm through the GPTQ pass, with each of the two implementations.
3. Peak resident memory of whole-model GPTQ calibration on the same LLaMA architecture at 2 and
   at 8 blocks (each in a fresh process), next to the model's weight bytes and the size of one
   block's cached inputs: memory should grow with the weights, not with a cache per block.
Writes benchmarks/results/gptq_speed.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import write_atomically  # noqa: E402
from results_file import results_file  # noqa: E402

PROBE_HIDDEN, PROBE_FFN, PROBE_WINDOWS, PROBE_SEQ = 512, 2048, 64, 512


def layer_speed(n: int, device: str = "cpu") -> dict:
    from qcompiler.algorithms.gptq import gptq_quantize, gptq_quantize_reference
    from qcompiler.algorithms.output_error import output_error

    gen = torch.Generator().manual_seed(0)
    X = torch.randn(2 * n, n, generator=gen)
    H = (2 * X.T @ X / X.shape[0]).to(device)
    W = torch.randn(n, n, generator=gen).to(device)
    out = {"shape": f"{n}x{n}", "device": device}
    for name, fn in (("lazy", gptq_quantize), ("reference", gptq_quantize_reference)):
        fn(W[:256, :256], H[:256, :256], bits=4, group_size=128)  # warm-up (CUDA context, kernels)
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        sync()
        start = time.perf_counter()
        res = fn(W, H, bits=4, group_size=128)
        sync()
        out[f"{name}_seconds"] = time.perf_counter() - start
        out[f"{name}_rel_error"] = output_error(W, res.dequantized, H)
        print(f"{n}x{n} {name:9s} {out[f'{name}_seconds']:.2f}s", file=sys.stderr, flush=True)
    out["speedup"] = out["reference_seconds"] / out["lazy_seconds"]
    return out


def model_speed() -> dict:
    import qcompiler as qc
    from qcompiler import models
    from qcompiler.algorithms.gptq import gptq_quantize_reference
    from qcompiler.layouts.grid_result import from_quant_result

    @dataclass(frozen=True)
    class ReferenceGPTQ(qc.passes.GPTQ):
        """The same pass, with the straightforward algorithm."""

        def quantize_layer(self, layer, W, H):
            res = gptq_quantize_reference(
                W, H, bits=self.bits, group_size=self.group_size, sym=self.sym, act_order=self.act_order, damp=self.damp
            )
            return from_quant_result(layer, W, res, self.bits, self.group_size)

    loaded = models.load("tinylm")
    calib = loaded.calibration(32, 256)
    out = {}
    for name, p in (
        ("lazy", qc.passes.GPTQ(bits=4, group_size=128)),
        ("reference", ReferenceGPTQ(bits=4, group_size=128)),
    ):
        start = time.perf_counter()
        cm = qc.compile(loaded.model, loaded.example_inputs(), recipe=[p], calibration=calib, progress=False)
        out[f"{name}_seconds"] = time.perf_counter() - start
        out[f"{name}_gptq_seconds"] = sum(f["seconds"] for f in cm.report.passes[0].layers.values())
        print(f"tinylm {name:9s} {out[f'{name}_seconds']:.1f}s", file=sys.stderr, flush=True)
    return out


def memory_probe(layers: int) -> dict:
    """Run in a fresh process: peak RSS of GPTQ over a LLaMA with ``layers`` blocks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import qcompiler as qc

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=PROBE_HIDDEN,
            intermediate_size=PROBE_FFN,
            num_hidden_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=8,
            max_position_embeddings=PROBE_SEQ,
        )
    ).eval()
    calib = [{"input_ids": torch.randint(0, 256, (8, PROBE_SEQ))} for _ in range(PROBE_WINDOWS // 8)]
    before = _rss_mb()
    peak = [before]
    done = threading.Event()

    def sample():  # the high-water mark of *this* phase (ru_maxrss would include model creation)
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mb())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        qc.compile(
            model,
            {"input_ids": calib[0]["input_ids"][:2, :16], "use_cache": False},
            recipe="gptq-w4g128",
            calibration=calib,
            progress=False,
        )
    finally:
        done.set()
        sampler.join()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "blocks": layers,
        "weight_mb": weights / 2**20,
        "rss_before_mb": before,
        "peak_rss_mb": peak[0],
        "growth_mb": peak[0] - before,
        "one_block_input_cache_mb": PROBE_WINDOWS * PROBE_SEQ * PROBE_HIDDEN * 4 / 2**20,
    }


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--memory-probe", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help="default: results/gptq_speed.json (results/quick/ with --quick)")
    ap.add_argument(
        "--layer-only",
        metavar="DEVICE",
        help="only the one-layer timing, on DEVICE (e.g. cuda); prints JSON, writes nothing",
    )
    args = ap.parse_args()
    args.out = args.out or results_file("gptq_speed", args.quick)
    if args.memory_probe:
        print(json.dumps(memory_probe(args.memory_probe)))
        return
    if args.layer_only:
        print(json.dumps([layer_speed(n, args.layer_only) for n in ((1024,) if args.quick else (4096, 8192))]))
        return
    layer = layer_speed(1024 if args.quick else 4096)
    model = model_speed()
    memory = [
        json.loads(
            subprocess.run(
                [sys.executable, __file__, "--memory-probe", str(n)], check=True, capture_output=True, text=True
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        for n in (2, 8)
    ]
    write_atomically(
        args.out,
        json.dumps(
            {
                "layer": layer,
                "tinylm": model,
                "memory": memory,
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "date": time.strftime("%Y-%m-%d"),
            },
            indent=2,
        )
        + "\n",
    )
    print("| what | lazy (s) | straightforward (s) | speed-up |\n|---|---|---|---|")
    print(
        f"| GPTQ one {layer['shape']} layer, w4g128 | {layer['lazy_seconds']:.2f} | {layer['reference_seconds']:.2f} | "
        f"{layer['speedup']:.1f}x |"
    )
    print(
        f"| tinylm end to end (GPTQ w4g128, 32x256 calibration) | {model['lazy_seconds']:.1f} | "
        f"{model['reference_seconds']:.1f} | {model['reference_seconds'] / model['lazy_seconds']:.1f}x |"
    )
    print("\n| blocks | weights MB | RSS growth during GPTQ, MB | one block's input cache MB |\n|---|---|---|---|")
    for m in memory:
        print(f"| {m['blocks']} | {m['weight_mb']:.0f} | {m['growth_mb']:.0f} | {m['one_block_input_cache_mb']:.0f} |")


if __name__ == "__main__":
    main()
