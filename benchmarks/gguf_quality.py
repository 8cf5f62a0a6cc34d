"""GGUF files in llama.cpp: qcompiler's GPTQ on llama.cpp's own block grids vs llama.cpp's own
quantization of the same model to the same type, with and without an importance matrix.

    python benchmarks/gguf_quality.py --llama-cpp-bin BUILD/bin          (~12 min on 2 cores)
    python benchmarks/gguf_quality.py --llama-cpp-bin BUILD/bin --models longlm --update   (one model's rows)
    python benchmarks/gguf_quality.py --llama-cpp-bin BUILD/bin --types q4_k --update     (one type's rows)

Per model (the bundled tinylm and longlm, and a random-weight LLaMA of width 512 saved to a
temporary folder):
qcompiler writes the F16 file (recipe ``none``); llama.cpp's ``llama-imatrix`` computes an
importance matrix from the calibration text (the same 128 x 256 windows qcompiler calibrates on,
as text) and ``llama-quantize --pure`` quantizes the F16 file to each type, with and without it,
embeddings and output head kept F16 as in qcompiler's files (so every file has the same bits per
weight, counted from the tensors stored). qcompiler's rows are ``gptq-TYPE`` and ``rtn-TYPE``.
Every file is then run by llama-cpp-python: perplexity over disjoint 256-token held-out windows
(from its logits), next-token KL to the F16 file's logits, and decode tokens/s (128 greedy tokens after
a 32-token prompt; each round times every file once, median of 5 rounds and the spread).

``BUILD/bin``: llama.cpp's tools built from the llama-cpp-python sdist's vendor/llama.cpp
(``cmake -S vendor/llama.cpp -B BUILD -DLLAMA_CURL=OFF && cmake --build BUILD --target llama-quantize
llama-imatrix``). Writes benchmarks/results/gguf.json; docs/results.md quotes it.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from results_file import merged_rows, write_rows

import qcompiler as qc
from qcompiler import models

# A K type on a width that is not a multiple of 256 falls back per tensor: llama-quantize Q4_K / Q5_K / Q6_K /
# Q3_K, Q2_K to Q5_0 / Q5_1 / Q8_0 / Q4_0, qcompiler to Q4_1 / Q5_1 / Q8_0 / Q4_0 (the bits-per-weight columns count
# what each file stores).
TYPES = {
    "q4_0": "Q4_0",
    "q4_1": "Q4_1",
    "q8_0": "Q8_0",
    "q4_k": "Q4_K",
    "q5_k": "Q5_K",
    "q6_k": "Q6_K",
    "q3_k": "Q3_K",
    "q2_k": "Q2_K",
    # llama.cpp's own mix (Q4_K, with Q6_K for half the V and down projections by a fixed rule; no --pure) vs
    # qcompiler's auto-gguf:B at the bits per weight of llama.cpp's file (each tensor's type from measured
    # sensitivities)
    "q4_k_m": "Q4_K_M",
}
MIXES = {"q4_k_m"}
MODELS = {"tinylm": "tinylm", "longlm": "longlm", "llama-random-512": None}  # label: bundled name (None: random)


def _random_llama(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=512,
        intermediate_size=1536,  # a multiple of 256: Q4_K holds every linear
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _bits_per_weight(path: Path) -> tuple[float, float]:
    """(bits per weight of the quantized block tensors, of the whole file's tensors)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    q_bits = q_n = all_bits = all_n = 0
    for t in reader.tensors:
        n, bits = int(t.n_elements), int(t.n_bytes) * 8
        all_bits, all_n = all_bits + bits, all_n + n
        if t.tensor_type.name not in ("F16", "F32"):
            q_bits, q_n = q_bits + bits, q_n + n
    return (q_bits / q_n if q_n else 16.0), all_bits / all_n


def _llama_cpp_model(llama_cpp, path: Path):
    return llama_cpp.Llama(model_path=str(path), n_ctx=512, logits_all=True, verbose=False, n_threads=2)


def _run(llm, windows: list[list[int]], reference) -> dict:
    nll = count = 0.0
    logps = []
    for w in windows:
        llm.reset()
        llm.eval(w)
        logits = torch.tensor(np.array(llm.scores[: len(w)]), dtype=torch.float64)
        logp = torch.log_softmax(logits, -1)
        logps.append(logp[:-1])
        nll += -logp[:-1].gather(-1, torch.tensor(w[1:])[:, None]).sum().item()
        count += len(w) - 1
    logp = torch.cat(logps)
    kl = None if reference is None else float((reference.exp() * (reference - logp)).sum(-1).mean())
    return {"perplexity": float(np.exp(nll / count)), "kl": kl, "logp": logp}


def _decode_rate(llm, prompt: list[int], n: int = 128) -> float:
    llm.reset()
    llm.eval(prompt)
    start = time.perf_counter()
    for _ in range(n):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    return n / (time.perf_counter() - start)


def llama_tool(bin_dir: Path, name: str, *args) -> None:
    """Run llama.cpp's tool ``name`` from ``bin_dir`` (its output kept off the terminal; a failure raises)."""
    subprocess.run([str(bin_dir / name), *map(str, args)], check=True, capture_output=True)


def bench_model(label, loaded, work: Path, bin_dir: Path, calib: int, n_windows: int, reps: int, types) -> list[dict]:
    import llama_cpp

    quiet = dict(progress=lambda s: None)
    windows_cal = loaded.calibration(calib, 256, batch_size=8)
    text = b"".join(bytes(w.tolist()) for batch in windows_cal for w in batch["input_ids"])
    (work / "calib.txt").write_bytes(text)
    files = {}
    fp = qc.compile(loaded.model, loaded.example_inputs(), recipe="none", backend="eager")
    fp.export_gguf(work / "f16.gguf", **quiet)
    files["F16 (qcompiler)"] = ("F16", work / "f16.gguf")
    llama_tool(
        bin_dir,
        "llama-imatrix",
        "-m",
        work / "f16.gguf",
        "-f",
        work / "calib.txt",
        "-o",
        work / "imatrix.gguf",
        "-c",
        256,
        "--chunks",
        calib,
        "-t",
        2,
    )
    for kind in types:
        name = TYPES[kind]
        for imatrix in (False, True):
            out = work / f"llamacpp-{kind}{'-imatrix' if imatrix else ''}.gguf"
            extra = ["--imatrix", work / "imatrix.gguf"] if imatrix else []
            extra += [] if kind in MIXES else ["--pure"]
            llama_tool(
                bin_dir,
                "llama-quantize",
                *extra,
                "--token-embedding-type",
                "f16",
                "--output-tensor-type",
                "f16",
                work / "f16.gguf",
                out,
                name,
                2,
            )
            files[f"llama.cpp {name}" + (" + imatrix" if imatrix else "")] = (name, out)
        if kind in MIXES:  # the same bits per weight as llama.cpp's mix, chosen per tensor
            bpw = _bits_per_weight(out)[0]
            recipe = f"auto-gguf:{bpw:.4f}"
            cm = qc.compile(
                loaded.model, loaded.example_inputs(), recipe=recipe, calibration=windows_cal, backend="eager"
            )
            cm.export_gguf(work / "auto-gguf.gguf", **quiet)
            files[f"qcompiler {recipe}"] = (name, work / "auto-gguf.gguf")
            continue
        for method in ("rtn", "gptq"):
            recipe = f"{method}-{kind}"
            cm = qc.compile(
                loaded.model,
                loaded.example_inputs(),
                recipe=recipe,
                calibration=windows_cal if method == "gptq" else None,
                backend="eager",
            )
            cm.export_gguf(work / f"{recipe}.gguf", **quiet)
            files[f"qcompiler {recipe}"] = (name, work / f"{recipe}.gguf")
            print(f"  {label}: {recipe} written", file=sys.stderr)
    held = loaded.tokens("heldout").reshape(-1)
    windows = [held[i * 256 : (i + 1) * 256].tolist() for i in range(n_windows)]
    runners = {row_name: _llama_cpp_model(llama_cpp, path) for row_name, (_, path) in files.items()}
    reference = _run(runners["F16 (qcompiler)"], windows, None)["logp"]
    rows = []
    for row_name, (qtype, path) in files.items():
        r = _run(runners[row_name], windows, reference)
        q_bpw, file_bpw = _bits_per_weight(path)
        rows.append(
            {
                "model": label,
                "file": row_name,
                "type": qtype,
                "bytes": path.stat().st_size,
                "bpw_quantized": round(q_bpw, 4),
                "bpw_file": round(file_bpw, 4),
                "perplexity": round(r["perplexity"], 5),
                "kl_to_f16": None if r["kl"] is None else round(r["kl"], 7),
            }
        )
    # Decode speed: every file once per round, rounds repeated (the machine's drift hits all alike).
    rates = [[] for _ in runners]
    for _ in range(reps):
        for i, llm in enumerate(runners.values()):
            rates[i].append(_decode_rate(llm, held[:32].tolist()))
    for row, r in zip(rows, rates):
        row["decode_tok_s"] = round(statistics.median(r), 1)
        row["decode_tok_s_spread"] = [round(min(r), 1), round(max(r), 1)]
        print(
            f"{label:16} {row['file']:26} {row['bpw_quantized']:5.2f} bpw  ppl {row['perplexity']:8.4f}  "
            f"KL {row['kl_to_f16'] or 0:.6f}  {row['decode_tok_s']:7.1f} tok/s ({row['decode_tok_s_spread'][0]}-"
            f"{row['decode_tok_s_spread'][1]})"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp-bin", type=Path, required=True, help="folder with llama-quantize and llama-imatrix")
    ap.add_argument("--calib", type=int, default=128, help="calibration windows of 256 tokens")
    ap.add_argument("--windows", type=int, default=64, help="held-out windows of 256 tokens")
    ap.add_argument("--reps", type=int, default=5, help="decode-speed repeats")
    ap.add_argument("--quick", action="store_true", help="write under results/quick/ (a check of the script)")
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    ap.add_argument("--types", nargs="+", choices=sorted(TYPES), default=list(TYPES))
    ap.add_argument("--update", action="store_true", help="replace these models' rows in the committed JSON")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for label in args.models:
            source = MODELS[label]
            work = tmp / label
            work.mkdir()
            loaded = models.load(source or _random_llama(work / "hf"))
            rows += bench_model(
                label, loaded, work, args.llama_cpp_bin, args.calib, args.windows, args.reps, args.types
            )
    if args.update:
        rows = merged_rows("gguf", rows, key=("model", "file"))
    out = write_rows("gguf", rows, args.quick, calib_windows=args.calib, heldout_windows=args.windows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
