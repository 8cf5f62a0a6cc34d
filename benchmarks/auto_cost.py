"""``auto:B``'s cost against uniform GPTQ from measured per-layer times, projected to 8 B and 70 B.

    python benchmarks/auto_cost.py                          # Gemma-3 270M and Llama-3 8B shapes (~6 min)
    python benchmarks/auto_cost.py --models gemma-3-270m    # the check against a measured end-to-end run

For one transformer block of each model's shapes, on random weights and Hessians of real width, it
times what each run does per layer (same process, one after the other, median of ``--repeats``):

- ``factor``: the inverse-Hessian Cholesky factor (once per Hessian: q/k/v and gate/up share one);
- ``gptq``: the GPTQ w4g128 solve of the whole layer (uniform GPTQ; also the plan's GPTQ layers);
- ``spqr``: the SpQR w4g16 solve of the whole layer (the plan's SpQR layers);
- ``score``: auto:B's measuring of the layer: the nine GPTQ candidates in one sweep and the two SpQR
  ones, each on ``score_rows`` sampled rows, plus the eleven Fisher damage products over the samples'
  positions (passes/auto_bits.py);
- ``matmul`` and ``hessian``: the block's linears on the calibration tokens, and their ``XᵀX``.

The whole runs are then sums of those (capture excluded from both), per block:
``gptq = walk + factor + gptq`` and ``auto = walk + factor + score`` (measuring, FP inputs) ``+ walk +
factor + plan`` (quantizing) plus the Fisher pass, the plan a mix of GPTQ and SpQR layers in the share Gemma-3 270M's ``auto:4.5``
chose (58 of 126 SpQR), the Fisher pass two forwards of the sensitivity samples through the blocks and
the output head. A model's shapes that are too large to solve here in reasonable time (70 B) are
extrapolated from the 8 B block's measured time per FLOP of each term, and the table says so.
Writes benchmarks/results/auto_cost.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from results_file import write_rows

from qcompiler.algorithms.gptq import hessian_factor
from qcompiler.passes.auto_bits import DEFAULT_CANDIDATES
from qcompiler.passes.gptq_candidates import solve_gptq_candidates
from qcompiler.passes.mixed_precision import candidate_quantizer
from qcompiler.pipeline.fisher_sensitivity import sample_rows
from qcompiler.pipeline.shared_factors import shared_hessian_factor

# hidden, MLP width, q width, k/v width, blocks, vocabulary; calibration tokens a user runs GPTQ with
MODELS = {
    "gemma-3-270m": dict(hidden=640, mlp=2048, q=1024, kv=256, blocks=18, vocab=262144, calib=8 * 256, seq=256),
    "llama-3-8b": dict(hidden=4096, mlp=14336, q=4096, kv=1024, blocks=32, vocab=128256, calib=128 * 2048, seq=2048),
    "llama-3-70b": dict(hidden=8192, mlp=28672, q=8192, kv=1024, blocks=80, vocab=128256, calib=128 * 2048, seq=2048),
}
SPQR_SHARE = 58 / 126  # of the plan's layers, as Gemma-3 270M's auto:4.5 chose them (docs/methods/auto.md)
SAMPLES = 8  # AutoBits.samples
SCORE_ROWS = 256  # AutoBits.score_rows


def block_layers(m: dict) -> list[tuple[str, list[tuple[int, int]]]]:
    """The block's linears as (out, in), grouped by the Hessian they share."""
    h = m["hidden"]
    return [
        ("q/k/v", [(m["q"], h), (m["kv"], h), (m["kv"], h)]),
        ("o", [(h, m["q"])]),
        ("gate/up", [(m["mlp"], h), (m["mlp"], h)]),
        ("down", [(h, m["mlp"])]),
    ]


class _Layer:
    transposed = False

    def __init__(self, path: str):
        self.path = path


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_block(m: dict, repeats: int) -> dict:
    """Seconds per term for one block of ``m``'s shapes, and each term's FLOPs (for extrapolation)."""
    gen = torch.Generator().manual_seed(0)
    positions = SAMPLES * m["seq"]
    quantizers = {name: candidate_quantizer(name) for name in DEFAULT_CANDIDATES}
    gptq, spqr = candidate_quantizer("gptq-w4g128"), candidate_quantizer("spqr-w4g16")
    t = dict.fromkeys(("factor", "gptq", "spqr", "score", "matmul", "hessian"), 0.0)
    for group, shapes in block_layers(m):
        n_in = shapes[0][1]
        X = torch.randn(4 * n_in, n_in, generator=gen) * torch.linspace(0.2, 2.0, n_in)
        H = 2 * X.t() @ X / X.shape[0]
        del X
        t["factor"] += _median(lambda: hessian_factor(H, 0.01, True), repeats)
        Xc = torch.randn(min(m["calib"], 8192), n_in, generator=gen)  # calibration rows: products and XᵀX
        t["hessian"] += _median(lambda: Xc.t() @ Xc, repeats) * m["calib"] / Xc.shape[0]
        shared_hessian_factor(H, 0.01, True)  # what the passes share across a group and the candidates
        for i, (n_out, _) in enumerate(shapes):
            layer = _Layer(f"model.layers.0.{group}.{i}")
            W = torch.randn(n_out, n_in, generator=gen) * 0.02
            t["gptq"] += _median(lambda: gptq.quantize_layer(layer, W, H), repeats)
            t["spqr"] += _median(lambda: spqr.quantize_layer(layer, W, H), repeats)
            rows = sample_rows(layer.path, n_out, 32, SCORE_ROWS)
            Ws = W if rows is None else W.index_select(0, rows)
            Xs, F = torch.randn(positions, n_in, generator=gen), torch.rand(positions, Ws.shape[0], generator=gen)

            def score():
                solved = solve_gptq_candidates(quantizers, layer, Ws, H)
                for name, q in quantizers.items():
                    result = solved.get(name)
                    if result is None:
                        result = q.quantize_layer(layer, W, H) if rows is None else q.quantize_rows(layer, W, H, rows)
                    float((F * (Xs @ (result.dequantized - Ws).t()).square()).sum())

            t["score"] += _median(score, repeats)
            t["matmul"] += _median(lambda: Xc @ W.t(), repeats) * m["calib"] / Xc.shape[0]
            print(f"  {group} {n_out}x{n_in}: " + ", ".join(f"{k} {v:.2f}s" for k, v in t.items()), file=sys.stderr)
    return dict(seconds=t, flops=block_flops(m))


