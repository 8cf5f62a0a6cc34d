"""The save of a streamed run: resident memory while the artifact is written, streamed vs materialized.

    python benchmarks/streamed_save.py           # the 0.44 B LLaMA (1536 wide, 12 layers, bf16), ~9 min
    python benchmarks/streamed_save.py --quick   # a tiny LLaMA (checks the script)

``qcompiler quantize FOLDER --recipe gptq-w4g128`` (benchmarks/scale.py's model: random weights,
sharded bf16 safetensors) in a fresh child per run, two ways, rounds interleaved:
- **streamed**: what the CLI does (``compile(materialize=False)``): the packed layers stay in the
  pass's spill files and the untouched weights in the checkpoint; the writer reads one at a time;
- **materialized**: ``compile(materialize=True)``, the behaviour before: every tensor is read into
  the graph first, then written.
Each child reports its peak RSS before the save (calibration, solves), the resident size when the
save begins, and the peak during the save alone (``VmHWM`` reset through ``/proc/self/clear_refs``
as the save begins). The two artifacts' tensors must be bit-identical. Writes
benchmarks/results/streamed_save.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from results_file import write_rows
from scale import SIZES, cli_model_folder, same_artifact_tensors, write_calibration_text

HERE = Path(__file__).resolve().parent
CHILD = f"""
import json, sys, time
sys.path.insert(0, {str(HERE)!r})
from peak_memory import peak_rss_mb
import qcompiler
import qcompiler.store.artifact as artifact
from qcompiler.cli import main

def rss_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024

phases, real_save, real_compile = {{}}, artifact.save, qcompiler.compile

def save(*args, **kwargs):
    phases.update(peak_before_save_MB=peak_rss_mb(), at_save_MB=rss_mb())
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: what follows is the save's own peak
    start = time.perf_counter()
    out = real_save(*args, **kwargs)
    phases.update(save_peak_MB=peak_rss_mb(), save_s=time.perf_counter() - start)
    return out

artifact.save = save
if sys.argv[1] == "materialized":
    qcompiler.compile = lambda *a, **k: real_compile(*a, **{{**k, "materialize": True}})
code = main(sys.argv[2:])
print("PHASES", json.dumps(phases), code, flush=True)
"""
MODES = ("streamed", "materialized")


def run(mode: str, folder: Path, calib: Path, out: Path, size: dict) -> dict:
    args = ["quantize", str(folder), "--recipe", "gptq-w4g128", "--calib", str(calib), "--device", "cpu"]
    args += ["--samples", str(size["nsamples"]), "--seqlen", str(size["seqlen"]), "--out", str(out)]
    done = subprocess.run([sys.executable, "-c", CHILD, mode, *args], capture_output=True, text=True)
    lines = [line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("PHASES ")]
    if done.returncode or not lines or not lines[0].endswith(" 0"):
        sys.exit(f"{mode} run failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[0].rsplit(" ", 1)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    size = dict(SIZES["quick" if args.quick else "big"])
    size["layers"] = size.pop("depths")[-1]
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    rows: list = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder, calib = tmp / "model", write_calibration_text(tmp / "calib.txt")
        disk = cli_model_folder(folder, size) / 2**20
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            for mode in MODES:
                result = run(mode, folder, calib, tmp / f"{mode}-{r}", size)
                runs[mode].append(result)
                rows.append({"round": r + 1, "mode": mode, **result})
                print(
                    f"round {r + 1} {mode:13s} peak before save {result['peak_before_save_MB']:6.0f} MB, "
                    f"at save {result['at_save_MB']:6.0f} MB, save peak {result['save_peak_MB']:6.0f} MB "
                    f"({result['save_s']:.1f} s)",
                    flush=True,
                )
            same = same_artifact_tensors(tmp / f"streamed-{r}", tmp / f"materialized-{r}")
            rows.append({"round": r + 1, "streamed_bit_identical_to_materialized": same})
            print(f"round {r + 1}: artifacts bit-identical: {same}", flush=True)
        print(f"\nbf16 file {disk:.0f} MB; medians over {args.rounds} rounds")
        print(f"{'mode':13s} {'peak before save':>17s} {'at save':>9s} {'save peak':>10s} {'whole run':>10s}")
        for mode in MODES:
            med = {k: statistics.median(x[k] for x in runs[mode]) for k in runs[mode][0]}
            whole = statistics.median(max(x["peak_before_save_MB"], x["save_peak_MB"]) for x in runs[mode])
            rows.append({"mode": mode, "median": med, "whole_run_peak_MB": whole, "over_bf16_file": whole / disk})
            print(
                f"{mode:13s} {med['peak_before_save_MB']:14.0f} MB {med['at_save_MB']:6.0f} MB "
                f"{med['save_peak_MB']:7.0f} MB {whole:7.0f} MB ({whole / disk:.2f}x the bf16 file)"
            )
    path = write_rows("streamed_save", rows, args.quick, bf16_file_MB=disk, size=size)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
