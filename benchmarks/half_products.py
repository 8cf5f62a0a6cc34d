"""bf16 checkpoints on a CPU without bf16 units: calibration's matrix products in float32 vs native.

    python benchmarks/half_products.py           # the 0.44 B LLaMA's shapes, 1 and 2 blocks quantized (~10 min)
    python benchmarks/half_products.py --quick   # a tiny LLaMA (checks the script)

Two measurements, interleaved pairs on one thread (median and spread):
1. each linear of a 0.44 B LLaMA block (1536 wide, FFN 4096, 24 / 8 heads) on 1024 bf16 tokens:
   the native bf16 kernel vs ``calib/cpu_products.py``'s float32 product rounded back;
2. ``qcompiler quantize FOLDER --recipe gptq-w4g128`` end to end (scale.py's bf16 folder, 16 x 512
   tokens of stdlib text, ``--device cpu``), each run a fresh process: with the float32 products
   (what the engine does on a CPU without AVX512-BF16 / AMX) and with them switched off (the native
   kernel). Both artifacts are compared tensor by tensor.
Writes benchmarks/results/half_products.json. On a CPU with bf16 units the engine keeps the native
kernel; this script still forces both ways, so it shows what the choice is worth there too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from results_file import write_rows
from scale import SIZES, cli_model_folder, write_calibration_text

from qcompiler.calib import cpu_products
from qcompiler.store.artifact import read_manifest, report_from_manifest, role_files

HERE = Path(__file__).resolve().parent
CHILD = (  # one run of the CLI; argv[1] "native" switches the float32 products off
    f"import sys, time; sys.path.insert(0, {str(HERE)!r}); "
    "import torch; from peak_memory import peak_rss_mb; from qcompiler.calib import cpu_products; "
    "slow = frozenset() if sys.argv.pop(1) == 'native' else frozenset({torch.bfloat16}); "
    "cpu_products.slow_half_dtypes = lambda: slow; "
    "from qcompiler.cli import main; t = time.perf_counter(); rc = main(sys.argv[1:]); "
    "print('RESULT', time.perf_counter() - t, peak_rss_mb(), rc, flush=True)"
)


def linear_pairs(size: dict, tokens: int, rounds: int) -> list[dict]:
    """Seconds of each block linear, native bf16 vs float32 product, interleaved."""
    h, f, heads, kv = size["hidden"], size["ffn"], size["heads"], size["kv_heads"]
    head = h // heads
    shapes = {"q": (h, h), "k/v": (kv * head, h), "o": (h, h), "gate/up": (f, h), "down": (h, f)}
    aten = torch.ops.aten
    rows = []
    for name, (out, inp) in shapes.items():
        x, w = torch.randn(tokens, inp).bfloat16(), torch.randn(out, inp).bfloat16()
        times = {"native": [], "float32": []}
        for _ in range(rounds):
            for way in times:
                t = time.perf_counter()
                if way == "native":
                    aten.linear.default(x, w)
                else:
                    cpu_products.float32_product(aten.linear.default, (x, w), {})
                times[way].append(time.perf_counter() - t)
        row = {"linear": name, "shape": [tokens, inp, out], **{f"{k}_s": v for k, v in times.items()}}
        row["speedup"] = statistics.median(times["native"]) / statistics.median(times["float32"])
        rows.append(row)
        print(
            f"{name:8s} {tokens}x{inp}x{out:<5d} native {statistics.median(times['native']):6.3f}s  "
            f"float32 {statistics.median(times['float32']):6.3f}s  {row['speedup']:.1f}x",
            flush=True,
        )
    return rows


def agreement(a: Path, b: Path) -> dict:
    """How alike two artifacts are: tensors bit-identical, and the share of equal integer codes."""
    x, y = _tensors(a), _tensors(b)
    assert x.keys() == y.keys()
    codes = [k for k in x if not x[k].is_floating_point()]
    equal = sum(int((x[k] == y[k]).sum()) for k in codes) / max(1, sum(x[k].numel() for k in codes))
    errors = [_layer_errors(folder) for folder in (a, b)]
    return {
        "tensors_identical": sum(torch.equal(x[k], y[k]) for k in x),
        "tensors": len(x),
        "code_words_equal": equal,
        "mean_rel_error": [statistics.fmean(e.values()) for e in errors],
        "max_rel_error_change": max(abs(errors[1][k] / errors[0][k] - 1) for k in errors[0]),
    }


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every stored tensor of an artifact, over all its shards."""
    from safetensors.torch import load_file

    names = role_files(read_manifest(folder), "tensors")
    return {k: v for name in names for k, v in load_file(str(folder / name)).items()}


