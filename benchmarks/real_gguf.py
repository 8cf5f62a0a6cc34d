"""Gemma-3 270M (a real pretrained model) as qcompiler's GGUF files, run by llama.cpp.

    python benchmarks/real_gguf.py                          (~4 min on 2 cores: RTN rows)
    python benchmarks/real_gguf.py --recipes gptq-q4_0 --update     (adds GPTQ's rows, ~6 min more)
    python benchmarks/real_gguf.py --recipes --llama-cpp-bin BUILD/bin --update   (llama.cpp's own Q4_K_M)

The model is the bf16 folder ``qcompiler.models.gemma3_270m`` builds from the PyPI packages that ship
it (dequantized from their Q4_K_M file: the "FP" reference is that copy). Each recipe is exported
with the token embeddings — 63 % of the parameters, and llama.cpp's output head here — as F16 and
as Q8_0 / Q4_0 (``token_embedding``). Every file is run by llama-cpp-python over held-out windows
(disjoint 256-token windows of the bundled held-out text, BOS first): perplexity, next-token KL to
the FP model's logits (transformers, float32), greedy agreement with it, and bits per parameter
over **all** parameters counted from the tensors the file stores (its header excluded). The source
Q4_K_M file is listed too, as it is; it is the model's own origin, so its KL is llama.cpp's rounding
of activations only, not a peer's quantization error.

With ``--llama-cpp-bin`` (llama.cpp's tools, built as benchmarks/gguf_quality.py says), the peer:
qcompiler writes the FP model as an F16 GGUF, ``llama-imatrix`` computes an importance matrix from
the calibration windows' text, ``llama-quantize`` makes its Q4_K_M mix of the F16 file with and
without it (its own per-tensor choices, token embeddings included) and its ``--pure`` Q4_0 with
Q8_0 / Q4_0 token embeddings (the types of qcompiler's ``gptq-q4_0`` rows), and qcompiler's
``auto-gguf:B`` is made at the bits per weight of llama.cpp's Q4_K_M block tensors, its token
embeddings in the type llama.cpp chose for them. This model's FP copy is dequantized from a Q4_K_M
file, so llama.cpp's Q4_K_M of it lands back on the grid the weights came from (nearly lossless);
its Q4_0 rows are the like-for-like comparison. Writes benchmarks/results/real_gguf.json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf_quality import llama_tool
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


def _block_bits(path) -> tuple[float, str]:
    """(bits per weight of the file's quantized block tensors, the token embeddings' type)."""
    bits = n = 0
    embedding = "f16"
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.name == "token_embd.weight":
            embedding = t.tensor_type.name.lower()
        elif t.tensor_type.name not in ("F16", "F32", "BF16"):
            bits, n = bits + int(t.n_bytes) * 8, n + int(t.n_elements)
    return bits / n, embedding


def llama_cpp_peer(m, calibration, bin_dir: Path, out: Path, add, pure_embeddings=()) -> tuple[float, str]:
    """llama.cpp's Q4_K_M of the FP model, and its ``--pure`` Q4_0 with each of ``pure_embeddings``
    as the token embeddings' type, each with and without an imatrix from the calibration text,
    added as rows; returns the Q4_K_M file's block tensors' bits per weight and token-embedding type."""
    start = time.perf_counter()
    fp = qc.compile(m.model, m.example_inputs(), recipe="none", backend="eager")
    fp.export_gguf(out / "f16.gguf", progress=lambda s: None)
    text = "".join(m.tokenizer.decode(batch["input_ids"][0, 1:].tolist()) for batch in calibration)
    (out / "calibration.txt").write_text(text)
    chunks = ("--chunks", len(calibration))
    imatrix = ("-m", out / "f16.gguf", "-f", out / "calibration.txt", "-o", out / "imatrix.gguf", "-c", 256, *chunks)
    llama_tool(bin_dir, "llama-imatrix", *imatrix, "-t", 2)
    prepared = time.perf_counter() - start
    mix = None
    for kind, embedding in (("Q4_K_M", None), *(("Q4_0", e) for e in pure_embeddings)):
        for with_imatrix in (False, True):
            start = time.perf_counter()
            path = out / f"llamacpp-{kind}-{embedding}{'-imatrix' if with_imatrix else ''}.gguf"
            extra = ("--imatrix", out / "imatrix.gguf") if with_imatrix else ()
            extra += ("--pure", "--token-embedding-type", embedding) if embedding else ()
            llama_tool(bin_dir, "llama-quantize", *extra, out / "f16.gguf", path, kind, 2)
            seconds = time.perf_counter() - start + (prepared if with_imatrix else 0.0)
            bits, stored_embedding = _block_bits(path)
            add(f"llama.cpp {kind}" + (" + imatrix" if with_imatrix else ""), stored_embedding, path, seconds)
            mix = mix or (bits, stored_embedding)
    return mix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="*", default=["rtn-q8_0", "rtn-q4_0"])
    parser.add_argument("--embeddings", nargs="+", default=["f16", "q8_0", "q4_0"])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--calibration", type=int, default=8, help="256-token calibration windows (GPTQ)")
    parser.add_argument("--update", action="store_true", help="merge these rows into the committed file")
    parser.add_argument("--out", default="/tmp/real_gguf")
    parser.add_argument("--llama-cpp-bin", type=Path, help="folder with llama-quantize and llama-imatrix (peer rows)")
    parser.add_argument(
        "--llama-cpp-q4-0",
        nargs="*",
        default=["q8_0", "q4_0"],
        help="token-embedding types of llama.cpp's pure Q4_0 rows",
    )
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
    recipes = [(recipe, args.embeddings) for recipe in args.recipes]
    if args.llama_cpp_bin is not None:
        bits, embedding = llama_cpp_peer(m, calibration, args.llama_cpp_bin, out, add, args.llama_cpp_q4_0)
        recipes.append((f"auto-gguf:{bits:.4f}", [embedding]))
    for recipe, embeddings in recipes:
        start = time.perf_counter()
        calib = calibration if recipe.startswith(("gptq", "auto")) else None
        cm = qc.compile(m.model, m.example_inputs(), recipe=recipe, calibration=calib, backend="eager")
        seconds = time.perf_counter() - start
        for embedding in embeddings:
            path = out / f"{recipe.replace(':', '_')}-{embedding}.gguf"
            cm.export_gguf(path, token_embedding=None if embedding == "f16" else embedding, progress=lambda s: None)
            add(f"qcompiler {recipe}", embedding, path, seconds)
    if args.update:
        rows = merged_rows("real_gguf", rows, key=("file", "token_embedding"))
    print("wrote", write_rows("real_gguf", rows, windows=args.windows, window_tokens=256))


if __name__ == "__main__":
    main()
