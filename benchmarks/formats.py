"""The formats GPUs serve today — FP8 (per channel, per block; dynamic or static FP8 activations),
NVFP4 (W4A16 and W4A4) and MXFP4 (W4A16), an FP8 KV cache — qcompiler's RTN, GPTQ and rotated GPTQ
against llm-compressor 0.14's presets on the same models, calibration and bits.

    python benchmarks/formats.py --llmc-python /tmp/venvs/llmc/bin/python            (~30 min, 2 cores)
    python benchmarks/formats.py --llmc-python ... --models minilm --quick            (checks the script)
    python benchmarks/formats.py --plot                     (docs/formats.png from the committed JSON)

llm-compressor lives in its own venv (``python -m venv --system-site-packages V && V/bin/pip install
llmcompressor==0.14.0``); each of its rows runs in a child process of that venv: its
``QuantizationModifier`` with the preset (``FP8_DYNAMIC``, ``FP8_BLOCK``, ``NVFP4A16``, ``MXFP4A16``:
its RTN; ``NVFP4``: W4A4) or its ``GPTQModifier`` with the preset (dampening 0.01, its default activation order),
``oneshot`` with the sequential pipeline on the same calibration windows / sentences as ours. The
judges are benchmarks/frontier.py's: loss vs FP32 (MiniLM 1 − cosine, LMs perplexity increase) and
next-token KL on held-out windows (Gemma-3 270M: KL on 8 windows of 256 tokens only). Bits: ours
counted from the stored tensors, per quantized weight and over all parameters (the untouched
embeddings and norms as the graph stores them: float32 here); a peer row is the same format
on the same layers (compressed-tensors stores the same element and scale bits), so it carries the
bits of our row of that format. Writes benchmarks/results/formats.json; docs/results.md quotes it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from bench_models import REAL, load_model
from frontier import GenerationJudge
from peers_quality import worker_row
from results_file import merged_rows, write_rows

PEERS = {
    # name: (modifier, preset) — llm-compressor's own recipe for the format
    "llmc-fp8-dynamic": ("QuantizationModifier", "FP8_DYNAMIC"),
    "llmc-fp8-block": ("QuantizationModifier", "FP8_BLOCK"),
    "llmc-nvfp4a16": ("QuantizationModifier", "NVFP4A16"),
    "llmc-gptq-nvfp4a16": ("GPTQModifier", "NVFP4A16"),
    "llmc-mxfp4a16": ("QuantizationModifier", "MXFP4A16"),
    "llmc-gptq-mxfp4a16": ("GPTQModifier", "MXFP4A16"),
    "llmc-nvfp4": ("QuantizationModifier", "NVFP4"),  # W4A4
    "llmc-gptq-nvfp4": ("GPTQModifier", "NVFP4"),
}
OURS = ["fp8-dynamic", "gptq-fp8-dynamic", "fp8-block-dynamic", "rtn-nvfp4", "gptq-nvfp4", "rotate-gptq-nvfp4"]
OURS += ["rtn-mxfp4", "gptq-mxfp4", "fp8-kv", "fp8-dynamic-kv", "fp8-static", "gptq-fp8-static"]
OURS += ["nvfp4-w4a4", "gptq-nvfp4-w4a4", "rotate-gptq-nvfp4-w4a4"]
SAME_BITS = {  # a peer row's format is the one of this recipe of ours
    "llmc-fp8-dynamic": "fp8-dynamic",
    "llmc-fp8-block": "fp8-block-dynamic",
    "llmc-nvfp4a16": "rtn-nvfp4",
    "llmc-gptq-nvfp4a16": "rtn-nvfp4",
    "llmc-mxfp4a16": "rtn-mxfp4",
    "llmc-gptq-mxfp4a16": "rtn-mxfp4",
    "llmc-nvfp4": "nvfp4-w4a4",
    "llmc-gptq-nvfp4": "nvfp4-w4a4",
}


class _Judges:
    """Loss vs FP32 (not for the real model: its perplexity windows cost minutes) and next-token KL."""

    def __init__(self, loaded, name: str):
        from qcompiler.evaluation.quality import QualityJudge

        real = name == REAL
        self.judge = None if real else QualityJudge(loaded)
        self.fp = None if real else self.judge.score(loaded.model)
        self.generation = (
            GenerationJudge(loaded, prompts=0, windows=8 if real else 32) if loaded.kind == "causal-lm" else None
        )

    def row(self, model) -> dict:
        row = {}
        if self.judge is not None:
            row["loss"] = self.judge.loss(self.fp, self.judge.score(model))
        if self.generation is not None:
            row["next_token_kl"] = self.generation.kl(model)
        return row


def _calibration(loaded, name: str, calib: int):
    return loaded.calibration(8 if name == REAL else calib, 256 if loaded.kind == "causal-lm" else 128)


def worker(name: str, peer: str, calib: int) -> dict:
    """One llm-compressor row, in its venv."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from peers_quality import _processor, calibration_rows

    loaded = load_model(name)
    judges = _Judges(loaded, name)
    rows = calibration_rows(_calibration(loaded, name, calib))
    modifier_name, preset = PEERS[peer]
    ignore = ["lm_head"] if loaded.kind == "causal-lm" else ["pooler.dense"]
    modifier = (
        GPTQModifier(targets="Linear", scheme=preset, ignore=ignore, dampening_frac=0.01)
        if modifier_name == "GPTQModifier"
        else QuantizationModifier(targets="Linear", scheme=preset, ignore=ignore)
    )
    extra = {"processor": _processor(loaded)}
    if loaded.kind != "causal-lm":
        extra["sequential_targets"] = ["BertLayer"]
    start = time.perf_counter()
    oneshot(
        model=loaded.model,
        dataset=Dataset.from_dict(rows),
        recipe=modifier,
        max_seq_length=256 if loaded.kind == "causal-lm" else 128,
        num_calibration_samples=len(rows["input_ids"]),
        pipeline="sequential",
        **extra,
    )
    seconds = time.perf_counter() - start
    loaded.model.eval()
    return dict(model=name, recipe=peer, tool="llm-compressor 0.14", quant_seconds=seconds, **judges.row(loaded.model))


