"""Decode speed with the KV cache: tokens/s per engine, batch 1, one thread, side by side.

    python benchmarks/generate.py                 # bundled tinylm + a ~0.5 B LLaMA (random weights)
    python benchmarks/generate.py --quick         # tinylm only, fewer tokens (smoke run)

Per model: a prompt of --prompt tokens, then --new greedy tokens; decode tokens/s counts the steps
after the first token (the prefill is timed apart). Engines, all on the same weights:
transformers ``generate`` (FP32), qcompiler eager FP32 and quantized, qcompiler's onnxruntime
backend (the ONNX export with past/present KV tensors) FP32 and quantized, the ``onnx-genai``
export of both run by onnxruntime-genai, and on the 0.5 B model the peer: onnxruntime-genai's own
model builder (``python -m onnxruntime_genai.models.builder -p int4``, RTN, block 128, which also
stores ``lm_head`` in int4) beside qcompiler's ``rtn-w4g128-head`` (the same: ``lm_head`` in 4 bits). Rounds are interleaved
(each round runs every engine once) and the table gives the median with min-max.
The eager backend (the plain-torch reference, which dequantizes every weight on every call) is
timed on tinylm only. The 0.5 B model has random weights, so it is quantized with RTN: decode speed depends only on the
stored layout (``qc.quant_linear`` / ``MatMulNBits`` 4-bit g128), which GPTQ and RTN share.
The 0.44 B run also times the ``rtn-w4g128-head`` genai export with its attention as plain ONNX ops
(``fused_attention=False``) beside the default ``GroupQueryAttention`` one: the fused node's share.
Writes benchmarks/results/generate.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_clock import HFEngine, rate  # noqa: E402
from quality import write_atomically  # noqa: E402

import qcompiler as qc  # noqa: E402
from qcompiler import models  # noqa: E402
from qcompiler.generation import timed_generation  # noqa: E402
from qcompiler.interop import export_onnx_genai  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "generate.json"


def llama_05b():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=32,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 32000, (1, 16))
    calib = [{"input_ids": torch.randint(0, 32000, (2, 64), generator=torch.Generator().manual_seed(1))}]
    return model, ids, calib, "rtn-w4g128"


class QCEngine:
    def __init__(self, cm):
        self.cm = cm

    def decode_rate(self, ids, new) -> float:
        return timed_generation(self.cm, ids, new, eos_token_id=-1)["decode_tokens_per_second"]


class GenaiEngine:
    """An onnxruntime-genai model folder, one intra-op thread."""

    def __init__(self, folder: Path):
        import onnxruntime_genai as og

        config = json.loads((folder / "genai_config.json").read_text())
        config["model"]["decoder"]["session_options"].update(intra_op_num_threads=1, inter_op_num_threads=1)
        (folder / "genai_config.json").write_text(json.dumps(config, indent=1))
        self.og, self.model = og, og.Model(str(folder))

    def decode_rate(self, ids, new) -> float:
        import numpy as np

        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=ids.shape[1] + new, min_length=ids.shape[1] + new, do_sample=False)
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(np.asarray(ids, dtype=np.int32))
        stamps = []
        for _ in range(new):
            generator.generate_next_token()
            stamps.append(time.perf_counter())
        return rate(stamps)


def builder_int4(model, workdir: Path, group_size: int = 128) -> Path:
    """The peer: onnxruntime-genai's own model builder, int4 RTN with the same group size."""
    import subprocess

    src, out = workdir / "hf", workdir / "builder"
    model.save_pretrained(src)
    _byte_tokenizer(model.config.vocab_size).save_pretrained(src)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "onnxruntime_genai.models.builder",
            "-i",
            str(src),
            "-o",
            str(out),
            "-p",
            "int4",
            "-e",
            "cpu",
            "-c",
            str(workdir / "cache"),
            "--extra_options",
            f"int4_block_size={group_size}",
        ],
        check=True,
        capture_output=True,
    )
    return out


