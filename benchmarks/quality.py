"""Quality benchmark: FP32 and every built-in recipe on both bundled models.

    python benchmarks/quality.py                 # all recipes, both models (~10 min on 2 cores)
    python benchmarks/quality.py --models minilm --recipes gptq-w4g128 rtn-w4g128
    python benchmarks/quality.py --backend onnxruntime --recipes w8a8 gptq-w4g128   # scored through ORT

Prints a table and writes benchmarks/results/quality.json (model, recipe, metric, value, loss vs
FP32, bits per quantized weight counted from the stored tensors, quantization seconds). New
built-in recipes appear as rows automatically.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

import qcompiler as qc
from qcompiler import models
from qcompiler.evaluation.eval import bits_per_parameter
from qcompiler.evaluation.quality import QualityJudge
from qcompiler.files.atomic import write_text_atomically as write_atomically

RESULTS = Path(__file__).resolve().parent / "results" / "quality.json"


def run(model_names, recipe_names, calib: int, out: Path, backend: str = "eager") -> list[dict]:
    rows = []
    for name in model_names:
        loaded = models.load(name)
        judge = QualityJudge(loaded)
        calibration = loaded.calibration(calib, 256 if loaded.kind == "causal-lm" else 128)
        fp32 = judge.score(loaded.model)
        rows.append(
            dict(
                model=name,
                recipe="fp32",
                metric=judge.metric,
                value=fp32,
                loss=0.0,
                bits_per_weight=32.0,
                quant_seconds=0.0,
            )
        )
        print(f"{name:7s} {'fp32':20s} {judge.metric} {fp32:.4f}", file=sys.stderr, flush=True)
        for recipe in recipe_names:
            torch.manual_seed(0)
            start = time.perf_counter()
            cm = qc.compile(
                loaded.model,
                loaded.example_inputs(),
                recipe=recipe,
                calibration=calibration,
                backend=backend,
                progress=False,
            )
            seconds = time.perf_counter() - start
            value = judge.score(cm)
            try:
                bits = bits_per_parameter(cm.graph_module)
            except ValueError:
                bits = None
            rows.append(
                dict(
                    model=name,
                    recipe=recipe,
                    backend=backend,
                    metric=judge.metric,
                    value=value,
                    loss=judge.loss(fp32, value),
                    bits_per_weight=bits,
                    quant_seconds=seconds,
                )
            )
            print(
                f"{name:7s} {recipe:20s} {judge.metric} {value:.4f}  loss {judge.loss(fp32, value):+.4f}  "
                f"{seconds:.1f}s",
                file=sys.stderr,
                flush=True,
            )
    meta = dict(
        calibration=calib,
        backend=backend,
        torch=torch.__version__,
        machine=platform.machine(),
        threads=torch.get_num_threads(),
        date=time.strftime("%Y-%m-%d"),
    )
    write_atomically(out, json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return rows


def print_table(rows: list[dict]) -> None:
    print("| model | recipe | metric | value | loss vs FP32 | bits/weight | quantize s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        bits = "-" if r["bits_per_weight"] is None else f"{r['bits_per_weight']:.3f}"
        print(
            f"| {r['model']} | {r['recipe']} | {r['metric']} | {r['value']:.4f} | {r['loss']:+.4f} | "
            f"{bits} | {r['quant_seconds']:.1f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tinylm", "minilm"])
    ap.add_argument("--recipes", nargs="+", default=[r.name for r in qc.list_recipes() if r.name != "none"])
    ap.add_argument("--calib", type=int, default=128, help="calibration windows (tinylm) / sentences (minilm)")
    ap.add_argument("--backend", default="eager", help="eager | onnxruntime (quantize seconds include export)")
    ap.add_argument(
        "--out", type=Path, default=None, help="default: results/quality.json (eager) or results/quality_<backend>.json"
    )
    args = ap.parse_args()
    out = args.out or (RESULTS if args.backend == "eager" else RESULTS.with_name(f"quality_{args.backend}.json"))
    print_table(run(args.models, args.recipes, args.calib, out, args.backend))


if __name__ == "__main__":
    main()
