"""Quality at equal bits, side by side with llm-compressor 0.14 (GPTQ, AWQ) and AutoRound 0.16
(SignRound), on the bundled models.

    python benchmarks/peers_quality.py --llmc-python L/bin/python --ar-python A/bin/python      (~40 min)
    python benchmarks/peers_quality.py --ar-python A/bin/python --peers autoround-w4g128 --recipes --update

Each peer lives in its own venv that sees the system torch and this checkout's qcompiler
(``python -m venv --system-site-packages V``; llm-compressor: ``V/bin/pip install
llmcompressor==0.14.0``; AutoRound: ``V/bin/pip install --no-deps auto-round accelerate py-cpuinfo
&& V/bin/pip install datasets`` — its declared requirements would move torch). Each peer row runs in a
child process of that venv: the same bundled model, the same calibration windows / sentences
(``loaded.calibration``: 128 x 256 tokens for the LM, 128 sentences for MiniLM), then the same
judges as benchmarks/frontier.py (held-out loss; for the LM greedy agreement over 128 tokens from
32 prompts and next-token KL). llm-compressor runs ``oneshot`` with its sequential pipeline;
AutoRound its default SignRound (200 iterations of signed-gradient rounding and clipping per
block, learning rate 1/iters; MiniLM's sentences padded to 128 tokens, as it takes fixed-length
samples). Bits per parameter of a peer row are its storage at the convention qcompiler counts by
(codes + 16-bit scales + zero points per group), i.e. equal to the qcompiler row it is set beside.
Writes benchmarks/results/peers_quality.json (``--update``: replaces only the rows run); docs/results.md
quotes it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
from results_file import merged_rows, write_rows

PEERS = {
    # name: (tool, method, bits, group size); asymmetric like qcompiler's recipes
    "llmc-gptq-w4g128": ("llmc", "GPTQ", 4, 128),
    "llmc-gptq-w3g128": ("llmc", "GPTQ", 3, 128),
    "llmc-awq-w4g128": ("llmc", "AWQ", 4, 128),
    "llmc-awq-w3g128": ("llmc", "AWQ", 3, 128),
    "autoround-w4g128": ("autoround", "SignRound", 4, 128),
    "autoround-w3g128": ("autoround", "SignRound", 3, 128),
}
TOOLS = {"llmc": "llm-compressor", "autoround": "AutoRound"}
OURS = ["gptq-w4g128", "gptq-w3g128", "rotate-gptq-w4g128", "rotate-gptq-w3g128"]
OURS += ["auto:4.16", "auto:3.25", "rotate-auto:4.16", "rotate-auto:3.25"]


def _bits(bits: int, group: int) -> float:
    return bits + (16 + bits) / group


def worker(model_name: str, peer: str, calib: int) -> dict:
    """One peer row, in that peer's venv."""
    from frontier import GenerationJudge

    from qcompiler import models
    from qcompiler.evaluation.quality import QualityJudge

    loaded = models.load(model_name)
    judge = QualityJudge(loaded)
    fp = judge.score(loaded.model)
    generation = GenerationJudge(loaded) if loaded.kind == "causal-lm" else None
    seqlen = 256 if loaded.kind == "causal-lm" else 128
    batches = loaded.calibration(calib, seqlen)
    tool, method, bits, group = PEERS[peer]
    start = time.perf_counter()
    model = (_llmc if tool == "llmc" else _autoround)(loaded, batches, method, bits, group, seqlen)
    seconds = time.perf_counter() - start
    model.eval()
    value = judge.score(model)
    row = dict(
        model=model_name,
        recipe=peer,
        family=f"{TOOLS[tool]} {method}",
        metric=judge.metric,
        value=value,
        loss=judge.loss(fp, value),
        bits_per_parameter=_bits(bits, group),
        quant_seconds=seconds,
    )
    if generation is not None:
        row.update(generation.score(_HFModel(model)))
    return row


def calibration_rows(batches) -> dict[str, list]:
    """Calibration batches as the columns of a ``datasets.Dataset`` for ``oneshot``: one row per
    sample, its padding removed."""
    rows = {"input_ids": [], "attention_mask": []}
    for batch in batches:
        ids = batch["input_ids"]
        mask = batch.get("attention_mask", torch.ones_like(ids))
        for i in range(ids.shape[0]):
            keep = mask[i].bool()
            rows["input_ids"].append(ids[i][keep].tolist())
            rows["attention_mask"].append([1] * int(keep.sum()))
    return rows


