"""Quality against size: every uniform recipe and automatic mixed precision at several budgets.

    python benchmarks/frontier.py                          # MiniLM, tinylm and longlm (~100 min on 2 cores)
    python benchmarks/frontier.py --models minilm --budgets 3.25 4.16 --recipes gptq-w4g128 --quick
    python benchmarks/frontier.py --recipes rotate-gptq-w4g128 --budgets --rotated-budgets 4.16 --signround-budgets --update

Per model, same calibration for every row: loss vs FP32 (1 − cosine on MiniLM's held-out sentences;
relative perplexity increase on tinylm's held-out modules) at the bits per parameter counted from the
stored tensors. Causal LMs also get quality through generation: greedy agreement with the FP model
over 128 new tokens from 32 held-out prompts (mean leading tokens equal) and the mean next-token KL
on held-out windows. Prints a table, writes benchmarks/results/frontier.json and draws
docs/frontier.png (MiniLM's loss and the LM's next-token KL vs bits per parameter, log scale).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from results_file import merged_rows, results_file, write_rows

import qcompiler as qc
from qcompiler import models
from qcompiler.evaluation.eval import bits_per_parameter
from qcompiler.evaluation.quality import QualityJudge

UNIFORM = [
    "rtn-w4g128",
    "rtn-w3g128",
    "awq-w4g128",
    "awq-w3g128",
    "gptq-w4g128-plain",
    "gptq-w3g128-plain",
    "gptq-w4g128",
    "gptq-w3g128",
    "gptq-w2g128",
    "spqr-w3g16",
    "spqr-w4g16",
    "rotate-rtn-w4g128",
    "rotate-gptq-w4g128",
    "rotate-gptq-w3g128",
    "signround-w4g128",
    "signround-w3g128",
    "rotate-signround-w4g128",
    "rotate-signround-w3g128",
    "w8a8-smoothquant",
    "rotate-w8a8",
]
BUDGETS = [2.5, 3.0, 3.25, 3.5, 4.0, 4.16, 4.5]
ROTATED_BUDGETS = [3.25, 4.16]  # rotate-auto:B
SIGNROUND_BUDGETS = [3.25, 4.16]  # auto-signround:B and rotate-auto-signround:B
PLOT = Path(__file__).resolve().parents[1] / "docs" / "frontier.png"


def _family(recipe: str) -> str:
    if recipe.startswith("auto:"):
        return "auto (mixed precision)"
    if recipe.startswith("auto-signround:"):
        return "auto + SignRound"
    if recipe.startswith("rotate-auto:"):
        return "rotate + auto"
    if recipe.endswith("-plain"):
        return "GPTQ, 2022 settings"
    if "w8a8" in recipe:
        return "W8A8" + (" (rotated)" if recipe.startswith("rotate") else "")
    if recipe.startswith("rotate-"):
        return "rotate + " + _family(recipe[len("rotate-") :])
    return {"rtn": "RTN", "awq": "AWQ + RTN", "gptq": "GPTQ (defaults)", "spqr": "SpQR", "signround": "SignRound"}[
        recipe.split("-")[0]
    ]


class GenerationJudge:
    """Greedy agreement and next-token KL of a causal LM against its FP model (``prompts=0``: KL only)."""

    def __init__(self, loaded, prompts: int = 32, prompt_len: int = 64, new_tokens: int = 128, windows: int = 32):
        tokens = loaded.tokens("heldout")
        step = max(1, (len(tokens) - prompt_len) // max(prompts, 1))
        self.prompts = (
            torch.stack([tokens[i * step : i * step + prompt_len] for i in range(prompts)]) if prompts else None
        )
        self.windows = torch.stack([tokens[i * 256 + 7 : i * 256 + 263] for i in range(windows)])
        bos = getattr(loaded.tokenizer, "bos_token_id", None)
        if bos is not None:  # a model trained with BOS first (Gemma) is judged as it is used
            self.windows[:, 0] = bos
        self.new_tokens = new_tokens
        fp = qc.compile(loaded.model, loaded.example_inputs(), recipe="none", progress=False)
        if prompts:
            self.fp_tokens = fp.generate(self.prompts, max_new_tokens=new_tokens)[:, prompt_len:]
        with torch.no_grad():
            self.fp_logp = F.log_softmax(fp(input_ids=self.windows).logits.float(), dim=-1)

    def kl(self, cm) -> float:
        """Mean next-token KL(FP ‖ cm) over the held-out windows."""
        with torch.no_grad():
            logq = F.log_softmax(cm(input_ids=self.windows).logits.float(), dim=-1)
        return float((self.fp_logp.exp() * (self.fp_logp - logq)).sum(-1).mean())

    def score(self, cm) -> dict:
        got = cm.generate(self.prompts, max_new_tokens=self.new_tokens)[:, self.prompts.shape[1] :]
        same = (got == self.fp_tokens).int().cumprod(dim=1).sum(dim=1).float()
        return dict(greedy_agreement=float(same.mean()), next_token_kl=self.kl(cm))


def run(model_names, recipes, budgets, calib: int, rotated_budgets=(), signround_budgets=()) -> list[dict]:
    rows = []
    for name in model_names:
        loaded = models.load(name)
        judge = QualityJudge(loaded)
        calibration = loaded.calibration(calib, 256 if loaded.kind == "causal-lm" else 128)
        fp32 = judge.score(loaded.model)
        generation = GenerationJudge(loaded) if loaded.kind == "causal-lm" else None
        autos = [f"auto:{b:g}" for b in budgets] + [f"rotate-auto:{b:g}" for b in rotated_budgets]
        autos += [f"{rot}auto-signround:{b:g}" for b in signround_budgets for rot in ("", "rotate-")]
        for recipe in list(recipes) + autos:
            torch.manual_seed(0)
            start = time.perf_counter()
            cm = qc.compile(
                loaded.model, loaded.example_inputs(), recipe=recipe, calibration=calibration, progress=False
            )
            seconds = time.perf_counter() - start
            value = judge.score(cm)
            row = dict(
                model=name,
                recipe=recipe,
                family=_family(recipe),
                metric=judge.metric,
                value=value,
                loss=judge.loss(fp32, value),
                bits_per_parameter=bits_per_parameter(cm.graph_module),
                quant_seconds=seconds,
            )
            if generation is not None:
                row.update(generation.score(cm))
            rows.append(row)
            extra = (
                f"  greedy {row['greedy_agreement']:.1f}  KL {row['next_token_kl']:.4f}"
                if generation is not None
                else ""
            )
            print(
                f"{name:7s} {recipe:18s} {row['bits_per_parameter']:.3f} bits  loss {row['loss']:.5f}{extra}  "
                f"{seconds:.0f}s",
                file=sys.stderr,
                flush=True,
            )
    return rows


def print_table(rows: list[dict]) -> None:
    print("| model | recipe | bits/param | loss vs FP32 | greedy agreement (of 128) | next-token KL | quantize s |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["model"], r["bits_per_parameter"], r["loss"])):
        greedy = f"{r['greedy_agreement']:.1f}" if "greedy_agreement" in r else "-"
        kl = f"{r['next_token_kl']:.4f}" if "next_token_kl" in r else "-"
        print(
            f"| {r['model']} | {r['recipe']} | {r['bits_per_parameter']:.3f} | {r['loss']:.5f} | {greedy} | {kl} | "
            f"{r['quant_seconds']:.0f} |"
        )


def _base_family(family: str) -> str:
    """The family without its rotation: a rotated recipe is drawn in its base's colour."""
    base = family.removeprefix("rotate + ").replace(" (rotated)", "")
    return "auto (mixed precision)" if base == "auto" else base


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["model"] for r in rows})
    bases = sorted({_base_family(r["family"]) for r in rows})
    colors = {b: plt.get_cmap("tab10")(i % 10) for i, b in enumerate(bases)}
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.5), squeeze=False)
    for ax, name in zip(axes[0], names):
        mine = [r for r in rows if r["model"] == name]
        # LMs: next-token KL (tinylm's perplexity moves less than its noise at 4 bits and even goes negative)
        key = "next_token_kl" if "next_token_kl" in mine[0] else "loss"
        for family in sorted({r["family"] for r in mine}):
            pts = sorted((r["bits_per_parameter"], r[key]) for r in mine if r["family"] == family)
            rotated = family.startswith("rotate") or "(rotated)" in family  # same hue as its base, square
            style = ("-" if "auto" in family else "") + ("s" if rotated else "o")
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            ax.plot(xs, ys, style, color=colors[_base_family(family)], label=family, mfc="none" if rotated else None)
        ax.set_yscale("log")
        ax.set_xlabel("bits per parameter (stored tensors)")
        ax.set_ylabel("next-token KL vs FP32" if key == "next_token_kl" else "1 − cosine")
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["minilm", "tinylm", "longlm"])
    ap.add_argument("--recipes", nargs="*", default=UNIFORM)
    ap.add_argument("--budgets", nargs="*", type=float, default=BUDGETS)
    ap.add_argument("--rotated-budgets", nargs="*", type=float, default=ROTATED_BUDGETS)
    ap.add_argument("--signround-budgets", nargs="*", type=float, default=SIGNROUND_BUDGETS)
    ap.add_argument(
        "--update",
        action="store_true",
        help="replace only these (model, recipe) rows in the committed JSON, keeping the others",
    )
    ap.add_argument("--calib", type=int, default=128, help="calibration windows (tinylm) / sentences (minilm)")
    ap.add_argument("--quick", action="store_true", help="write under results/quick/ and draw no plot")
    ap.add_argument("--plot-only", action="store_true", help="redraw docs/frontier.png from the committed JSON")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads(results_file("frontier").read_text())["rows"], PLOT)
        return
    rows = run(args.models, args.recipes, args.budgets, args.calib, args.rotated_budgets, args.signround_budgets)
    if args.update:
        rows = merged_rows("frontier", rows)
    write_rows("frontier", rows, args.quick, calibration=args.calib)
    if not args.quick:
        plot(rows, PLOT)
    print_table(rows)


if __name__ == "__main__":
    main()
