"""Gemma-3 270M (a real pretrained model) as qcompiler's GGUF files, run by llama.cpp.

    python benchmarks/real_gguf.py                          (~4 min on 2 cores: RTN rows)
    python benchmarks/real_gguf.py --recipes gptq-q4_0 --update     (adds GPTQ's rows, ~6 min more)

The model is the bf16 folder ``qcompiler.models.gemma3_270m`` builds from the PyPI packages that ship
it (dequantized from their Q4_K_M file: the "FP" reference is that copy). Each recipe is exported
with the token embeddings — 63 % of the parameters, and llama.cpp's output head here — as F16 and
as Q8_0 / Q4_0 (``token_embedding``). Every file is run by llama-cpp-python over held-out windows
(disjoint 256-token windows of the bundled held-out text, BOS first): perplexity, next-token KL to
the FP model's logits (transformers, float32), greedy agreement with it, and bits per parameter
over **all** parameters counted from the tensors the file stores (its header excluded). The source
Q4_K_M file is listed too, as it is; it is the model's own origin, so its KL is llama.cpp's rounding
of activations only, not a peer's quantization error. Writes benchmarks/results/real_gguf.json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import gguf
import numpy as np
import torch
from results_file import merged_rows, write_rows

import qcompiler as qc
from qcompiler import models
from qcompiler.data import stdlib_text
from qcompiler.models.gemma3_270m import gemma3_270m_dir, gemma3_270m_gguf


def _windows(m, n: int, length: int = 256) -> list[list[int]]:
    ids = m.tokenizer.encode(stdlib_text("heldout"), add_special_tokens=False)
    bos = m.tokenizer.bos_token_id
    return [[bos, *ids[i * length : (i + 1) * length - 1]] for i in range(n)]


def _stored_bits(path) -> int:
    return sum(int(t.n_bytes) * 8 for t in gguf.GGUFReader(str(path)).tensors)


def _judge(path, windows, reference) -> dict:
    """llama.cpp's perplexity, KL to the reference logits and greedy agreement over ``windows``."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, logits_all=True, verbose=False, n_threads=2, seed=0)
    nll, kl, agree, count = 0.0, 0.0, 0.0, 0
    for ids, ref in zip(windows, reference):
        llm.reset()
        llm.eval(ids)
        logits = torch.tensor(np.array(llm.scores[: len(ids)]))
        logp, ref_logp = logits.log_softmax(-1), ref.log_softmax(-1)
        targets = torch.tensor(ids[1:])
        nll -= logp[:-1].gather(1, targets[:, None]).sum().item()
        kl += (ref_logp.exp() * (ref_logp - logp)).sum(-1).sum().item()
        agree += (logits.argmax(-1) == ref.argmax(-1)).sum().item()
        count += len(ids)
    n_pred = count - len(windows)
    return {"perplexity": float(np.exp(nll / n_pred)), "kl": kl / count, "greedy_agreement": agree / count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=["rtn-q8_0", "rtn-q4_0"])
    parser.add_argument("--embeddings", nargs="+", default=["f16", "q8_0", "q4_0"])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--calibration", type=int, default=8, help="256-token calibration windows (GPTQ)")
    parser.add_argument("--update", action="store_true", help="merge these rows into the committed file")
    parser.add_argument("--out", default="/tmp/real_gguf")
    args = parser.parse_args()
    m = models.load(str(gemma3_270m_dir()))
    n_params = sum(p.numel() for p in m.model.parameters())  # the tied head counted once, as stored
    windows = _windows(m, args.windows)
    with torch.no_grad():
        reference = [m.model(input_ids=torch.tensor([ids])).logits[0].float() for ids in windows]
    rows = []

    def add(name, embedding, path, seconds):
        row = {"model": "gemma-3-270m", "file": name, "token_embedding": embedding, "quantize_s": seconds}
        row.update(file_mb=path.stat().st_size / 1e6, bits_per_param=_stored_bits(path) / n_params)
        row.update(_judge(path, windows, reference))
        rows.append(row)
        print(
            f"{name:<26} {embedding:<5} {row['file_mb']:8.1f} MB {row['bits_per_param']:6.3f} b/p "
            f"ppl {row['perplexity']:8.3f}  KL {row['kl']:.4f}  agree {row['greedy_agreement']:.3f}  "
            f"{seconds:6.1f} s",
            flush=True,
        )

    add("source Q4_K_M (llama.cpp)", "q8_0", gemma3_270m_gguf(), 0.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    calibration = [{"input_ids": torch.tensor([w])} for w in _windows(m, args.windows + args.calibration)]
    calibration = calibration[args.windows :]  # disjoint from the judged windows
    for recipe in args.recipes:
        start = time.perf_counter()
        calib = calibration if recipe.startswith("gptq") else None
        cm = qc.compile(m.model, m.example_inputs(), recipe=recipe, calibration=calib, backend="eager")
        seconds = time.perf_counter() - start
        for embedding in args.embeddings:
            path = out / f"{recipe}-{embedding}.gguf"
            cm.export_gguf(path, token_embedding=None if embedding == "f16" else embedding, progress=lambda s: None)
            add(f"qcompiler {recipe}", embedding, path, seconds)
    if args.update:
        rows = merged_rows("real_gguf", rows, key=("file", "token_embedding"))
    print("wrote", write_rows("real_gguf", rows, windows=args.windows, window_tokens=256))


if __name__ == "__main__":
    main()