def ours(name: str, recipes: list[str], calib: int) -> list[dict]:
    import qcompiler as qc
    from qcompiler.evaluation.eval import bits_per_parameter
    from qcompiler.ir.model_size import model_size

    loaded = load_model(name)
    judges = _Judges(loaded, name)
    calibration = _calibration(loaded, name, calib)
    rows = []
    for recipe in recipes:
        if recipe.endswith("-kv") and loaded.kind != "causal-lm":
            continue  # an encoder keeps no KV cache
        torch.manual_seed(0)
        start = time.perf_counter()
        try:
            cm = qc.compile(
                loaded.model, loaded.example_inputs(), recipe=recipe, calibration=calibration, progress=False
            )
        except qc.QuantizationError as e:  # a width the format cannot hold: the row says so
            rows.append(dict(model=name, recipe=recipe, failed=str(e)[:300]))
            print(f"{name:12s} {recipe:20s} FAILED: {e}", file=sys.stderr, flush=True)
            continue
        row = dict(model=name, recipe=recipe, tool="qcompiler", quant_seconds=time.perf_counter() - start)
        size = model_size(cm.graph_module)
        row["bits_per_parameter"] = bits_per_parameter(cm.graph_module) if size.quantized_parameters else None
        row["bits_all_parameters"] = size.bits_per_parameter
        row.update(judges.row(cm))
        rows.append(row)
        _log(row)
    return rows


def _log(row: dict) -> None:
    bits = row.get("bits_per_parameter") or float("nan")
    print(
        f"{row['model']:12s} {row['recipe']:20s} {bits:.3f} bits  loss {row.get('loss', float('nan')):.5f}  "
        f"KL {row.get('next_token_kl', float('nan')):.4f}  {row['quant_seconds']:.1f}s",
        file=sys.stderr,
        flush=True,
    )


def _peer_rows(python: str, name: str, peers: list[str], calib: int, ours_rows: list[dict]) -> list[dict]:
    bits = {r["recipe"]: (r.get("bits_per_parameter"), r.get("bits_all_parameters")) for r in ours_rows}
    rows = []
    for peer in peers:
        row, reason = worker_row(python, __file__, [name, peer, "--calib", str(calib)])
        if row is None:
            rows.append(dict(model=name, recipe=peer, tool="llm-compressor 0.14", failed=reason))
            print(f"{name:12s} {peer:20s} FAILED: {reason}", file=sys.stderr, flush=True)
            continue
        row["bits_per_parameter"], row["bits_all_parameters"] = bits.get(SAME_BITS[peer], (None, None))
        rows.append(row)
        _log(row)
    return rows


