"""Whole-model GPTQ, qcompiler vs llm-compressor, side by side on the same model, data and threads.

    python benchmarks/vs_llmcompressor.py --llmc-python /path/to/venv/bin/python
    python benchmarks/vs_llmcompressor.py --llmc-python ... --quick      # tiny model (checks the script)

llm-compressor pins its own transformers / compressed-tensors, so it lives in its own venv
(``python -m venv --system-site-packages V && V/bin/pip install llmcompressor==0.14.0``; the
system torch is shared). Both sides quantize one randomly initialized LLaMA folder with the
same settings — W4, group 128, symmetric, static activation order (llm-compressor's ``W4A16``
default), damping 0.01 — from the same calibration token windows, each in a fresh process with
the same thread count. Timed: the quantization call (qcompiler's ``qc.compile``, llm-compressor's
``oneshot``), not the model load; peak RSS: the process's high-water mark when that call returns
(model load included, the quality check after it not). Runs alternate (ours, theirs, ours, ...) so machine noise hits
both; the table gives each run and the ratio of the medians. Quality check: relative logits error
of the quantized model on held-out token windows, which should be about equal on both sides.
Writes benchmarks/results/vs_llmcompressor.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from results_file import results_file

SIZES = {
    "default": dict(hidden=1024, ffn=2816, layers=4, vocab=32000, nsamples=8, seqlen=512),
    "quick": dict(hidden=128, ffn=384, layers=2, vocab=1000, nsamples=4, seqlen=64),
}


def make_model(folder: Path, size: dict) -> None:
    """A random LLaMA folder with a word-level tokenizer (llm-compressor requires a processor)."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=size["hidden"],
        intermediate_size=size["ffn"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["hidden"] // 64,
        num_key_value_heads=size["hidden"] // 64,
        vocab_size=size["vocab"],
        max_position_embeddings=2048,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(size["vocab"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0").save_pretrained(folder)


def _tokens(size: dict, seed: int, n: int):
    import torch

    return torch.randint(0, size["vocab"], (n, size["seqlen"]), generator=torch.Generator().manual_seed(seed))


def worker(side: str, folder: str, size: dict, threads: int) -> dict:
    """One side's run in this process: time of the quantization call, peak RSS, logits error."""
    import time

    import torch
    from peak_memory import peak_rss_mb

    torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    calib, held = _tokens(size, 0, size["nsamples"]), _tokens(size, 1, 1)[:, :128]  # small: the peak is the run's
    with torch.no_grad():
        reference = model(input_ids=held, use_cache=False).logits
    if side == "qcompiler":
        import qcompiler as qc

        recipe = [qc.passes.GPTQ(bits=4, group_size=128, sym=True, act_order=True, static_groups=True, damp=0.01)]
        start = time.perf_counter()
        cm = qc.compile(
            model,
            {"input_ids": calib[:1, :16]},
            recipe=recipe,
            calibration=[{"input_ids": calib[i : i + 1]} for i in range(len(calib))],
            progress=False,
        )
        seconds, peak = time.perf_counter() - start, peak_rss_mb()
        quantized = lambda ids: cm(input_ids=ids).logits  # noqa: E731
    else:
        from datasets import Dataset
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import GPTQModifier

        data = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})
        start = time.perf_counter()
        oneshot(
            model=model,
            dataset=data,
            recipe=GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"], dampening_frac=0.01),
            max_seq_length=size["seqlen"],
            num_calibration_samples=size["nsamples"],
            pipeline="sequential",
        )
        seconds, peak = time.perf_counter() - start, peak_rss_mb()
        quantized = lambda ids: model(input_ids=ids, use_cache=False).logits  # noqa: E731
    with torch.no_grad():
        error = ((quantized(held) - reference).norm() / reference.norm()).item()
    return {"side": side, "seconds": seconds, "peak_rss_MB": peak, "logits_rel_error": error}


def run_side(python: str, side: str, folder: Path, size: dict, threads: int) -> dict:
    argv = [
        python,
        __file__,
        "--worker",
        side,
        "--folder",
        str(folder),
        "--size",
        json.dumps(size),
        "--threads",
        str(threads),
    ]
    done = subprocess.run(argv, capture_output=True, text=True)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    if done.returncode or line is None:
        sys.exit(f"{side} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llmc-python", help="python of a venv with llmcompressor 0.14 installed")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, help="default: results/vs_llmcompressor.json (results/quick/ with --quick)")
    ap.add_argument("--worker", choices=["qcompiler", "llm-compressor"], help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--size", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out = args.out or results_file("vs_llmcompressor", args.quick)
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.folder, json.loads(args.size), args.threads)))
        return
    if not args.llmc_python:
        ap.error("--llmc-python is required (llm-compressor needs its own venv, see the docstring)")
    size = SIZES["quick" if args.quick else "default"]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        make_model(folder, size)
        for rep in range(args.repeats):
            for side, python in (("qcompiler", sys.executable), ("llm-compressor", args.llmc_python)):
                runs.append({**run_side(python, side, folder, size, args.threads), "repeat": rep})
                r = runs[-1]
                print(
                    f"{side:15s} run {rep}: {r['seconds']:7.1f} s  peak RSS {r['peak_rss_MB']:6.0f} MB  "
                    f"logits error {r['logits_rel_error']:.4f}",
                    flush=True,
                )
    median = {
        side: {
            k: statistics.median(r[k] for r in runs if r["side"] == side)
            for k in ("seconds", "peak_rss_MB", "logits_rel_error")
        }
        for side in ("qcompiler", "llm-compressor")
    }
    ratio = {k: median["qcompiler"][k] / median["llm-compressor"][k] for k in ("seconds", "peak_rss_MB")}
    # each repeat ran the two sides back to back: the ratio within a pair shares the machine's mood
    pairs = [ours["seconds"] / theirs["seconds"] for ours, theirs in zip(runs[0::2], runs[1::2])]
    ratio["seconds_paired_median"] = statistics.median(pairs)
    print("\n| | qcompiler | llm-compressor 0.14 | ratio |\n|---|---|---|---|")
    print(
        f"| time (median of {args.repeats}), s | {median['qcompiler']['seconds']:.1f} | "
        f"{median['llm-compressor']['seconds']:.1f} | {ratio['seconds']:.2f} |"
    )
    print(
        f"| time, median of the {len(pairs)} back-to-back pair ratios | | | {ratio['seconds_paired_median']:.2f} "
        f"(range {min(pairs):.2f}–{max(pairs):.2f}) |"
    )
    print(
        f"| peak RSS, MB | {median['qcompiler']['peak_rss_MB']:.0f} | {median['llm-compressor']['peak_rss_MB']:.0f} "
        f"| {ratio['peak_rss_MB']:.2f} |"
    )
    print(
        f"| logits rel. error | {median['qcompiler']['logits_rel_error']:.4f} | "
        f"{median['llm-compressor']['logits_rel_error']:.4f} | |"
    )
    from qcompiler.files.atomic import write_text_atomically

    write_text_atomically(
        args.out,
        json.dumps(
            {
                "size": size,
                "threads": args.threads,
                "runs": runs,
                "median": median,
                "ratio": ratio,
                "paired_ratios": pairs,
            },
            indent=2,
        ),
    )


if __name__ == "__main__":
    main()
