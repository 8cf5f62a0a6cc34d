"""Which GPTQ (or SignRound) settings are the defaults: each choice measured with and without, on both bundled models.

    python benchmarks/gptq_defaults.py                    # w4g128 and w3g128, MiniLM and tinylm (~15 min)
    python benchmarks/gptq_defaults.py --models minilm --bits 3 --quick
    python benchmarks/gptq_defaults.py --method signround --models minilm longlm   # ~40 min

Variants (one change from plain GPTQ each, then together): true-sequential calibration inside a
block, act-order with static groups (no g_idx gather at run time), the error-minimizing ("mse")
grid, and Hessians accumulated in float64. Same calibration for every row; the loss is 1 − cosine
(MiniLM) or the relative perplexity increase (tinylm) on held-out data; bits per weight counted from
the stored tensors. Prints a table and writes benchmarks/results/gptq_defaults.json.

``--method signround``: SignRound's defaults (searched starting grid, the FP model's block outputs
as the target) against AutoRound's start (min-max), GPTQ's target (the block's FP weights on the
quantized model's inputs), and half / twice the steps; writes benchmarks/results/signround_settings.json.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from results_file import write_rows

import qcompiler as qc
from qcompiler import models
from qcompiler.evaluation.eval import bits_per_parameter
from qcompiler.evaluation.quality import QualityJudge

GPTQ_VARIANTS = {
    "plain": dict(),
    "true-sequential": dict(true_sequential=True),
    "act-order+static": dict(act_order=True, static_groups=True),
    "act-order": dict(act_order=True),
    "mse-grid": dict(grid="mse"),
    "all": dict(true_sequential=True, act_order=True, static_groups=True, grid="mse"),
}
SIGNROUND_VARIANTS = {
    "plain": dict(),  # the defaults (the "vs plain" column compares with them)
    "minmax-start": dict(start="minmax"),
    "sequential-target": dict(target="sequential"),
    "iters-100": dict(iters=100),
    "iters-400": dict(iters=400),
}
METHODS = {  # --method: (pass, its variants, results file)
    "gptq": (qc.passes.GPTQ, GPTQ_VARIANTS, "gptq_defaults"),
    "signround": (qc.passes.SignRound, SIGNROUND_VARIANTS, "signround_settings"),
}


def run(model_names, bits_list, variants, calib: int, method: str = "gptq") -> list[dict]:
    make_pass, table, _ = METHODS[method]
    rows = []
    for name in model_names:
        loaded = models.load(name)
        judge = QualityJudge(loaded)
        calibration = loaded.calibration(calib, 256 if loaded.kind == "causal-lm" else 128)
        fp32 = judge.score(loaded.model)
        for bits in bits_list:
            for variant in variants:
                settings = dict(bits=bits, group_size=128, **table[variant])
                torch.manual_seed(0)
                start = time.perf_counter()
                cm = qc.compile(
                    loaded.model,
                    loaded.example_inputs(),
                    recipe=[make_pass(**settings)],
                    calibration=calibration,
                    progress=False,
                )
                seconds = time.perf_counter() - start
                value = judge.score(cm)
                row = dict(
                    model=name,
                    bits=bits,
                    method=method,
                    variant=variant,
                    metric=judge.metric,
                    value=value,
                    loss=judge.loss(fp32, value),
                    bits_per_weight=bits_per_parameter(cm.graph_module),
                    quant_seconds=seconds,
                )
                rows.append(row)
                print(f"{name:7s} w{bits}g128 {variant:18s} loss {row['loss']:.5f}  {seconds:.1f}s", file=sys.stderr)
    return rows


def print_table(rows: list[dict]) -> None:
    print("| model | bits | variant | loss vs FP32 | vs plain | bits/weight | quantize s |")
    print("|---|---|---|---|---|---|---|")
    plain = {(r["model"], r["bits"]): r["loss"] for r in rows if r["variant"] == "plain"}
    for r in rows:
        base = plain.get((r["model"], r["bits"]))
        ratio = f"{r['loss'] / base:.3f}x" if base else "-"
        print(
            f"| {r['model']} | {r['bits']} | {r['variant']} | {r['loss']:.5f} | {ratio} | "
            f"{r['bits_per_weight']:.3f} | {r['quant_seconds']:.1f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["minilm", "tinylm"])
    ap.add_argument("--bits", nargs="+", type=int, default=[4, 3])
    ap.add_argument("--method", choices=list(METHODS), default="gptq")
    ap.add_argument("--variants", nargs="+", default=None, help="default: all of the method's")
    ap.add_argument("--calib", type=int, default=128, help="calibration windows (tinylm) / sentences (minilm)")
    ap.add_argument("--quick", action="store_true", help="write under results/quick/ (not the committed JSON)")
    args = ap.parse_args()
    _, table, results = METHODS[args.method]
    variants = args.variants or list(table)
    unknown = sorted(set(variants) - set(table))
    if unknown:
        ap.error(f"unknown {args.method} variants {unknown}; choose from {list(table)}")
    rows = run(args.models, args.bits, variants, args.calib, args.method)
    write_rows(results, rows, args.quick, calibration=args.calib)
    print_table(rows)


if __name__ == "__main__":
    main()
