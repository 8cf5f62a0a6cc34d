"""Memory of whole-model GPTQ as depth grows: a model folder loaded whole vs streamed.

    python benchmarks/scale.py            # LLaMA 1024 wide (vocab 32000) at 4 and 8 layers, 8 x 512 tokens
    python benchmarks/scale.py --quick    # tiny model (checks the script)

A randomly initialized LLaMA is saved as a sharded float32 safetensors folder at two depths. Each
case runs ``qcompiler quantize FOLDER --recipe gptq-w4g128 --no-stream`` or ``--stream`` (the CLI a
user runs, calibration from a text file through the folder's tokenizer) in a fresh process.
Reported: wall seconds, peak RSS, and — the figure that matters — how much the peak grows when the
depth doubles, next to the weights the extra blocks add: a whole-model load grows with the
weights (and their dequantized copies), streaming should not. The streamed and the whole-model
artifacts must give bit-identical logits. Writes benchmarks/results/scale.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "scale.json"
PROBE = torch.arange(3, 3 + 64 * 7, 7).reshape(1, 64) % 256  # held-out ids (the tokenizer's byte range)
SIZES = {"default": dict(hidden=1024, ffn=2816, layers=4, nsamples=8, seqlen=512),
         "quick": dict(hidden=128, ffn=352, layers=2, nsamples=4, seqlen=64)}


def save_model(folder: Path, size: dict, dtype: torch.dtype) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=size["hidden"], intermediate_size=size["ffn"], num_hidden_layers=size["layers"],
                         num_attention_heads=size["hidden"] // 64, num_key_value_heads=size["hidden"] // 64,
                         vocab_size=32000, max_position_embeddings=2048)
    LlamaForCausalLM(config).to(dtype).save_pretrained(folder, max_shard_size="200MB")
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def run_cli(folder: Path, out: Path, calib: Path, size: dict, stream: bool) -> dict:
    script = ("import resource, sys, time; from qcompiler.cli import main; t = time.perf_counter(); "
              "rc = main(sys.argv[1:]); print('RESULT', time.perf_counter() - t, "
              "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, rc)")
    argv = [sys.executable, "-c", script, "quantize", str(folder), "--recipe", "gptq-w4g128", "--calib", str(calib),
            "--samples", str(size["nsamples"]), "--seqlen", str(size["seqlen"]), "--device", "cpu",
            "--stream" if stream else "--no-stream", "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT")), None)
    if done.returncode or line is None or line.split()[3] != "0":
        sys.exit(f"quantize failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    _, seconds, rss_kb, _ = line.split()
    return {"seconds": float(seconds), "peak_rss_MB": int(rss_kb) / 1024}


def logits(artifact: Path) -> torch.Tensor:
    import qcompiler as qc
    cm = qc.load(artifact)
    out = cm(input_ids=PROBE)
    return out["logits"] if isinstance(out, dict) else out[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    base = SIZES["quick" if args.quick else "default"]
    rows, peaks = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        calib = tmp / "calib.txt"  # real text: the stdlib sources the bundled model was trained on
        import qcompiler.data as data
        calib.write_text(data.stdlib_text("train")[: 400_000])
        for layers in (base["layers"], 2 * base["layers"]):
            size = {**base, "layers": layers}
            folder = tmp / f"llama-{layers}"
            disk = save_model(folder, size, torch.float32)
            _byte_level_tokenizer(folder)
            artifacts = {}
            for stream in (False, True):
                artifacts[stream] = tmp / f"out-{layers}-{stream}"
                row = {"layers": layers, "load": "streamed" if stream else "whole model",
                       "checkpoint_MB": disk / 2**20, **size, **run_cli(folder, artifacts[stream], calib, size, stream)}
                peaks[layers, stream] = (row["peak_rss_MB"], disk / 2**20)
                rows.append(row)
                print(f"{layers:3d} layers {row['load']:12s} {row['seconds']:7.1f}s  peak RSS {row['peak_rss_MB']:7.0f} MB "
                      f"(checkpoint {row['checkpoint_MB']:.0f} MB)", flush=True)
            a, b = logits(artifacts[False]).float(), logits(artifacts[True]).float()
            rows.append({"layers": layers, "streamed_vs_whole_max_abs_logit_difference": (a - b).abs().max().item()})
            print(f"{layers:3d} layers streamed vs whole-model logits: max |difference| "
                  f"{rows[-1]['streamed_vs_whole_max_abs_logit_difference']:.2e}", flush=True)
    shallow, deep = base["layers"], 2 * base["layers"]
    added = peaks[deep, False][1] - peaks[shallow, False][1]
    for stream in (False, True):
        growth = peaks[deep, stream][0] - peaks[shallow, stream][0]
        rows.append({"load": "streamed" if stream else "whole model", "peak_growth_MB": growth,
                     "weights_added_MB": added, "growth_over_added_weights": growth / added})
        print(f"{'streamed' if stream else 'whole model':12s}: peak RSS grows {growth:6.0f} MB from {shallow} to {deep} "
              f"layers, which add {added:.0f} MB of weights ({growth / added:.2f}x)", flush=True)
    from qcompiler.atomic import write_text_atomically
    write_text_atomically(args.out, json.dumps({"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                                                "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                                                "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


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
