"""Exactness and speed of the two uint8-activation forms of ONNX Runtime's MatMulInteger.

    python benchmarks/int8_matmul_forms.py            # 4096x11008 at M = 1, 16, 512; 1 and 2 threads
    python benchmarks/int8_matmul_forms.py --quick    # 1024x2048, fewer repeats

W8A8 exports send int8 codes as uint8 + 128 with zero point 128. ``u8s8`` keeps the weights int8:
ORT's fastest kernel on CPUs with AVX-512 VNNI, but on AVX2-only CPUs it sums pairs of u8*s8
products in int16 (vpmaddubsw) and saturates. ``u8u8`` shifts the weights to uint8 + 128 too
(what the exporter emits, backends/onnx_export.py). Each form's int32 sums are compared with the
exact product (numpy int64); timings are medians of interleaved pairs (ratio u8u8 / u8s8 per
repeat). Writes benchmarks/results/int8_matmul_forms.json.
"""

from __future__ import annotations

import argparse
import json
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


def form(k: int, n: int, weights: np.ndarray, unsigned_weights: bool) -> onnx.ModelProto:
    """Y = MatMulInteger(Xu, W) with zero points 128: Xu uint8 [M, k], W int8 or uint8 + 128 [k, n]."""
    zp = numpy_helper.from_array(np.array(128, np.uint8), "zp")
    w = (weights.astype(np.int16) + 128).astype(np.uint8) if unsigned_weights else weights
    inputs = ["X", "W", "zp", "zp"] if unsigned_weights else ["X", "W", "zp"]
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", inputs, ["Y"])],
        "mm",
        [helper.make_tensor_value_info("X", TensorProto.UINT8, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.INT32, ["M", n])],
        [numpy_helper.from_array(w, "W"), zp],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def session(proto, threads: int, tmp: str, name: str) -> ort.InferenceSession:
    path = Path(tmp) / f"{name}.onnx"
    onnx.save_model(proto, str(path))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    k, n = (1024, 2048) if args.quick else (4096, 11008)
    repeats = 5 if args.quick else 11
    rng = np.random.default_rng(0)
    weights = rng.integers(-127, 128, (k, n), dtype=np.int8)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for threads in (1, 2):
            s8 = session(form(k, n, weights, False), threads, tmp, f"u8s8_{threads}")
            u8 = session(form(k, n, weights, True), threads, tmp, f"u8u8_{threads}")
            for m in (1, 16, 512):
                codes = rng.integers(-127, 128, (m, k)).astype(np.int64)
                x = (codes + 128).astype(np.uint8)
                exact = codes @ weights.astype(np.int64)
                feeds = {"X": x}
                errors = {
                    name: int(np.abs(s.run(None, feeds)[0].astype(np.int64) - exact).max())
                    for name, s in (("u8s8", s8), ("u8u8", u8))
                }
                times = {"u8s8": [], "u8u8": []}
                for _ in range(repeats):  # interleaved pairs
                    for name, s in (("u8s8", s8), ("u8u8", u8)):
                        start = time.perf_counter()
                        s.run(None, feeds)
                        times[name].append(time.perf_counter() - start)
                ratios = [b / a for a, b in zip(times["u8s8"], times["u8u8"])]
                row = dict(
                    layer=f"{k}x{n}",
                    M=m,
                    threads=threads,
                    u8s8_ms=1e3 * statistics.median(times["u8s8"]),
                    u8u8_ms=1e3 * statistics.median(times["u8u8"]),
                    ratio_median=statistics.median(ratios),
                    ratio_min=min(ratios),
                    ratio_max=max(ratios),
                    u8s8_max_int32_error=errors["u8s8"],
                    u8u8_max_int32_error=errors["u8u8"],
                )
                rows.append(row)
                print(
                    f"{k}x{n} M={m:4d} t={threads} u8s8 {row['u8s8_ms']:8.2f} ms (max int32 error "
                    f"{errors['u8s8']}) u8u8 {row['u8u8_ms']:8.2f} ms (error {errors['u8u8']}) "
                    f"ratio {row['ratio_median']:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    meta = dict(
        onnxruntime=ort.__version__,
        date=time.strftime("%Y-%m-%d"),
        cpu=cpu,
        repeats=repeats,
        vnni=any(f in flags for f in ("avx512_vnni", "avx_vnni")),
        avx512=any(f.startswith("avx512") for f in flags),
    )
    write_atomically(
        results_file("int8_matmul_forms", args.quick), json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n"
    )
    print(f"{cpu}, VNNI: {meta['vnni']}, onnxruntime {ort.__version__}")
    print(
        "| layer | M | threads | u8s8 ms | u8s8 max int32 error | u8u8 ms | u8u8 max int32 error | u8u8 / u8s8 (min-max) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['layer']} | {r['M']} | {r['threads']} | {r['u8s8_ms']:.2f} | {r['u8s8_max_int32_error']} | "
            f"{r['u8u8_ms']:.2f} | {r['u8u8_max_int32_error']} | {r['ratio_median']:.2f} "
            f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) |"
        )


if __name__ == "__main__":
    main()