def _layer_errors(folder: Path) -> dict[str, float]:
    """Each quantized layer's relative output error, from the artifact's report."""
    report = report_from_manifest(read_manifest(folder))
    return {k: f["rel_error"] for p in report.passes for k, f in p.layers.items()}


def quantize(folder: Path, calib: Path, out: Path, size: dict, way: str) -> dict:
    cmd = [sys.executable, "-c", CHILD, way, "quantize", str(folder), "--recipe", "gptq-w4g128", "--calib", str(calib)]
    cmd += ["--samples", str(size["nsamples"]), "--seqlen", str(size["seqlen"]), "--device", "cpu", "--out", str(out)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - start
    result = [line.split() for line in done.stdout.splitlines() if line.startswith("RESULT")]
    if done.returncode or not result or result[0][3] != "0":
        raise SystemExit(f"quantize ({way}) failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return {"wall_s": wall, "quantize_s": float(result[0][1]), "peak_rss_MB": float(result[0][2])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cpu_products.slow_half_dtypes = lambda: frozenset({torch.bfloat16})  # both ways, whatever this CPU has
    size = dict(SIZES["quick" if args.quick else "big"])
    size.pop("depths")
    rows: list = [{"per_linear": linear_pairs(size, 1024, 5)}]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        calib = write_calibration_text(tmp / "calib.txt")
        for layers in (1, 2):
            folder = tmp / f"model-{layers}"
            cli_model_folder(folder, {**size, "layers": layers})
            runs: dict[str, list[dict]] = {"native": [], "float32": []}
            for r in range(args.rounds):
                for way in runs:
                    runs[way].append(quantize(folder, calib, tmp / f"out-{layers}-{way}-{r}", size, way))
                    print(f"{layers} block(s) round {r + 1} {way:8s} wall {runs[way][-1]['wall_s']:6.1f}s", flush=True)
            same = agreement(tmp / f"out-{layers}-native-0", tmp / f"out-{layers}-float32-0")
            row = {"blocks": layers, **same}
            for way, got in runs.items():
                row[way] = {
                    "wall_s": [g["wall_s"] for g in got],
                    "wall_s_median": statistics.median(g["wall_s"] for g in got),
                    "peak_rss_MB": max(g["peak_rss_MB"] for g in got),
                }
            row["speedup"] = row["native"]["wall_s_median"] / row["float32"]["wall_s_median"]
            rows.append(row)
            print(
                f"{layers} block(s): native {row['native']['wall_s_median']:.1f}s, float32 products "
                f"{row['float32']['wall_s_median']:.1f}s ({row['speedup']:.2f}x), peak RSS "
                f"{row['native']['peak_rss_MB']:.0f} / {row['float32']['peak_rss_MB']:.0f} MB; artifacts: "
                f"{same['tensors_identical']} of {same['tensors']} tensors identical, {same['code_words_equal']:.4%} of "
                f"packed code words equal; mean layer error {same['mean_rel_error'][0]:.5f} / "
                f"{same['mean_rel_error'][1]:.5f} (largest change {same['max_rel_error_change']:.1%})",
                flush=True,
            )
    path = write_rows("half_products", rows, args.quick, size=size)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
