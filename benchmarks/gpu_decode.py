"""Decode tokens/s on a GPU: a ~1.1 B LLaMA (TinyLlama's shapes, random fp16 weights), batch 1.

    python benchmarks/gpu_decode.py                 # on a CUDA GPU (scripts/gpu_check.sh runs it)
    python benchmarks/gpu_decode.py --smoke         # a 2-layer toy under TRITON_INTERPRET=1: checks the script

Engines, all on the same weights and prompt (--prompt tokens, then --new greedy tokens; tokens/s
counts the decode steps after the first token): transformers ``generate`` in fp16 on the GPU (what
a user runs today), and qcompiler's ``triton`` backend — fp16 (recipe ``none``: every matmul is
cuBLAS) and W4A16 g128, W3A16 g128, W8A8, SpQR w3g16 (when --time-budget allows: its solver is the
slow part) — decoding over the static cache with the step replayed as a CUDA graph
(``cache="auto"``), plus fp16 on the dynamic cache (no CUDA graph) to show what the graph is worth.
Rounds are interleaved (each round runs every engine once); the table gives median and min-max.
The weights are random, so the quantized models are made with RTN (decode speed depends only on the
stored layout, which GPTQ and RTN share). Each row keeps its greedy tokens: the static-cache
CUDA-graph fp16 run must give the dynamic-cache run's tokens (``--smoke`` also runs the eager
backend, whose tokens each triton engine must match). Writes benchmarks/results/gpu_decode.json
(``--smoke``: results/quick/).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_clock import HFEngine  # noqa: E402
from results_file import write_rows  # noqa: E402

RECIPES = ["none", "rtn-w4g128", "w8a8", "rtn-w3g128", "spqr-w3g16"]  # most wanted first: a budget cuts the tail


def llama(smoke: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = (
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256)
        if smoke
        else dict(
            hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, vocab_size=32000
        )
    )
    config = LlamaConfig(
        **shape, num_key_value_heads=max(1, shape["num_attention_heads"] // 8), max_position_embeddings=512
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).half().eval()


class QCEngine:
    def __init__(self, cm, cache: str):
        self.cm, self.cache = cm, cache

    def run(self, ids, new):
        from qcompiler.generation import timed_generation  # after --smoke chose the interpreter

        done = timed_generation(self.cm, ids, new, eos_token_id=-1, cache=self.cache)
        return done["decode_tokens_per_second"], done["tokens"][0].tolist()


def build(model, example, smoke: bool, budget_s: float, started: float):
    """Every engine that fits the time budget: (name, engine, recipe, seconds to build)."""
    import qcompiler as qc

    engines = []
    if torch.cuda.is_available():
        engines.append(("transformers fp16", HFEngine(copy.deepcopy(model).cuda()), "none", 0.0))
    for recipe in RECIPES:
        if time.perf_counter() - started > budget_s:
            print(f"skipped {recipe}: the time budget ({budget_s:.0f} s) is spent", flush=True)
            continue
        t0 = time.perf_counter()
        calibration = [{"input_ids": example}] if recipe.startswith("spqr") else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cm = qc.compile(model, {"input_ids": example}, recipe=recipe, calibration=calibration, progress=False)
            on_triton = cm.with_backend("triton")
        seconds = time.perf_counter() - t0
        label = "fp16" if recipe == "none" else recipe
        cache = "static" if smoke else "auto"  # auto on a GPU: static cache + CUDA graph
        engines.append((f"triton {label}", QCEngine(on_triton, cache), recipe, seconds))
        if recipe == "none":
            engines.append(("triton fp16, dynamic cache", QCEngine(on_triton, "dynamic"), recipe, 0.0))
        if smoke:
            engines.append((f"eager {label}", QCEngine(cm, "dynamic"), recipe, 0.0))
        print(f"built {label} in {seconds:.1f} s", flush=True)
    return engines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="2-layer toy under TRITON_INTERPRET=1 (no GPU needed)")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--time-budget", type=float, default=150.0, help="seconds after which no more engines are built")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA GPU is present: this benchmark needs one (run --smoke to check the script)")
        return 0
    if args.smoke:
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        args.new, args.rounds, args.prompt = min(args.new, 4), 1, min(args.prompt, 6)
    started = time.perf_counter()
    model = llama(args.smoke)
    vocab = model.config.vocab_size
    example = torch.randint(3, vocab, (1, 8), generator=torch.Generator().manual_seed(1))
    ids = torch.randint(3, vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    engines = build(model, example, args.smoke, args.time_budget, started)
    rates = {name: [] for name, *_ in engines}
    tokens = {}
    for _ in range(args.rounds + (0 if args.smoke else 1)):  # a GPU run's first round warms up (autotuning)
        for name, engine, *_ in engines:
            r, t = engine.run(ids, args.new)
            rates[name].append(r)
            tokens[name] = t
    if not args.smoke:
        rates = {name: r[1:] for name, r in rates.items()}
    rows = []
    base = statistics.median(rates["triton fp16"])
    for name, _, recipe, seconds in engines:
        med = statistics.median(rates[name])
        rows.append(
            dict(
                engine=name,
                recipe=recipe,
                decode_tokens_per_s=med,
                min=min(rates[name]),
                max=max(rates[name]),
                vs_triton_fp16=med / base,
                build_seconds=seconds,
                tokens=tokens[name],
            )
        )
        print(
            f"{name:<30} {med:9.1f} tok/s  ({min(rates[name]):.1f}-{max(rates[name]):.1f})  "
            f"{med / base:5.2f}x triton fp16",
            flush=True,
        )
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu (interpreter)"
    out = write_rows(
        "gpu_decode",
        rows,
        quick=args.smoke,
        device=device,
        model=f"LLaMA {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B, random fp16",
        prompt=args.prompt,
        new=args.new,
        rounds=args.rounds,
    )
    if args.out:
        args.out.write_text(out.read_text())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