def _byte_tokenizer(vocab: int):
    """A throwaway word-level tokenizer: the builder insists on copying one."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(tok_models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")


def run_model(
    label,
    model,
    example,
    calib,
    recipe,
    prompt_len,
    new,
    rounds,
    peer: bool,
    eager: bool = True,
    genai_only: tuple[str, ...] = (),
    plain_attention: tuple[str, ...] = (),
):
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp = qc.compile(model, {"input_ids": example}, recipe="none", progress=False)
        quant = qc.compile(model, {"input_ids": example}, recipe=recipe, calibration=calib, progress=False)
        engines = {"transformers FP32": HFEngine(model)}
        if eager:  # the plain-torch reference: dequantizes every weight on every call
            engines.update({"qcompiler eager FP32": QCEngine(fp), f"qcompiler eager {recipe}": QCEngine(quant)})
        engines.update(
            {
                "onnxruntime FP32": QCEngine(fp.with_backend("onnxruntime", threads=1)),
                f"onnxruntime {recipe}": QCEngine(quant.with_backend("onnxruntime", threads=1)),
            }
        )
        work = Path(tempfile.mkdtemp(prefix="qc-generate-bench-"))
        extra = [
            (name, qc.compile(model, {"input_ids": example}, recipe=name, calibration=calib, progress=False))
            for name in genai_only
        ]
        for name, cm in (("FP32", fp), (recipe, quant), *extra):
            export_onnx_genai(cm, work / name, progress=lambda _: None)
            engines[f"onnxruntime-genai, qcompiler {name}"] = GenaiEngine(work / name)
            if name in plain_attention:  # the same export with attention as plain ops: GroupQueryAttention's share
                export_onnx_genai(cm, work / f"{name}-plain", progress=lambda _: None, fused_attention=False)
                engines[f"onnxruntime-genai, qcompiler {name}, plain-op attention"] = GenaiEngine(
                    work / f"{name}-plain"
                )
        if peer:
            engines["onnxruntime-genai, builder int4 g128"] = GenaiEngine(builder_int4(model, work))
    speeds = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            speeds[name].append(engine.decode_rate(ids, new))
    rows = []
    fp32 = statistics.median(speeds["onnxruntime-genai, qcompiler FP32"])
    for name, values in speeds.items():
        med = statistics.median(values)
        rows.append(
            {
                "model": label,
                "engine": name,
                "decode_tok_s": round(med, 2),
                "min": round(min(values), 2),
                "max": round(max(values), 2),
                "vs_genai_fp32": round(med / fp32, 3),
            }
        )
        print(
            f"{label:12s} {name:40s} {med:9.1f} tok/s  [{min(values):.1f}-{max(values):.1f}]  "
            f"{med / fp32:5.2f}x genai FP32",
            flush=True,
        )
    shutil.rmtree(work, ignore_errors=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    new = 16 if args.quick else args.new
    rows = []
    tiny = models.load("tinylm")
    rows += run_model(
        "tinylm",
        tiny.model,
        tiny.example_inputs()["input_ids"],
        tiny.calibration(16),
        "gptq-w4g128",
        args.prompt,
        new,
        1 if args.quick else args.rounds,
        peer=False,
    )
    if not args.quick:
        model, example, calib, recipe = llama_05b()
        params = sum(p.numel() for p in model.parameters()) / 1e9
        rows += run_model(
            f"llama-{params:.2f}B",
            model,
            example,
            calib,
            recipe,
            args.prompt,
            new,
            args.rounds,
            peer=True,
            eager=False,
            genai_only=("rtn-w4g128-head",),
            plain_attention=("rtn-w4g128-head",),
        )
    record = {
        "threads": 1,
        "batch": 1,
        "prompt_tokens": args.prompt,
        "new_tokens": new,
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, torch {torch.__version__}",
        "rows": rows,
    }
    if not args.quick:
        write_atomically(RESULTS, json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