def worker_row(python: str, script: str, args: list[str]) -> tuple[dict | None, str]:
    """``script --worker ARGS`` run by a peer venv's ``python``: the row it printed after ``RESULT``,
    or None and the last line of its stderr."""
    done = subprocess.run([python, script, "--worker", *args], capture_output=True, text=True)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode or line is None:
        return None, (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return json.loads(line[len("RESULT ") :]), ""


def _llmc(loaded, batches, method: str, bits: int, group: int, seqlen: int):
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.quantization import GPTQModifier

    rows = calibration_rows(batches)
    scheme = {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": bits, "type": "int", "symmetric": False, "strategy": "group", "group_size": group},
        }
    }
    ignore = ["lm_head"] if loaded.kind == "causal-lm" else ["pooler.dense"]
    modifier = (
        GPTQModifier(config_groups=scheme, ignore=ignore, dampening_frac=0.01)
        if method == "GPTQ"
        else AWQModifier(config_groups=scheme, ignore=ignore)
    )
    extra = {"processor": _processor(loaded)}
    if loaded.kind != "causal-lm":
        extra["sequential_targets"] = ["BertLayer"]
    oneshot(
        model=loaded.model,
        dataset=Dataset.from_dict(rows),
        recipe=modifier,
        max_seq_length=seqlen,
        num_calibration_samples=len(rows["input_ids"]),
        pipeline="sequential",
        **extra,
    )
    return loaded.model


def _autoround(loaded, batches, method: str, bits: int, group: int, seqlen: int):
    """AutoRound's defaults (SignRound, 200 iterations); its result is the model with fake-quantized
    weights, which the judges run as is. Samples are fixed-length: sentences padded to ``seqlen``."""
    from auto_round import AutoRound
    from torch.utils.data import DataLoader

    samples = []
    for batch in batches:
        ids = batch["input_ids"]
        mask = batch.get("attention_mask", torch.ones_like(ids))
        pad = seqlen - ids.shape[1]
        ids, mask = torch.nn.functional.pad(ids, (0, pad)), torch.nn.functional.pad(mask, (0, pad))
        samples += [{"input_ids": ids[i], "attention_mask": mask[i]} for i in range(ids.shape[0])]
    rounder = AutoRound(
        loaded.model,
        tokenizer=_processor(loaded),
        scheme={"bits": bits, "group_size": group, "sym": False, "data_type": "int", "act_bits": 16},
        dataset=DataLoader(samples, batch_size=8),
        nsamples=len(samples),
        seqlen=seqlen,
        batch_size=8,
        device_map="cpu",
        enable_torch_compile=False,
    )
    model, _ = rounder.quantize()
    return model


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
    ap.add_argument("--llmc-python", help="python of a venv with llmcompressor 0.14")
    ap.add_argument("--ar-python", help="python of a venv with auto-round 0.16")
    ap.add_argument("--models", nargs="+", default=["tinylm", "minilm"])
    ap.add_argument("--peers", nargs="*", default=list(PEERS))
    ap.add_argument("--recipes", nargs="*", default=OURS)
    ap.add_argument("--calib", type=int, default=128)
    ap.add_argument("--update", action="store_true", help="replace only these rows in the committed JSON")
    ap.add_argument("--quick", action="store_true", help="write under results/quick/")
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "PEER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker[0], args.worker[1], args.calib)), flush=True)
        return
    pythons = {"llmc": args.llmc_python, "autoround": args.ar_python}
    for peer in args.peers:
        if not pythons[PEERS[peer][0]]:
            ap.error(
                f"{peer} needs --{PEERS[peer][0].replace('autoround', 'ar')}-python (its own venv, see the docstring)"
            )
    rows = []
    for name in args.models:
        for peer in args.peers:
            row, reason = worker_row(pythons[PEERS[peer][0]], __file__, [name, peer, "--calib", str(args.calib)])
            if row is None:
                rows.append(dict(model=name, recipe=peer, failed=reason))
                print(f"{name:7s} {peer:18s} FAILED: {reason}", file=sys.stderr, flush=True)
                continue
            rows.append(row)
            print(f"{name:7s} {peer:18s} loss {rows[-1]['loss']:.5f}", file=sys.stderr, flush=True)
        if args.recipes:
            rows += ours(name, args.recipes, args.calib)
    if args.update:
        rows = merged_rows("peers_quality", rows)
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
