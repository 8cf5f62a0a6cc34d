"""Token embeddings quantized in the graph (``QuantizeEmbeddings``): size over all parameters and quality.

    python benchmarks/embeddings.py                      # Gemma-3 270M and longlm (~6 min on 2 cores)
    python benchmarks/embeddings.py --models longlm      # the bundled model alone (~1 min)

Per model, the same GPTQ w4g128 of the block linears and calibration for every row (Gemma-3 270M: 8
windows of 256 tokens; longlm: 128), then the embedding table left in the model's dtype or quantized
by ``QuantizeEmbeddings`` at each setting; a tied head reads the quantized table (Gemma-3). Columns:
bits per parameter over **all** parameters and the stored megabytes (from the graph's tensors, as
``model_size`` counts them: the table once; float tensors at 16 bits, as a bf16 checkpoint holds them), next-token KL to the FP model on held-out windows
(frontier.py's judge; 4 windows of 256 for Gemma-3, 32 for longlm), and the quantize time.
Writes benchmarks/results/embeddings.json.
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
from qcompiler.ir.model_size import model_size
from qcompiler.ir.tensors import get_raw_tensor
from qcompiler.passes import GPTQ, QuantizeEmbeddings

SETTINGS = {  # label: the QuantizeEmbeddings after GPTQ (None: the table left as it is)
    "embeddings FP": None,
    "embeddings w8g128": QuantizeEmbeddings(bits=8, group_size=128),
    "embeddings w4g32": QuantizeEmbeddings(bits=4, group_size=32),
    "embeddings w4g128": QuantizeEmbeddings(bits=4, group_size=128),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gemma-3-270m", "longlm"])
    ap.add_argument("--update", action="store_true", help="merge these rows into the committed file")
    args = ap.parse_args()
    rows = []
    for name in args.models:
        loaded = load_model(name)
        real = name == "gemma-3-270m"
        calibration = loaded.calibration(8 if real else 128, 256)
        judge = GenerationJudge(loaded, prompts=0, windows=4 if real else 32)
        for label, embeddings in SETTINGS.items():
            recipe = [GPTQ(bits=4, group_size=128)] + ([embeddings] if embeddings is not None else [])
            torch.manual_seed(0)
            start = time.perf_counter()
            cm = qc.compile(
                loaded.model, loaded.example_inputs(), recipe=recipe, calibration=calibration, progress=False
            )
            seconds = time.perf_counter() - start
            gm = cm.graph_module
            sixteen = {  # float tensors as a bf16 checkpoint stores them (the graph computes in float32)
                n.target: torch.bfloat16
                for n in gm.graph.nodes
                if n.op == "get_attr" and getattr(get_raw_tensor(gm, n.target), "dtype", None) == torch.float32
            }
            size = model_size(gm, stored_as=sixteen)
            row = dict(
                model=name,
                recipe=f"gptq-w4g128, {label}",
                bits_per_parameter_all=8 * size.stored_bytes / size.parameters,
                stored_mb=size.stored_bytes / 1e6,
                parameters=size.parameters,
                next_token_kl=judge.kl(cm),
                quant_seconds=seconds,
            )
            rows.append(row)
            print(
                f"{name:13s} {row['recipe']:32s} {row['bits_per_parameter_all']:.3f} bits/param (all)  "
                f"{row['stored_mb']:.1f} MB  KL {row['next_token_kl']:.4f}  {seconds:.1f}s",
                file=sys.stderr,
                flush=True,
            )
    if args.update:
        rows = merged_rows("embeddings", rows)
    print("| model | recipe | bits/param (all) | MB | KL | quantize s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['recipe']} | {r['bits_per_parameter_all']:.3f} | {r['stored_mb']:.1f} | "
            f"{r['next_token_kl']:.4f} | {r['quant_seconds']:.1f} |"
        )
    print("wrote", write_rows("embeddings", rows))


if __name__ == "__main__":
    main()
