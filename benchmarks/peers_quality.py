"""Quality at equal bits, side by side with llm-compressor 0.14 (GPTQ and AWQ), on the bundled models.

    python benchmarks/peers_quality.py --llmc-python /path/to/venv/bin/python          (~25 min)
    python benchmarks/peers_quality.py --llmc-python ... --models tinylm --recipes gptq-w4g128

llm-compressor lives in its own venv (``python -m venv --system-site-packages V && V/bin/pip install
llmcompressor==0.14.0``; it sees the system torch and this checkout's qcompiler). Each peer row runs
in a child process of that venv: the same bundled model, the same calibration windows / sentences
(``loaded.calibration``), llm-compressor's ``oneshot`` with its sequential pipeline, then the same
judges as benchmarks/frontier.py (held-out loss; for the LM greedy agreement over 128 tokens from
32 prompts and next-token KL). Bits per parameter of a peer row are its storage at the convention
qcompiler counts by (codes + 16-bit scales + zero points per group), i.e. equal to the qcompiler row
it is set beside. Writes benchmarks/results/peers_quality.json; docs/results.md quotes it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
from results_file import write_rows

PEERS = {
    # name: (modifier, bits, group size); asymmetric like qcompiler's recipes
    "llmc-gptq-w4g128": ("GPTQ", 4, 128),
    "llmc-gptq-w3g128": ("GPTQ", 3, 128),
    "llmc-awq-w4g128": ("AWQ", 4, 128),
    "llmc-awq-w3g128": ("AWQ", 3, 128),
}


def _bits(bits: int, group: int) -> float:
    return bits + (16 + bits) / group


def worker(model_name: str, peer: str, calib: int) -> dict:
    """One llm-compressor row, in the llm-compressor venv."""
    from datasets import Dataset
    from frontier import GenerationJudge
    from llmcompressor import oneshot
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.quantization import GPTQModifier

    from qcompiler import models
    from qcompiler.evaluation.quality import QualityJudge

    loaded = models.load(model_name)
    judge = QualityJudge(loaded)
    fp = judge.score(loaded.model)
    generation = GenerationJudge(loaded) if loaded.kind == "causal-lm" else None
    batches = loaded.calibration(calib, 256 if loaded.kind == "causal-lm" else 128)
    rows = {"input_ids": [], "attention_mask": []}
    for batch in batches:
        ids = batch["input_ids"]
        mask = batch.get("attention_mask", torch.ones_like(ids))
        for i in range(ids.shape[0]):
            keep = mask[i].bool()
            rows["input_ids"].append(ids[i][keep].tolist())
            rows["attention_mask"].append([1] * int(keep.sum()))
    kind, bits, group = PEERS[peer]
    scheme = {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": bits, "type": "int", "symmetric": False, "strategy": "group", "group_size": group},
        }
    }
    ignore = ["lm_head"] if loaded.kind == "causal-lm" else ["pooler.dense"]
    modifier = (
        GPTQModifier(config_groups=scheme, ignore=ignore, dampening_frac=0.01)
        if kind == "GPTQ"
        else AWQModifier(config_groups=scheme, ignore=ignore)
    )
    start = time.perf_counter()
    extra = {"processor": _processor(loaded)}
    if loaded.kind != "causal-lm":
        extra["sequential_targets"] = ["BertLayer"]
    oneshot(
        model=loaded.model,
        dataset=Dataset.from_dict(rows),
        recipe=modifier,
        max_seq_length=256,
        num_calibration_samples=len(rows["input_ids"]),
        pipeline="sequential",
        **extra,
    )
    seconds = time.perf_counter() - start
    loaded.model.eval()
    value = judge.score(loaded.model)
    row = dict(
        model=model_name,
        recipe=peer,
        family=f"llm-compressor {kind}",
        metric=judge.metric,
        value=value,
        loss=judge.loss(fp, value),
        bits_per_parameter=_bits(bits, group),
        quant_seconds=seconds,
    )
    if generation is not None:
        row.update(generation.score(_HFModel(loaded.model)))
    return row


def _processor(loaded):
    """A transformers tokenizer for oneshot (it wants one; the data is already token ids)."""
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    if isinstance(loaded.tokenizer, PreTrainedTokenizerBase):
        return loaded.tokenizer
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(loaded.model.config.vocab_size)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), unk_token="t0", pad_token="t0"
    )


class _HFModel:
    """What GenerationJudge calls, on a plain transformers model."""

    def __init__(self, model):
        self.model = model

    def __call__(self, **kwargs):
        with torch.no_grad():
            return self.model(**kwargs, use_cache=False)

    def generate(self, ids, max_new_tokens):
        with torch.no_grad():
            return self.model.generate(
                ids, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens
            )


def ours(model_name: str, recipes: list, calib: int) -> list[dict]:
    """qcompiler's rows (this process), with the FP references computed once."""
    from frontier import run

    return run([model_name], recipes, [], calib)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llmc-python", required=False, help="python of a venv with llmcompressor 0.14")
    ap.add_argument("--models", nargs="+", default=["tinylm", "minilm"])
    ap.add_argument("--peers", nargs="*", default=list(PEERS))
    ap.add_argument("--recipes", nargs="*", default=["gptq-w4g128", "gptq-w3g128", "auto:4.16", "auto:3.25"])
    ap.add_argument("--calib", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="write under results/quick/")
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "PEER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker[0], args.worker[1], args.calib)), flush=True)
        return
    if not args.llmc_python:
        ap.error("--llmc-python is required (llm-compressor needs its own venv, see the docstring)")
    rows = []
    for name in args.models:
        for peer in args.peers:
            done = subprocess.run(
                [args.llmc_python, __file__, "--worker", name, peer, "--calib", str(args.calib)],
                capture_output=True,
                text=True,
            )
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if done.returncode or line is None:
                reason = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
                rows.append(dict(model=name, recipe=peer, failed=reason))
                print(f"{name:7s} {peer:18s} FAILED: {reason}", file=sys.stderr, flush=True)
                continue
            rows.append(json.loads(line[len("RESULT ") :]))
            print(f"{name:7s} {peer:18s} loss {rows[-1]['loss']:.5f}", file=sys.stderr, flush=True)
        rows += ours(name, args.recipes, args.calib)

    write_rows("peers_quality", rows, args.quick, calibration=args.calib)
    print("| model | tool / recipe | bits/param | loss vs FP32 | greedy agreement | next-token KL |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['model']} | {r['recipe']} | - | failed: {r['failed']} | - | - |")
            continue
        greedy = f"{r['greedy_agreement']:.1f}" if "greedy_agreement" in r else "-"
        kl = f"{r['next_token_kl']:.4f}" if "next_token_kl" in r else "-"
        print(f"| {r['model']} | {r['recipe']} | {r['bits_per_parameter']:.3f} | {r['loss']:.5f} | {greedy} | {kl} |")


if __name__ == "__main__":
    main()