# bars of the plot: (label, our recipe or peer, per format)
_BARS = (
    ("llm-compressor RTN", {"NVFP4": "llmc-nvfp4a16", "MXFP4": "llmc-mxfp4a16", "FP8": "llmc-fp8-dynamic"}),
    ("qcompiler RTN", {"NVFP4": "rtn-nvfp4", "MXFP4": "rtn-mxfp4", "FP8": "fp8-dynamic"}),
    ("llm-compressor GPTQ", {"NVFP4": "llmc-gptq-nvfp4a16", "MXFP4": "llmc-gptq-mxfp4a16"}),
    ("qcompiler GPTQ", {"NVFP4": "gptq-nvfp4", "MXFP4": "gptq-mxfp4", "FP8": "gptq-fp8-dynamic"}),
    ("qcompiler rotate + GPTQ", {"NVFP4": "rotate-gptq-nvfp4"}),
)


def plot(rows: list[dict], out) -> None:
    """One panel per model: each format's loss (LMs: next-token KL) by tool and method, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r["model"], r["recipe"]): r for r in rows if "failed" not in r}
    names = [m for m in ("minilm", "longlm", REAL) if any(k[0] == m for k in by)]
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    formats = ("FP8", "NVFP4", "MXFP4")
    for ax, name in zip(axes[0], names):
        key = "loss" if name == "minilm" else "next_token_kl"
        width = 0.8 / len(_BARS)
        for i, (label, recipes) in enumerate(_BARS):
            xs, ys = [], []
            for j, fmt in enumerate(formats):
                row = by.get((name, recipes.get(fmt, "")))
                if row is not None and row.get(key) is not None:
                    xs.append(j + (i - len(_BARS) / 2 + 0.5) * width)
                    ys.append(row[key])
            ax.bar(xs, ys, width, label=label)
        ax.set_xticks(range(len(formats)), formats)
        ax.set_yscale("log")
        ax.set_ylabel("1 − cosine vs FP32" if key == "loss" else "next-token KL vs FP32")
        ax.set_title(name)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llmc-python", help="python of a venv with llmcompressor 0.14 (see the docstring)")
    ap.add_argument("--models", nargs="+", default=["minilm", "longlm", REAL])
    ap.add_argument("--peers", nargs="*", default=list(PEERS))
    ap.add_argument("--recipes", nargs="*", default=OURS)
    ap.add_argument("--calib", type=int, default=128)
    ap.add_argument("--update", action="store_true", help="replace only these rows in the committed JSON")
    ap.add_argument("--quick", action="store_true", help="32 calibration samples; write under results/quick/")
    ap.add_argument("--plot", action="store_true", help="only draw docs/formats.png from the committed JSON")
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "PEER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    calib = 32 if args.quick else args.calib
    if args.plot:
        from pathlib import Path

        from results_file import results_file

        out = Path(__file__).resolve().parents[1] / "docs" / "formats.png"
        plot(json.loads(results_file("formats").read_text())["rows"], out)
        print("wrote", out)
        return
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker[0], args.worker[1], calib)), flush=True)
        return
    if args.peers and not args.llmc_python:
        ap.error("the llm-compressor rows need --llmc-python (its own venv, see the docstring), or --peers with none")
    rows = []
    for name in args.models:
        mine = ours(name, args.recipes, calib)
        rows += mine + _peer_rows(args.llmc_python, name, args.peers, calib, mine) if args.peers else mine
    if args.update:
        rows = merged_rows("formats", rows)
    write_rows("formats", rows, args.quick, calibration=calib)
    print("| model | tool | recipe | bits / quantized weight | bits / parameter (all) | loss vs FP32 | next-token KL |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['model']} | {r.get('tool', '')} | {r['recipe']} | - | - | failed: {r['failed']} | - |")
            continue
        loss = f"{r['loss']:.5f}" if "loss" in r else "-"
        kl = f"{r['next_token_kl']:.4f}" if "next_token_kl" in r else "-"
        bits = f"{r['bits_per_parameter']:.3f}" if r.get("bits_per_parameter") else "-"
        every = f"{r['bits_all_parameters']:.2f}" if r.get("bits_all_parameters") else "-"
        print(f"| {r['model']} | {r['tool']} | {r['recipe']} | {bits} | {every} | {loss} | {kl} |")


if __name__ == "__main__":
    main()
