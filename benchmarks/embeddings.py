"""Token embeddings quantized in the graph (``QuantizeEmbeddings``): size over all parameters and quality.

    python benchmarks/embeddings.py                      # Gemma-3 270M and longlm (~12 min on 2 cores)
    python benchmarks/embeddings.py --models longlm      # the bundled model alone (~2 min)
    python benchmarks/embeddings.py --rows "gptq-w4g32, embeddings w4g64 gptq" --update   # chosen rows
    python benchmarks/embeddings.py --models gemma-3-270m --rows "gptq-w4g32, embeddings w4g64 gptq" --onnx --update

Per model, the same calibration for every row (Gemma-3 270M: 8 windows of 256 tokens; longlm: 128):
the embedding table left in the model's dtype or quantized by ``QuantizeEmbeddings`` at each setting,
then GPTQ of the block linears (w4g128, or w4g32 for the ≤ 4.5-bit rows) — the order ``--embeddings``
runs them in (the blocks' solves see the quantized lookup). The table is rounded to nearest
(``rtn``) or, for a tied table, solved by GPTQ on the head's input Hessian (``gptq``, the default
with calibration); a tied head reads the quantized table (Gemma-3). Columns: bits per parameter
over **all** parameters and the stored megabytes (from the graph's tensors, as ``model_size``
counts them: the table once; float tensors at 16 bits, as a bf16 checkpoint holds them), next-token
KL to the FP model on held-out windows (frontier.py's judge; 4 windows of 256 for Gemma-3, 32 for
longlm), and the quantize time. Writes benchmarks/results/embeddings.json.

Rows that quantize the table first also change the blocks' GPTQ solve (it sees the quantized lookup),
and this judge moves by up to ~0.03 nats with such perturbations (two 8-bit tables within 0.1 % of
each other differ by that much). ``--controlled`` adds rows that isolate the table's method: the
block linears quantized once, and only the table swapped for what ``QuantizeEmbeddings`` (run alone
on the FP model, RTN or GPTQ) stores.

``--onnx`` also exports each row to ONNX (the table as ``GatherBlockQuantized``, a tied head's
``MatMulNBits`` on the same bytes) and judges ONNX Runtime's logits the same way, at MatMulNBits'
accuracy level 0 (float32 activations: the graph's numbers) and at the export's default 4 (int8
activations); the file's megabytes are what the export wrote (model and external data).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_models import load_model
from frontier import GenerationJudge
from results_file import merged_rows, write_rows

import qcompiler as qc
from qcompiler.ir.model_size import model_size
from qcompiler.ir.tensors import get_raw_tensor, get_tensor, set_tensor
from qcompiler.layouts.gptq_embedding import reference_embedding
from qcompiler.passes import GPTQ, AutoBits, QuantizeEmbeddings


def _rows() -> dict:
    """label: (the block linears' pass, the QuantizeEmbeddings before it or None: the table as it is, or
    what the linears' pass does with it — AutoBits with ``embeddings``)."""
    g128, g32 = GPTQ(bits=4, group_size=128), GPTQ(bits=4, group_size=32)
    rows = {"gptq-w4g128, embeddings FP": (g128, None)}
    for bits, group in ((8, 128), (4, 32), (4, 128)):
        for method in ("rtn", "gptq"):
            emb = QuantizeEmbeddings(bits=bits, group_size=group, method=method)
            rows[f"gptq-w4g128, embeddings w{bits}g{group} {method}"] = (g128, emb)
    rows["gptq-w4g32, embeddings FP"] = (g32, None)
    for bits, group, sym in ((4, 64, False), (4, 32, True), (4, 128, False)):
        emb = QuantizeEmbeddings(bits=bits, group_size=group, sym=sym, method="gptq")
        rows[f"gptq-w4g32, embeddings w{bits}g{group}{'-sym' if sym else ''} gptq"] = (g32, emb)
    # the table inside auto:B's budget: one allocation over the linears and the table
    auto = AutoBits(budget=4.5, embeddings=TABLE_SETTINGS)
    rows["auto:4.5, embeddings in its budget"] = (auto, None)
    return rows


TABLE_SETTINGS = ("w8g128", "w4g128", "w4g64", "w4g32")


CONTROLLED = {  # the linears' GPTQ: the table settings swapped in on top of it
    "gptq-w4g32": (GPTQ(bits=4, group_size=32), ((4, 64), (4, 128))),
    "gptq-w4g128": (GPTQ(bits=4, group_size=128), ((4, 32), (4, 128))),
}


def _stored_table(loaded, calibration, emb: QuantizeEmbeddings) -> torch.Tensor:
    """What ``emb`` run alone on the FP model stores for the table, dequantized."""
    cm = qc.compile(loaded.model, loaded.example_inputs(), recipe=[emb], calibration=calibration, progress=False)
    gm = cm.graph_module
    lookup = next(n for n in gm.graph.nodes if "quant_embedding" in str(n.target))
    stored = [get_tensor(gm, a.target) for a in lookup.args[1:5]]
    rows = loaded.model.get_input_embeddings().weight.shape[0]
    return reference_embedding(*stored, emb.bits, torch.arange(rows)[None])[0]


def _controlled(loaded, calibration, judge) -> list[dict]:
    """The table's method alone: each linears' GPTQ once, then the FP table swapped for each method's."""
    rows = []
    for linears_label, (linears, settings) in CONTROLLED.items():
        torch.manual_seed(0)
        cm = qc.compile(
            loaded.model, loaded.example_inputs(), recipe=[linears], calibration=calibration, progress=False
        )
        gm = cm.graph_module
        lookup = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.embedding.default)
        target, original = lookup.args[0].target, get_tensor(gm, lookup.args[0].target)
        for bits, group in settings:
            for method in ("rtn", "gptq"):
                table = _stored_table(
                    loaded, calibration, QuantizeEmbeddings(bits=bits, group_size=group, method=method)
                )
                set_tensor(gm, target, table.to(original.dtype))
                row = dict(
                    model="gemma-3-270m",
                    recipe=f"{linears_label} linears fixed, table w{bits}g{group} {method}",
                    next_token_kl=judge.kl(cm),
                )
                set_tensor(gm, target, original)
                rows.append(row)
                print(f"{row['recipe']:52s} KL {row['next_token_kl']:.4f}", file=sys.stderr, flush=True)
    return rows


