"""Memory of whole-model GPTQ as depth grows, from a bf16 checkpoint on disk, streamed.

    python benchmarks/scale.py            # LLaMA 1024 wide at 4, 8 and 16 layers, 16 x 512 tokens (~10 min)
    python benchmarks/scale.py --big      # + the 0.44 B model (1536 wide, 12 layers): peak RSS vs its file
    python benchmarks/scale.py --moe      # + a Mixtral 512 wide, 8 experts, at 2 and 8 layers (~3 min)
    python benchmarks/scale.py --quick    # tiny model (checks the script)

A randomly initialized LLaMA (intermediate 2816, 8 heads, 4 KV heads, vocab 32000) is saved as a
sharded bf16 safetensors folder per depth. Each case runs ``qcompiler quantize FOLDER --recipe
gptq-w4g128`` (the CLI a user runs, calibration windows from a text file through the folder's
tokenizer) in a fresh process; reported: wall seconds and peak RSS. The issue's targets: going from
the shallowest to the deepest model may raise the peak by at most 0.5x the bf16 size of the added
layers (a whole-model fp32 load adds 4x), and the 0.44 B model's peak stays within 1.5x its bf16
file. At the shallowest depth the whole-model load (``--no-stream``, fp32 in memory) runs too, for
its peak; it calibrates in fp32 where streaming computes in the checkpoint's bf16, so the two
artifacts' logits differ by that precision (on fp32 checkpoints they are bit-identical:
tests/test_streaming.py). Writes benchmarks/results/scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from results_file import results_file

PROBE = torch.arange(3, 3 + 64 * 7, 7).reshape(1, 64) % 256  # held-out ids (the tokenizer's byte range)
SIZES = {
    "default": dict(hidden=1024, ffn=2816, heads=8, kv_heads=4, depths=(4, 8, 16), nsamples=16, seqlen=512),
    "big": dict(hidden=1536, ffn=4096, heads=24, kv_heads=8, depths=(12,), nsamples=16, seqlen=512),
    "moe": dict(hidden=512, ffn=1024, heads=8, kv_heads=4, experts=8, depths=(2, 8), nsamples=16, seqlen=512),
    "quick": dict(hidden=128, ffn=352, heads=2, kv_heads=1, depths=(2, 4), nsamples=4, seqlen=64),
}


def save_model(folder: Path, size: dict, dtype: torch.dtype) -> int:
    """A LLaMA, or a Mixtral (top-2 routing) when ``size`` has ``experts``."""
    import transformers as T

    torch.manual_seed(0)
    common = dict(
        hidden_size=size["hidden"],
        intermediate_size=size["ffn"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        vocab_size=32000,
        max_position_embeddings=2048,
    )
    model = (
        T.MixtralForCausalLM(T.MixtralConfig(**common, num_local_experts=size["experts"], num_experts_per_tok=2))
        if "experts" in size
        else T.LlamaForCausalLM(T.LlamaConfig(**common))
    )
    model.to(dtype).save_pretrained(folder, max_shard_size="200MB")
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def run_cli(folder: Path, out: Path, calib: Path, size: dict, stream: bool) -> dict:
    # peak_memory.py: this child's own peak, not the parent's (which loads artifacts to compare logits)
    script = (
        f"import sys, time; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
        "from peak_memory import peak_rss_mb; from qcompiler.cli import main; "
        "t = time.perf_counter(); rc = main(sys.argv[1:]); "
        "print('RESULT', time.perf_counter() - t, peak_rss_mb(), rc)"
    )
    argv = [
        sys.executable,
        "-c",
        script,
        "quantize",
        str(folder),
        "--recipe",
        "gptq-w4g128",
        "--calib",
        str(calib),
        "--samples",
        str(size["nsamples"]),
        "--seqlen",
        str(size["seqlen"]),
        "--device",
        "cpu",
        "--stream" if stream else "--no-stream",
        "--out",
        str(out),
    ]
    done = subprocess.run(argv, capture_output=True, text=True)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT")), None)
    if done.returncode or line is None or line.split()[3] != "0":
        sys.exit(f"quantize failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    _, seconds, rss_mb, _ = line.split()
    return {"seconds": float(seconds), "peak_rss_MB": float(rss_mb)}


def logits(artifact: Path) -> torch.Tensor:
    import qcompiler as qc

    cm = qc.load(artifact)
    out = cm(input_ids=PROBE)
    return out["logits"] if isinstance(out, dict) else out[0]


def run_depths(tmp: Path, calib: Path, base: dict, label: str, whole_at_first: bool, rows: list) -> dict:
    """Streamed runs at each depth of ``base`` (plus the whole-model load at the first); peaks by depth."""
    peaks = {}
    for k, layers in enumerate(base["depths"]):
        size = {key: v for key, v in base.items() if key != "depths"} | {"layers": layers}
        folder = tmp / f"{label}-{layers}"
        disk = save_model(folder, size, torch.bfloat16)
        _byte_level_tokenizer(folder)
        artifacts = {}
        for stream in (False, True) if whole_at_first and k == 0 else (True,):
            artifacts[stream] = tmp / f"out-{label}-{layers}-{stream}"
            row = {
                "model": label,
                "layers": layers,
                "load": "streamed" if stream else "whole model",
                "checkpoint_MB": disk / 2**20,
                **size,
                **run_cli(folder, artifacts[stream], calib, size, stream),
            }
            row["peak_over_checkpoint"] = row["peak_rss_MB"] / row["checkpoint_MB"]
            rows.append(row)
            if stream:
                peaks[layers] = (row["peak_rss_MB"], disk / 2**20)
            print(
                f"{label:8s} {layers:3d} layers {row['load']:12s} {row['seconds']:7.1f}s  peak RSS "
                f"{row['peak_rss_MB']:7.0f} MB (bf16 checkpoint {row['checkpoint_MB']:.0f} MB, "
                f"{row['peak_over_checkpoint']:.2f}x)",
                flush=True,
            )
        if len(artifacts) == 2:
            a, b = logits(artifacts[False]).float(), logits(artifacts[True]).float()
            rows.append(
                {
                    "model": label,
                    "layers": layers,
                    "streamed_vs_whole_max_abs_logit_difference": (a - b).abs().max().item(),
                }
            )
            print(
                f"{label:8s} {layers:3d} layers streamed vs whole-model logits: max |difference| "
                f"{rows[-1]['streamed_vs_whole_max_abs_logit_difference']:.2e}",
                flush=True,
            )
        for artifact in artifacts.values():
            shutil.rmtree(artifact, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)
    return peaks


def depth_growth(peaks: dict, label: str, rows: list) -> None:
    """How much the streamed peak rose from the shallowest to the deepest model, per MB of bf16 weights added."""
    shallow, deep = min(peaks), max(peaks)
    growth, added = peaks[deep][0] - peaks[shallow][0], peaks[deep][1] - peaks[shallow][1]
    rows.append(
        {
            "model": label,
            "peak_growth_MB": growth,
            "bf16_weights_added_MB": added,
            "growth_over_added_weights": growth / added,
            "target": 0.5,
        }
    )
    print(
        f"{label} streamed: peak RSS grows {growth:6.0f} MB from {shallow} to {deep} layers, which add "
        f"{added:.0f} MB of bf16 weights ({growth / added:.2f}x; target <= 0.5x)",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--big", action="store_true", help="also the 0.44 B model (1536 wide, 12 layers)")
    ap.add_argument("--moe", action="store_true", help="also a Mixtral (512 wide, 8 experts) at 2 and 8 layers")
    ap.add_argument("--out", type=Path, help="default: results/scale.json (results/quick/ with --quick)")
    args = ap.parse_args()
    args.out = args.out or results_file("scale", args.quick)
    base = SIZES["quick" if args.quick else "default"]
    rows: list = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        calib = write_calibration_text(tmp / "calib.txt")
        depth_growth(run_depths(tmp, calib, base, "llama", True, rows), "llama", rows)
        if args.moe and not args.quick:
            depth_growth(run_depths(tmp, calib, SIZES["moe"], "mixtral", False, rows), "mixtral", rows)
        if args.big and not args.quick:
            run_depths(tmp, calib, SIZES["big"], "llama-0.44B", False, rows)
            print(f"llama-0.44B: peak RSS {rows[-1]['peak_over_checkpoint']:.2f}x its bf16 file (target <= 1.5x)")
    from qcompiler.files.atomic import write_text_atomically

    write_text_atomically(
        args.out,
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "cpus": os.cpu_count(),
                "rows": rows,
            },
            indent=1,
        )
        + "\n",
    )
    print(f"wrote {args.out}")


def write_calibration_text(path: Path) -> Path:
    """Real text for calibration: the stdlib sources the bundled model was trained on (400 k chars)."""
    import qcompiler.data as data

    path.write_text(data.stdlib_text("train")[:400_000])
    return path


def cli_model_folder(folder: Path, size: dict) -> int:
    """``save_model`` in bf16 plus a byte-level tokenizer, so ``qcompiler quantize FOLDER --calib``
    runs on it as on any model folder; the safetensors bytes."""
    disk = save_model(folder, size, torch.bfloat16)
    _byte_level_tokenizer(folder)
    return disk


def same_artifact_tensors(a: Path, b: Path) -> bool:
    """Whether two artifact folders store bit-identical tensors under the same names."""
    from safetensors.torch import load_file

    x, y = load_file(str(a / "tensors.safetensors")), load_file(str(b / "tensors.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _byte_level_tokenizer(folder: Path) -> None:
    """A real tokenizers.Tokenizer (byte-level BPE without merges: one token per byte) saved in the
    folder, so the CLI tokenizes the calibration text the way it does for any model folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)


if __name__ == "__main__":
    main()
