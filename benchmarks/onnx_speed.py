"""ONNX Runtime speed of each quantized formulation against fp32, per layer and for the bundled LM.

    python benchmarks/onnx_speed.py               # per-layer 4096x11008 at M = 1, 16, 512; 1 and 2 threads
    python benchmarks/onnx_speed.py --quick       # smaller layer, fewer repeats (smoke run)

Per-layer graphs are built directly with onnx.helper (the same operators our exporter emits):
fp32 MatMul; MatMulNBits 4-bit g128 (accuracy_level 0 and 4); W8A8 per-token (MatMulInteger);
SpQR = MatMulNBits 4-bit g16 + fractional-zero correction, plus a 1 % outlier branch (random
positions) in three formulations: gathered outlier columns (what the exporter emits), ELL
(rows padded to the longest), and CSR as Gather/Mul/ScatterElements.
Timings are medians over repeats of *paired* ratios: each repeat runs every variant once, so
machine noise hits all of them alike. Whole-model: tinylm decode step (M = 1) and 512-token prefill.
Writes benchmarks/results/onnx_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import write_atomically  # noqa: E402
from results_file import results_file  # noqa: E402

MSFT = helper.make_opsetid("com.microsoft", 1)


def model(nodes, inits, n):
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", None])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])
    g = helper.make_graph(nodes, "layer", [x], [y], initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), MSFT])


def t(name, array):
    return numpy_helper.from_array(array, name)


def fp32_layer(k, n, rng):
    return model([helper.make_node("MatMul", ["X", "W"], ["Y"])], [t("W", rng.standard_normal((k, n), np.float32))], n)


def nbits_nodes(k, n, block, rng, level, out="Y", float_zeros=False):
    blob = block // 2
    inits = [
        t("B", rng.integers(0, 256, (n, k // block, blob), dtype=np.uint8)),
        t("S", (rng.random(n * (k // block)) * 0.01).astype(np.float32)),
    ]
    if float_zeros:
        inits.append(t("Z", (rng.random(n * (k // block)) * 15).astype(np.float32)))
    else:
        inits.append(t("Z", rng.integers(0, 256, n * ((k // block + 1) // 2), dtype=np.uint8)))
    node = helper.make_node(
        "MatMulNBits",
        ["X", "B", "S", "Z"],
        [out],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=4,
        block_size=block,
        accuracy_level=level,
    )
    return [node], inits


def nbits_layer(k, n, rng, level):
    nodes, inits = nbits_nodes(k, n, 128, rng, level)
    return model(nodes, inits, n)


def w8a8_layer(k, n, rng):
    """Per-token int8 activations as our exporter emits them (codes and weights uint8 + 128, zero points
    128: exact on every x86 CPU; benchmarks/int8_matmul_forms.py compares the int8-weight form)."""
    c = lambda name, v, dt=np.float32: helper.make_node(
        "Constant", [], [name], value=numpy_helper.from_array(np.array(v, dt))
    )
    nodes = [
        helper.make_node("Abs", ["X"], ["ax"]),
        c("axes", [-1], np.int64),
        helper.make_node("ReduceMax", ["ax", "axes"], ["amax"], keepdims=1),
        c("c127", 127.0),
        c("eps", 1e-8),
        c("lo", -127.0),
        c("c128", 128.0),
        c("zp", 128, np.uint8),
        helper.make_node("Div", ["amax", "c127"], ["s0"]),
        helper.make_node("Max", ["s0", "eps"], ["sx"]),
        helper.make_node("Div", ["X", "sx"], ["xs"]),
        helper.make_node("Round", ["xs"], ["xr"]),
        helper.make_node("Clip", ["xr", "lo", "c127"], ["xc"]),
        helper.make_node("Add", ["xc", "c128"], ["xu"]),
        helper.make_node("Cast", ["xu"], ["xq"], to=TensorProto.UINT8),
        helper.make_node("MatMulInteger", ["xq", "Wq", "zp", "zp"], ["acc"]),
        helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["accf", "sx"], ["y0"]),
        helper.make_node("Mul", ["y0", "sw"], ["Y"]),
    ]
    inits = [t("Wq", rng.integers(1, 256, (k, n), dtype=np.uint8)), t("sw", (rng.random(n) * 0.01).astype(np.float32))]
    return model(nodes, inits, n)


def outliers(k, n, rng, density):
    nnz = int(k * n * density)
    flat = np.sort(rng.choice(k * n, nnz, replace=False))
    rows, cols = flat // k, flat % k
    return rows.astype(np.int64), cols.astype(np.int64), rng.standard_normal(nnz).astype(np.float32)


def spqr_layer(k, n, rng, level, form, density):
    """SpQR as our exporter emits it: MatMulNBits 4-bit g16 (uint8 zeros) + fractional-zero
    correction (block sums of x @ C), plus the outlier branch in the chosen formulation."""
    nodes, inits = nbits_nodes(k, n, 16, rng, level, out="Yq")
    groups = k // 16
    inits += [
        t("C", (rng.standard_normal((groups, n)) * 1e-3).astype(np.float32)),
        t("gshape", np.array([0, groups, 16], np.int64)),
        t("ax1", np.array([-1], np.int64)),
    ]
    nodes += [
        helper.make_node("Reshape", ["X", "gshape"], ["xg16"]),
        helper.make_node("ReduceSum", ["xg16", "ax1"], ["gs"], keepdims=0),
        helper.make_node("MatMul", ["gs", "C"], ["yc"]),
        helper.make_node("Add", ["Yq", "yc"], ["Yd"]),
    ]
    rows, cols, vals = outliers(k, n, rng, density)
    if form == "gather":  # only the columns holding outliers, times a dense [k_used, n] block
        ucols = np.unique(cols)
        block = np.zeros((ucols.size, n), np.float32)
        block[np.searchsorted(ucols, cols), rows] = vals
        inits += [t("ucols", ucols), t("blk", block)]
        nodes += [
            helper.make_node("Gather", ["X", "ucols"], ["xo"], axis=-1),
            helper.make_node("MatMul", ["xo", "blk"], ["Ys"]),
        ]
    elif form == "ell":  # rows padded to the longest row: Gather [M, n, R] * values, summed over R
        counts = np.bincount(rows, minlength=n)
        r = counts.max()
        idx = np.zeros((n, r), np.int64)
        val = np.zeros((n, r), np.float32)
        pos = np.arange(rows.size) - np.repeat(np.cumsum(counts) - counts, counts)
        idx[rows, pos], val[rows, pos] = cols, vals
        inits += [t("eidx", idx), t("evals", val), t("ax2", np.array([-1], np.int64))]
        nodes += [
            helper.make_node("Gather", ["X", "eidx"], ["xe"], axis=1),
            helper.make_node("Mul", ["xe", "evals"], ["pe"]),
            helper.make_node("ReduceSum", ["pe", "ax2"], ["Ys"], keepdims=0),
        ]
    else:  # CSR as Gather / Mul / ScatterElements(add)
        inits += [
            t("cols", cols),
            t("vals", vals),
            t("rows", rows.reshape(1, -1)),
            t("nn", np.array([n], np.int64)),
            t("nnz", np.array([rows.size], np.int64)),
            t("zero1", np.zeros(1, np.float32)),
        ]
        nodes += [
            helper.make_node("Gather", ["X", "cols"], ["xo"], axis=-1),
            helper.make_node("Mul", ["xo", "vals"], ["p"]),
            helper.make_node("Shape", ["X"], ["m"], start=0, end=1),
            helper.make_node("Concat", ["m", "nn"], ["oshape"], axis=0),
            helper.make_node("Expand", ["zero1", "oshape"], ["zeros"]),
            helper.make_node("Concat", ["m", "nnz"], ["ishape"], axis=0),
            helper.make_node("Expand", ["rows", "ishape"], ["idx"]),
            helper.make_node("ScatterElements", ["zeros", "idx", "p"], ["Ys"], axis=-1, reduction="add"),
        ]
    nodes.append(helper.make_node("Add", ["Yd", "Ys"], ["Y"]))
    return model(nodes, inits, n)


def session(proto, threads, tmpdir, name):
    path = Path(tmpdir) / f"{name}.onnx"
    onnx.save_model(proto, str(path))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def paired(sessions: dict, feeds: dict, repeats: int) -> dict:
    for s in sessions.values():  # warm-up
        s.run(None, feeds)
    times = {name: [] for name in sessions}
    for _ in range(repeats):
        for name, s in sessions.items():
            start = time.perf_counter()
            s.run(None, feeds)
            times[name].append(time.perf_counter() - start)
    base = times["fp32"]
    return {
        name: {
            "median_ms": 1e3 * statistics.median(ts),
            "ratio_to_fp32": statistics.median(a / b for a, b in zip(ts, base)),
        }
        for name, ts in times.items()
    }


def layer_bench(k, n, ms, threads_list, repeats, density):
    rng = np.random.default_rng(0)
    builders = {
        "fp32": lambda: fp32_layer(k, n, rng),
        "w4g128 level0": lambda: nbits_layer(k, n, rng, 0),
        "w4g128 level4": lambda: nbits_layer(k, n, rng, 4),
        "w8a8 per-token": lambda: w8a8_layer(k, n, rng),
        "spqr gather level4": lambda: spqr_layer(k, n, rng, 4, "gather", density),
        "spqr ell level4": lambda: spqr_layer(k, n, rng, 4, "ell", density),
        "spqr scatter level4": lambda: spqr_layer(k, n, rng, 4, "scatter", density),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        protos = {name: build() for name, build in builders.items()}
        for threads in threads_list:
            sessions = {}
            for name, proto in protos.items():
                try:
                    sessions[name] = session(proto, threads, tmp, name.replace(" ", "_"))
                except Exception as exc:  # report, do not hide: a formulation ORT cannot load
                    print(f"  {name}: ORT refused the model: {str(exc).splitlines()[0]}", file=sys.stderr)
            for m in ms:
                x = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)
                for name, figures in paired(sessions, {"X": x}, repeats).items():
                    rows.append(dict(layer=f"{k}x{n}", M=m, threads=threads, variant=name, **figures))
                    print(
                        f"{k}x{n} M={m:4d} t={threads} {name:24s} {figures['median_ms']:9.2f} ms  "
                        f"x{figures['ratio_to_fp32']:.3f} of fp32",
                        file=sys.stderr,
                        flush=True,
                    )
    return rows


def model_bench(recipes, threads, repeats):
    """Bundled tinylm without its KV cache: a 1-token forward and a 512-token prefill, per recipe's export
    (real decoding with the cache: benchmarks/generate.py)."""
    import torch

    import qcompiler as qc
    from qcompiler import models
    from qcompiler.backends.onnxruntime import session_for

    loaded = models.load("tinylm")
    calib = loaded.calibration(32, 256)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sessions, sizes = {}, {}
        for recipe in ["none"] + recipes:
            cm = qc.compile(
                loaded.model,
                {**loaded.example_inputs(), "use_cache": False},
                recipe=recipe,
                calibration=calib,
                progress=False,
            )
            path = Path(tmp) / f"{recipe}.onnx"
            cm.export_onnx(path, accuracy_level=4)
            sessions["fp32" if recipe == "none" else recipe] = session_for(path, threads=threads)
            sizes["fp32" if recipe == "none" else recipe] = os.path.getsize(path)
        for label, seq in (("1-token forward, no cache", 1), ("prefill (512 tokens)", 512)):
            ids = torch.randint(0, 256, (1, seq)).numpy()
            for name, figures in paired(sessions, {"input_ids": ids}, repeats).items():
                rows.append(
                    dict(model="tinylm", phase=label, threads=threads, variant=name, file_bytes=sizes[name], **figures)
                )
                print(
                    f"tinylm {label:22s} {name:18s} {figures['median_ms']:8.2f} ms x{figures['ratio_to_fp32']:.3f} "
                    f"{sizes[name] / 1e6:.2f} MB",
                    file=sys.stderr,
                    flush=True,
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, help="default: results/onnx_speed.json (results/quick/ with --quick)")
    args = ap.parse_args()
    args.out = args.out or results_file("onnx_speed", args.quick)
    k, n = (1024, 2048) if args.quick else (4096, 11008)
    repeats = 3 if args.quick else 7
    layers = layer_bench(k, n, [1, 16, 512], [1, 2], repeats, 0.01)
    whole = model_bench(["gptq-w4g128", "gptq-w3g128", "spqr-w3g16", "w8a8", "w8a8-smoothquant"], 1, repeats)
    meta = dict(onnxruntime=ort.__version__, date=time.strftime("%Y-%m-%d"), outlier_density=0.01, repeats=repeats)
    write_atomically(args.out, json.dumps({"meta": meta, "layers": layers, "models": whole}, indent=2) + "\n")
    print("| layer | M | threads | variant | median ms | x fp32 |\n|---|---|---|---|---|---|")
    for r in layers:
        print(
            f"| {r['layer']} | {r['M']} | {r['threads']} | {r['variant']} | {r['median_ms']:.2f} | {r['ratio_to_fp32']:.3f} |"
        )
    print("\n| model | phase | variant | median ms | x fp32 | file MB |\n|---|---|---|---|---|---|")
    for r in whole:
        print(
            f"| {r['model']} | {r['phase']} | {r['variant']} | {r['median_ms']:.2f} | {r['ratio_to_fp32']:.3f} | "
            f"{r['file_bytes'] / 1e6:.2f} |"
        )


if __name__ == "__main__":
    main()