def _through_onnxruntime(cm, judge) -> dict:
    """The row's ONNX export judged in ONNX Runtime at accuracy levels 0 and 4, and its size."""
    out = {}
    for level in (0, 4):
        with tempfile.TemporaryDirectory() as folder:
            fast = cm.with_backend("onnxruntime", path=Path(folder) / "model.onnx", accuracy_level=level)
            out[f"onnx_level{level}_next_token_kl"] = judge.kl(fast)
            out["onnx_mb"] = sum(f.stat().st_size for f in Path(folder).iterdir()) / 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gemma-3-270m", "longlm"])
    ap.add_argument("--rows", nargs="*", default=None, help="only these row labels (default: every row)")
    ap.add_argument("--controlled", action="store_true", help="also the table-only rows (linears fixed)")
    ap.add_argument("--onnx", action="store_true", help="also judge each row's ONNX export in ONNX Runtime")
    ap.add_argument("--update", action="store_true", help="merge these rows into the committed file")
    args = ap.parse_args()
    rows = []
    for name in args.models:
        loaded = load_model(name)
        real = name == "gemma-3-270m"
        calibration = loaded.calibration(8 if real else 128, 256)
        judge = GenerationJudge(loaded, prompts=0, windows=4 if real else 32)
        for label, (linears, embeddings) in _rows().items():
            if args.rows is not None and label not in args.rows:
                continue
            recipe = ([embeddings] if embeddings is not None else []) + [linears]  # as --embeddings orders them
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
                recipe=label,
                bits_per_parameter_all=8 * size.stored_bytes / size.parameters,
                stored_mb=size.stored_bytes / 1e6,
                parameters=size.parameters,
                next_token_kl=judge.kl(cm),
                quant_seconds=seconds,
            )
            if args.onnx:
                row.update(_through_onnxruntime(cm, judge))
            rows.append(row)
            print(
                f"{name:13s} {row['recipe']:44s} {row['bits_per_parameter_all']:.3f} bits/param (all)  "
                f"{row['stored_mb']:.1f} MB  KL {row['next_token_kl']:.4f}  {seconds:.1f}s"
                + (
                    f"  ONNX {row['onnx_mb']:.1f} MB, KL {row['onnx_level0_next_token_kl']:.4f} (level 0) "
                    f"{row['onnx_level4_next_token_kl']:.4f} (level 4)"
                    if args.onnx
                    else ""
                ),
                file=sys.stderr,
                flush=True,
            )
        if args.controlled and real:
            rows += _controlled(loaded, calibration, judge)
    if args.update:
        rows = merged_rows("embeddings", rows)
    print("| model | recipe | bits/param (all) | MB | KL | quantize s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        sized = "bits_per_parameter_all" in r  # the controlled rows: KL only
        print(
            f"| {r['model']} | {r['recipe']} | "
            + (f"{r['bits_per_parameter_all']:.3f} | {r['stored_mb']:.1f} | " if sized else "— | — | ")
            + f"{r['next_token_kl']:.4f} | "
            + (f"{r['quant_seconds']:.1f} |" if sized else "— |")
        )
    print("wrote", write_rows("embeddings", rows))


if __name__ == "__main__":
    main()
