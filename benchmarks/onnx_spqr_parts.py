"""Where SpQR's time goes in ONNX Runtime, part by part, against fp32 MatMul.

    python benchmarks/onnx_spqr_parts.py          # 4096x11008, 1 thread, M = 1 and 512

Variants: fp32 MatMul; MatMulNBits 4-bit level 4 at block 16/32/64/128 (SpQR needs 16); the
fractional-zero correction alone ((block sums of x) @ C); the whole SpQR layer with the ELL outlier
branch at 1 % random outliers. Medians of paired repeats (every variant once per repeat).
Writes benchmarks/results/onnx_spqr_parts.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from onnx import helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from onnx_speed import fp32_layer, model, nbits_nodes, session, spqr_layer, t  # noqa: E402

from qcompiler.files.atomic import write_text_atomically  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "onnx_spqr_parts.json"


def correction_layer(k, n, rng):
    groups = k // 16
    inits = [
        t("C", (rng.standard_normal((groups, n)) * 1e-3).astype(np.float32)),
        t("gshape", np.array([0, groups, 16], np.int64)),
        t("ax1", np.array([-1], np.int64)),
    ]
    nodes = [
        helper.make_node("Reshape", ["X", "gshape"], ["xg16"]),
        helper.make_node("ReduceSum", ["xg16", "ax1"], ["gs"], keepdims=0),
        helper.make_node("MatMul", ["gs", "C"], ["Y"]),
    ]
    return model(nodes, inits, n)


def main(k=4096, n=11008, rows=(1, 512)) -> list[dict]:
    rng = np.random.default_rng(0)
    variants = {"fp32": fp32_layer(k, n, rng)}
    for block in (16, 32, 64, 128):
        variants[f"MatMulNBits b{block} level4"] = model(*nbits_nodes(k, n, block, rng, 4), n)
    variants["zero correction only"] = correction_layer(k, n, rng)
    variants["spqr (b16 + correction + ELL 1%)"] = spqr_layer(k, n, rng, 4, "ell", 0.01)
    tmp = tempfile.mkdtemp()
    sessions = {name: session(p, 1, tmp, f"v{i}") for i, (name, p) in enumerate(variants.items())}
    results = []
    for m in rows:
        x = rng.standard_normal((m, k)).astype(np.float32)
        inner, repeats = (10, 5) if m == 1 else (1, 2)
        times = {name: [] for name in sessions}
        for _ in range(repeats):
            for name, s in sessions.items():
                s.run(None, {"X": x})
                start = time.perf_counter()
                for _ in range(inner):
                    s.run(None, {"X": x})
                times[name].append((time.perf_counter() - start) / inner * 1e3)
        base = statistics.median(times["fp32"])
        for name, ts in times.items():
            ms = statistics.median(ts)
            results.append({"M": m, "variant": name, "median_ms": ms, "ratio_to_fp32": ms / base})
            print(f"M={m:<4} {name:34s} {ms:9.2f} ms  {ms / base:6.3f} x fp32", flush=True)
    write_text_atomically(RESULTS, json.dumps({"layer": f"{k}x{n}", "threads": 1, "rows": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
