"""``auto:B``'s two sensitivity measures side by side: a forward pass per layer × candidate
(``sensitivity="forward"``) against the second-order Fisher estimate from one backward pass per
sample (``"fisher"``, the default), with uniform GPTQ w4g128 as the time unit.

    python benchmarks/auto_sensitivity.py                         (~25 min on 2 cores)
    python benchmarks/auto_sensitivity.py --models gemma-3-270m --budgets 4.5 --measures fisher --update

Per model, the same calibration for every row (128 windows of 256 tokens / 128 sentences; Gemma-3
270M: 8 windows of 256, as a user on a small machine would): loss vs FP32 and next-token KL
(frontier.py's judges), bits per parameter counted from the stored tensors, and the quantize time —
the rows of one model run back to back, in the order given, on one otherwise idle machine. Writes
benchmarks/results/auto_sensitivity.json.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from bench_models import load_model
from frontier import GenerationJudge
from results_file import merged_rows, write_rows

import qcompiler as qc
from qcompiler.evaluation.eval import bits_per_parameter
from qcompiler.evaluation.quality import QualityJudge
from qcompiler.passes import AutoBits
from qcompiler.passes.auto_bits import SIGNROUND_CANDIDATES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["minilm", "tinylm", "longlm"])
    ap.add_argument("--budgets", nargs="+", type=float, default=[3.25, 4.16])
    ap.add_argument("--measures", nargs="*", default=["forward", "fisher"])
    ap.add_argument("--calib", type=int, default=128)
    ap.add_argument(
        "--large",
        action="store_true",
        help="also the large-model setting: GPTQ candidates scored by round-to-nearest (score_with='rtn')",
    )
    ap.add_argument(
        "--score-rows",
        nargs="*",
        type=int,
        default=[],
        help="also the Fisher measure with each of these AutoBits.score_rows (0: every row solved)",
    )
    ap.add_argument(
        "--sample-hessians",
        action="store_true",
        help="also the Fisher measure with measure_on='samples' (candidates solved on the samples' Hessians)",
    )
    ap.add_argument("--no-baseline", action="store_true", help="leave out the uniform gptq-w4g128 row")
    ap.add_argument("--update", action="store_true", help="merge these rows into the committed file")
    args = ap.parse_args()
    rows = []
    for name in args.models:
        loaded = load_model(name)
        real = name == "gemma-3-270m"
        calibration = loaded.calibration(8 if real else args.calib, 256 if loaded.kind == "causal-lm" else 128)
        judge = None if real else QualityJudge(loaded)
        fp32 = None if real else judge.score(loaded.model)
        generation = (
            GenerationJudge(loaded, prompts=0, windows=4 if real else 32) if loaded.kind == "causal-lm" else None
        )
        runs = [] if args.no_baseline else [("gptq-w4g128", "gptq-w4g128")]
        runs += [(f"auto:{b:g} {m}", AutoBits(budget=b, sensitivity=m)) for b in args.budgets for m in args.measures]
        if args.sample_hessians:
            runs += [
                (f"auto:{b:g} fisher, sample Hessians", AutoBits(budget=b, measure_on="samples")) for b in args.budgets
            ]
        runs += [
            (f"auto:{b:g} fisher, {r or 'every'} rows", AutoBits(budget=b, score_rows=r))
            for b in args.budgets
            for r in args.score_rows
        ]
        if args.large:
            large = dict(score_with="rtn", candidates=SIGNROUND_CANDIDATES)
            runs += [(f"auto:{b:g} fisher, rtn-scored", AutoBits(budget=b, **large)) for b in args.budgets]
        for label, recipe in runs:
            torch.manual_seed(0)
            start = time.perf_counter()
            cm = qc.compile(
                loaded.model, loaded.example_inputs(), recipe=recipe, calibration=calibration, progress=False
            )
            row = dict(model=name, recipe=label, quant_seconds=time.perf_counter() - start)
            row["bits_per_parameter"] = bits_per_parameter(cm.graph_module)
            if judge is not None:
                row["loss"] = judge.loss(fp32, judge.score(cm))
            if generation is not None:
                row["next_token_kl"] = generation.kl(cm)
            rows.append(row)
            print(
                f"{name:12s} {label:22s} {row['bits_per_parameter']:.3f} bits  loss {row.get('loss', float('nan')):.5f}"
                f"  KL {row.get('next_token_kl', float('nan')):.4f}  {row['quant_seconds']:.1f}s",
                file=sys.stderr,
                flush=True,
            )
    if args.update:
        rows = merged_rows("auto_sensitivity", rows)
    print("wrote", write_rows("auto_sensitivity", rows, calib=args.calib))


if __name__ == "__main__":
    main()
