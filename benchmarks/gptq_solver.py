"""Per-layer GPTQ solver time: qcompiler's ``gptq_quantize`` vs the IST-DASLab reference loop.

    python benchmarks/gptq_solver.py                  # 4096x4096, 11008x4096, 4096x11008 (LLaMA-7B shapes)
    python benchmarks/gptq_solver.py --shapes 1024x1024 --threads 1

``daslab`` below is the column loop of the GPTQ authors' ``fasterquant`` (github.com/IST-DASLab/gptq,
W4 g128 asymmetric, no act-order, damping 0.01), transcribed for timing: same inverse-Hessian
Cholesky, per-column quantize, rank-1 update of the block and one matmul per block. Both solve the
same weight and Hessian in the same process, alternately, best of ``--repeats``; the
Hessian-weighted output error of both results is printed next to the times (it must be equal).
Writes benchmarks/results/gptq_solver.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qcompiler.algorithms.gptq import gptq_quantize
from qcompiler.algorithms.output_error import output_error

RESULTS = Path(__file__).resolve().parent / "results" / "gptq_solver.json"


def _find_params(x: torch.Tensor, maxq: int):
    zero = torch.zeros(x.shape[0], device=x.device)
    xmin, xmax = torch.minimum(x.min(1).values, zero), torch.maximum(x.max(1).values, zero)
    empty = (xmin == 0) & (xmax == 0)
    xmin[empty], xmax[empty] = -1, 1
    scale = (xmax - xmin) / maxq
    return scale.unsqueeze(1), torch.round(-xmin / scale).unsqueeze(1)


def _fake_quantize(x, scale, zero, maxq):
    return scale * (torch.clamp(torch.round(x / scale) + zero, 0, maxq) - zero)


def daslab(
    W: torch.Tensor, H: torch.Tensor, bits: int = 4, groupsize: int = 128, blocksize: int = 128, percdamp: float = 0.01
) -> torch.Tensor:
    W, H, maxq = W.clone().float(), H.clone(), 2**bits - 1
    columns = W.shape[1]
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    Q = torch.zeros_like(W)
    diag = torch.arange(columns)
    H[diag, diag] += percdamp * torch.mean(torch.diag(H))
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    scale, zero = _find_params(W, maxq)
    for i1 in range(0, columns, blocksize):
        i2 = min(i1 + blocksize, columns)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Q1, Err1, Losses1 = torch.zeros_like(W1), torch.zeros_like(W1), torch.zeros_like(W1)
        for i in range(i2 - i1):
            w, d = W1[:, i], Hinv1[i, i]
            if groupsize != -1 and (i1 + i) % groupsize == 0:
                scale, zero = _find_params(W[:, i1 + i : i1 + i + groupsize], maxq)
            q = _fake_quantize(w.unsqueeze(1), scale, zero, maxq).flatten()
            Q1[:, i] = q
            Losses1[:, i] = (w - q) ** 2 / d**2
            err1 = (w - q) / d
            W1[:, i:] -= err1.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
            Err1[:, i] = err1
        Q[:, i1:i2] = Q1
        W[:, i2:] -= Err1.matmul(Hinv[i1:i2, i2:])
    return Q


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x4096", "11008x4096", "4096x11008"], help="OUTxIN")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print(
        "| layer (out x in) | IST-DASLab loop, s | qcompiler, s | ratio | error (theirs / ours) |\n|---|---|---|---|---|"
    )
    for shape in args.shapes:
        out, n = (int(v) for v in shape.split("x"))
        gen = torch.Generator().manual_seed(0)
        X = torch.randn(2 * n, n, generator=gen)
        H, W = 2 * X.T @ X / X.shape[0], torch.randn(out, n, generator=gen)
        theirs = ours = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            Q_ref = daslab(W, H)
            theirs = min(theirs, time.perf_counter() - start)
            start = time.perf_counter()
            Q_ours = gptq_quantize(W, H, bits=4, group_size=128).dequantized
            ours = min(ours, time.perf_counter() - start)
        row = {
            "shape": shape,
            "daslab_s": theirs,
            "qcompiler_s": ours,
            "ratio": ours / theirs,
            "error_daslab": output_error(W, Q_ref, H),
            "error_qcompiler": output_error(W, Q_ours, H),
        }
        rows.append(row)
        print(
            f"| {shape} | {theirs:.2f} | {ours:.2f} | {row['ratio']:.2f} | "
            f"{row['error_daslab']:.5f} / {row['error_qcompiler']:.5f} |",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=2))
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