def totals(m: dict, block: dict, calib: int) -> dict:
    """Whole-run seconds of uniform GPTQ and auto:B from one block's terms (capture excluded), with
    ``calib`` calibration tokens (the walk's terms scale with them; ``block`` was measured at ``m``'s)."""
    t = dict(block["seconds"])
    t["matmul"], t["hessian"] = (t[k] * calib / m["calib"] for k in ("matmul", "hessian"))
    m = dict(m, calib=calib)
    n = m["blocks"]
    walk = t["matmul"] + t["hessian"]  # one block of the calibration walk: its products and Hessians
    per_flop = block["seconds"]["matmul"] / max(block["flops"]["matmul"], 1.0)
    head = 2 * SAMPLES * m["seq"] * m["vocab"] * m["hidden"] * per_flop  # forward + backward through the head
    fisher = n * 2 * t["matmul"] * SAMPLES * m["seq"] / m["calib"] + head  # forward + backward on the samples
    plan = (1 - SPQR_SHARE) * t["gptq"] + SPQR_SHARE * t["spqr"]
    gptq = n * (walk + t["factor"] + t["gptq"])
    # the scoring walk on the calibration (FP inputs), then the plan's walk (quantized inputs)
    auto = fisher + n * (walk + t["factor"] + t["score"]) + n * (walk + t["factor"] + plan)
    # measure_on="samples": the scoring walk over the sensitivity samples only
    short = auto - n * walk * (1 - min(1.0, SAMPLES * m["seq"] / calib))
    return dict(
        gptq_seconds=gptq,
        auto_seconds=auto,
        ratio=auto / gptq,
        samples_auto_seconds=short,
        samples_ratio=short / gptq,
        fisher_seconds=fisher,
    )


def block_flops(m: dict) -> dict:
    """Each term's multiply-adds for one block of ``m``'s shapes (what extrapolation scales by)."""
    flops = dict.fromkeys(("factor", "gptq", "spqr", "score", "matmul", "hessian"), 0.0)
    positions = SAMPLES * m["seq"]
    for _group, shapes in block_layers(m):
        n_in = shapes[0][1]
        flops["factor"] += n_in**3
        flops["hessian"] += m["calib"] * n_in * n_in
        for n_out, _ in shapes:
            flops["gptq"] += n_out * n_in**2
            flops["spqr"] += n_out * n_in**2
            flops["score"] += len(DEFAULT_CANDIDATES) * min(n_out, SCORE_ROWS) * (n_in**2 + positions * n_in)
            flops["matmul"] += m["calib"] * n_out * n_in
    return flops


def extrapolated(m: dict, base: dict) -> dict:
    """``m``'s block terms from ``base``'s measured seconds per multiply-add, term by term."""
    flops = block_flops(m)
    return dict(seconds={k: base["seconds"][k] / base["flops"][k] * flops[k] for k in flops}, flops=flops)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gemma-3-270m", "llama-3-8b", "llama-3-70b"])
    ap.add_argument(
        "--measure", nargs="+", default=["gemma-3-270m", "llama-3-8b"], help="models measured, not extrapolated"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reuse", action="store_true", help="the blocks measured by the last run (its JSON), re-totalled")
    args = ap.parse_args()
    measured, rows = {}, []
    if args.reuse:
        import json

        from results_file import results_file

        for row in json.loads(results_file("auto_cost").read_text())["rows"]:
            if row["how"] == "measured":
                seconds = {k[6:-8]: v for k, v in row.items() if k.startswith("block_") and k.endswith("_seconds")}
                measured[row["model"]] = dict(seconds=seconds, flops=block_flops(MODELS[row["model"]]))
    for name in args.models:
        m = MODELS[name]
        if name in measured:
            block, how = measured[name], "measured"
        elif name in args.measure:
            print(f"{name}: measuring one block", file=sys.stderr, flush=True)
            block = measured[name] = measure_block(m, args.repeats if m["hidden"] < 4096 else 1)
            how = "measured"
        else:
            base = max(measured, key=lambda k: MODELS[k]["hidden"])
            block, how = extrapolated(m, measured[base]), f"extrapolated from {base}"
        for calib in sorted({m["calib"], min(m["calib"], SAMPLES * m["seq"])}):
            row = dict(model=name, how=how, blocks=m["blocks"], calibration_tokens=calib, **totals(m, block, calib))
            row.update({f"block_{k}_seconds": v for k, v in block["seconds"].items()})
            rows.append(row)
    print("| model | how | calibration tokens | uniform GPTQ | auto:B | ratio | measure_on=samples | of which Fisher |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['how']} | {r['calibration_tokens']:,} | {r['gptq_seconds']:.0f} s | "
            f"{r['auto_seconds']:.0f} s | {r['ratio']:.2f}x | {r['samples_ratio']:.2f}x | {r['fisher_seconds']:.0f} s |"
        )
    print("wrote", write_rows("auto_cost", rows, samples=SAMPLES, score_rows=SCORE_ROWS, spqr_share=SPQR_SHARE))


if __name__ == "__main__":
    main()
