"""The main job: quantize a bundled model with a built-in recipe and print quality before and after.

    python -m qcompiler --model tinylm --recipe gptq-w4g128

``tinylm`` is judged by held-out perplexity on CPython standard-library modules it never saw;
``minilm`` by the mean cosine between its sentence embeddings and the FP32 model's.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import qcompiler as qc
from qcompiler import models
from qcompiler.cli import quiet_library_warnings
from qcompiler.evaluation.quality import REPORTED_WINDOWS, QualityJudge
from qcompiler.generation import timed_generation
from qcompiler.ir.model_size import model_size


def main(argv=None) -> int:
    """``python -m qcompiler``: the bundled demo, or the command line when given a command
    (``python -m qcompiler quantize ...``: what ``torchrun -m qcompiler`` and ``--nproc`` run)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and not args[0].startswith("-"):
        from qcompiler.cli import main as command_line

        return command_line(args)
    quiet_library_warnings()
    ap = argparse.ArgumentParser(prog="python -m qcompiler", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tinylm", help="tinylm | longlm | minilm | path to a Hugging Face model folder")
    ap.add_argument("--recipe", default="gptq-w4g128", help="built-in recipe name (see --list)")
    ap.add_argument("--calib", type=int, default=32, help="calibration windows / sentences")
    ap.add_argument("--list", action="store_true", help="list built-in recipes and exit")
    ap.add_argument("--prompt", default="class Parser:\n    def __init__(self", help="causal LMs: prompt to continue")
    ap.add_argument("--new-tokens", type=int, default=48, help="causal LMs: tokens to generate")
    args = ap.parse_args(args)
    if args.list:
        for r in qc.list_recipes():
            print(f"{r.name:22s} {r.description}")
        return 0
    torch.manual_seed(0)
    loaded = models.load(args.model)
    judge = QualityJudge(loaded, max_windows=REPORTED_WINDOWS)
    before = judge.score(loaded.model)
    start = time.perf_counter()
    cm = qc.compile(
        loaded.model, loaded.example_inputs(), recipe=args.recipe, calibration=loaded.calibration(args.calib)
    )
    seconds = time.perf_counter() - start
    after = judge.score(cm)  # (the per-layer figures were printed as each layer finished)
    print("\n".join(f"{p.name}: {p.seconds:.2f}s, {len(p.layers)} layers" for p in cm.report.passes))
    print(f"\nmodel {loaded.name}, recipe {args.recipe}: {seconds:.1f}s to quantize")
    print(f"model size: {model_size(cm.graph_module).describe()}")
    what = "perplexity" if judge.metric == "perplexity" else "embedding cosine vs FP32"
    print(f"{what} over {judge.describe()}: FP32 {before:.4f} -> quantized {after:.4f}")
    if cm.cache_layout is not None:
        _show_generation(loaded, cm, args.prompt, args.new_tokens)
    return 0


def _show_generation(loaded, cm, prompt: str, new_tokens: int) -> None:
    """A greedy continuation from the FP model and the quantized one with the KV cache, on ONNX
    Runtime (the CPU deployment path; the eager backend is the plain-torch reference)."""
    import importlib.util

    backend = "onnxruntime" if importlib.util.find_spec("onnxruntime") else "eager"
    fp = qc.compile(loaded.model, loaded.example_inputs(), recipe="none", backend=backend, progress=False)
    quantized = cm.with_backend(backend)
    ids = loaded.encode(prompt)
    print(
        f"\ngreedy continuation of {prompt!r} ({new_tokens} tokens, KV cache, {backend} backend, "
        f"{torch.get_num_threads()} threads):"
    )
    for label, model in (("FP32", fp), (cm.recipe.name, quantized)):
        run = timed_generation(model, ids, new_tokens)
        speed = run["decode_tokens_per_second"]
        print(f"  {label:>12s} [{speed:7.1f} tok/s decode]: {loaded.decode(run['tokens'][0])!r}")


if __name__ == "__main__":
    sys.exit(main())
