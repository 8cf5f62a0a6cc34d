"""The conformance matrix: every architecture × recipe × real client either generates our tokens or
is refused with one line naming the limit.

Architectures (random weights at sizes the clients run, ``causal_lms.client_sized_lm``) × recipes ×
clients, each client reading the format it loads: transformers + compressed-tensors (fp32),
vLLM CPU + compressed-tensors (bf16), GPTQModel + GPTQ v2 (bf16), onnxruntime-genai + its ONNX
folder (fp32). A cell passes when the client's greedy tokens, fed back through our fp32 graph, are
each our top token or within ``MARGIN[client]`` × that position's logit standard deviation of it,
and at least ``EXACT[client]`` of them are exactly ours; a cell our export refuses must be refused
with the line ``REFUSED`` names, and a cell a client cannot run (``CLIENT_LIMITS``) must fail in that
client with the message named there — so when a client learns a case, this test says so.

vLLM and GPTQModel run in their own venvs (``QC_VLLM_PYTHON``, ``QC_GPTQMODEL_PYTHON``, built by
`.ci/run`), one process each for the whole matrix; without one, its cells are skipped and say why,
as are vLLM's where its CPU build lacks the int4 GEMM (it ships ``cpu_gemm_wna16`` for AVX-512 only:
on an AVX2 CPU its engine dies on the first int4 cell and leaves the rest without memory).
docs/formats.md "Which client runs what" is this table in prose.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest
import torch
from causal_lms import client_sized_lm

import qcompiler as qc
from qcompiler.interop import ExportError, export_compressed_tensors, export_gptq, export_onnx_genai

ARCHS = ["llama", "llama-tied", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "gpt2", "opt", "mixtral", "qwen2_moe"]
RECIPES = ["gptq-w4g128", "gptq-w4g128-sym", "gptq-w4g128-act", "w8a8-smoothquant", "spqr-w4g16"]
CLIENTS = ["transformers", "vllm", "gptqmodel", "genai"]
NEW_TOKENS = 32
PROMPT = [5, 17, 42, 99, 128, 200, 7, 64]

# a token within MARGIN x std(logits) of our top one counts as a near-tie of the client's precision:
# fp32 clients agree to rounding, bf16 ones to bf16's; W8A8 activations round per token, where a
# last-bit difference before rounding moves a code (measured up to 0.018 std in fp32 clients)
MARGIN = {"transformers": 1e-3, "genai": 1e-3, "vllm": 0.1, "gptqmodel": 0.1}
W8A8_MARGIN = 0.05
EXACT = {"transformers": 1.0, "genai": 1.0, "vllm": 0.75, "gptqmodel": 0.75}
W8A8_EXACT = 0.9
EOS = 2  # onnxruntime-genai always stops there: its shorter outputs end with it

# CI's tier runs a cover of the matrix: every architecture, recipe, client, refusal and client limit
# at least once (the test checks that it is one); the whole product runs before a release
# (scripts/release_check.sh, `pytest -m release`).
COVER = [
    ("llama", "gptq-w4g128"),
    ("llama-tied", "gptq-w4g128-sym"),
    ("qwen2", "gptq-w4g128-act"),
    ("qwen3", "w8a8-smoothquant"),
    ("mistral", "spqr-w4g16"),
    ("gemma2", "gptq-w4g128-act"),
    ("phi3", "w8a8-smoothquant"),
    ("gpt2", "gptq-w4g128"),
    ("opt", "gptq-w4g128-sym"),
    ("mixtral", "w8a8-smoothquant"),
    ("qwen2_moe", "gptq-w4g128-act"),
]

_FORMAT = {
    "transformers": "compressed-tensors",
    "vllm": "compressed-tensors",
    "gptqmodel": "gptq",
    "genai": "onnx-genai",
}

# (arch regex, recipe regex, client regex) -> the one line our export refuses with; the first match counts
_CONV1D = r"quantized Conv1D layer \(gpt2\)"
_MOE_SMOOTHING = r"SmoothQuant scales are applied inside the activation quantizer"
_G_IDX = r"act-order with scattered groups \(g_idx\) has no compressed-tensors"
_CT_SPQR = r"qc\.spqr_dense_linear: compressed-tensors cannot express it"
_ONLY_WEIGHT_ONLY = r"the GPTQ format holds only weight-only"
REFUSED = {
    (".*", "spqr.*", "transformers|vllm"): _CT_SPQR,
    ("gpt2", ".*", "transformers|vllm"): _CONV1D,
    ("mixtral|qwen2_moe", "w8a8.*", "transformers|vllm"): _MOE_SMOOTHING,
    (".*", "spqr.*|w8a8.*", "gptqmodel"): _ONLY_WEIGHT_ONLY,
    # (Qwen2-MoE here has one group per row everywhere, so act-order leaves no scattered group)
    ("(?!qwen2_moe).*", "gptq-w4g128-act", "transformers|vllm"): _G_IDX,
}

# (arch regex, recipe regex, client regex) -> what the client itself says when it cannot run the cell
CLIENT_LIMITS = {
    # compressed-tensors 0.20.1 builds the model's empty layers with the zero point unpacked, then
    # refuses the packed one every asymmetric pack-quantized checkpoint has (llm-compressor's too)
    # (through the MoE conversion: "issues during automatic conversion of the weights")
    (
        ".*",
        "gptq-w4g128|gptq-w4g128-act",
        "transformers",
    ): r"ignore_mismatched_sizes|automatic conversion of the weights",
    # vLLM's CPU build has a 4-bit GEMM for linears but no kernel for 4-bit experts
    ("mixtral|qwen2_moe", "gptq.*", "vllm"): r"No WNA16 MoE backend supports the deployment configuration",
}


def _match(table: dict, arch: str, recipe: str, client: str):
    for (a, r, c), value in table.items():
        if re.fullmatch(a, arch) and re.fullmatch(r, recipe) and re.fullmatch(c, client):
            return value
    return None


@cache
def _root() -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix="qc-conformance-"))


@cache
def quantized(arch: str, recipe: str):
    """The compiled model and, per format, the exported folder or the refusal."""
    model = client_sized_lm(arch.removesuffix("-tied"), tied=arch.endswith("-tied"))
    calibration = [{"input_ids": torch.randint(3, 256, (4, 64), generator=torch.Generator().manual_seed(1))}]
    prompt = torch.tensor([PROMPT])
    cm = qc.compile(model, {"input_ids": prompt}, recipe=recipe, calibration=calibration, progress=False)
    exports = {}
    for fmt, write, kwargs in (
        ("compressed-tensors", export_compressed_tensors, {}),
        ("gptq", export_gptq, {"zero_format": "v2"}),  # GPTQModel refuses other quantizers' v1 asym zeros
        ("onnx-genai", export_onnx_genai, {"accuracy_level": 0}),
    ):
        folder = _root() / arch / recipe / fmt
        try:
            write(cm, folder, progress=lambda _m: None, **kwargs)
            exports[fmt] = folder
        except ExportError as e:
            exports[fmt] = e
    return cm, exports


def _runnable(client: str, cells: tuple) -> list[Path]:
    """The folders ``client`` reads: each cell's export in its format that was written."""
    targets = [quantized(a, r)[1][_FORMAT[client]] for a, r in cells]
    return [t for t in targets if isinstance(t, Path)]


_VLLM = textwrap.dedent("""
    import gc, json, sys

    def main():
        import torch
        import vllm._custom_ops  # noqa: F401  (the kernel library built for this CPU)
        from vllm import LLM, SamplingParams
        if not hasattr(torch.ops._C, "cpu_gemm_wna16"):  # its engine would die on the first int4 cell
            print("RESULT" + json.dumps({"unable": "this vLLM CPU build has no 4-bit GEMM (cpu_gemm_wna16) "
                                                   "for this CPU: it ships it for AVX-512 only"}))
            return
        results = {}
        for job in json.loads(open(sys.argv[1]).read()):
            try:
                llm = LLM(model=job["folder"], dtype="bfloat16", max_model_len=64, enforce_eager=True,
                          gpu_memory_utilization=0.05, distributed_executor_backend="uni")
                params = SamplingParams(temperature=0.0, max_tokens=job["new"], ignore_eos=True)
                out = llm.generate([{"prompt_token_ids": job["prompt"]}], params)
                results[job["folder"]] = {"tokens": list(out[0].outputs[0].token_ids)}
                del llm
            except Exception as e:
                results[job["folder"]] = {"error": f"{type(e).__name__}: {e}"}
            gc.collect()
        print("RESULT" + json.dumps(results))

    if __name__ == "__main__":
        main()
""")

_GPTQMODEL = textwrap.dedent("""
    import json, sys, torch
    from gptqmodel import BACKEND, GPTQModel
    results = {}
    for job in json.loads(open(sys.argv[1]).read()):
        try:
            model = GPTQModel.load(job["folder"], backend=BACKEND.GPTQ_TORCH, device="cpu", dtype=torch.bfloat16)
            model.model.generation_config.eos_token_id = None
            ids = torch.tensor([job["prompt"]])
            out = model.generate(input_ids=ids, max_new_tokens=job["new"], do_sample=False)
            results[job["folder"]] = {"tokens": out[0, len(job["prompt"]):].tolist()}
        except Exception as e:
            results[job["folder"]] = {"error": f"{type(e).__name__}: {e}"}
    print("RESULT" + json.dumps(results))
""")


def _in_venv(python: str, script: str, jobs: list[Path]) -> dict[str, dict]:
    work = _root() / f"client-{abs(hash(script))}"
    work.mkdir(exist_ok=True)
    (work / "client.py").write_text(script)
    (work / "jobs.json").write_text(json.dumps([{"folder": str(f), "prompt": PROMPT, "new": NEW_TOKENS} for f in jobs]))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run(
        [python, "client.py", "jobs.json"], capture_output=True, text=True, timeout=1800, cwd=work, env=env
    )
    assert done.returncode == 0 and "RESULT" in done.stdout, done.stderr[-3000:]
    return json.loads(done.stdout.split("RESULT", 1)[1].splitlines()[0])


def _transformers(folder: Path) -> dict:
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
        return {"tokens": out[0, len(PROMPT) :].tolist()}
    except Exception as e:  # the client's own failure is the cell's outcome
        return {"error": f"{type(e).__name__}: {e}"}


def _genai(folder: Path) -> dict:
    from client_runtimes import genai_tokens

    try:
        return {"tokens": genai_tokens(folder, PROMPT, NEW_TOKENS)}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


@cache
def client_results(client: str, cells: tuple) -> dict[str, dict]:
    """The client's outcome for every cell it can load, in one process for all the cells."""
    folders = _runnable(client, cells)
    if client == "vllm":
        return _in_venv(os.environ["QC_VLLM_PYTHON"], _VLLM, folders)
    if client == "gptqmodel":
        return _in_venv(os.environ["QC_GPTQMODEL_PYTHON"], _GPTQMODEL, folders)
    run = _transformers if client == "transformers" else _genai
    return {str(f): run(f) for f in folders}


def judge(cm, theirs: list[int]) -> tuple[float, int]:
    """(the largest gap, in logit standard deviations, between our top token and the client's, with
    the client's own tokens fed back; how many of its tokens are our top token)."""
    logits = cm(input_ids=torch.tensor([PROMPT + theirs])).logits[0, len(PROMPT) - 1 : -1].float()
    gap = logits.max(-1).values - logits.gather(1, torch.tensor(theirs)[:, None])[:, 0]
    return float((gap / logits.std(-1)).max()), int((gap == 0).sum())


_VENV = {"vllm": "QC_VLLM_PYTHON", "gptqmodel": "QC_GPTQMODEL_PYTHON"}


def cell_outcome(arch: str, recipe: str, client: str, cells: tuple) -> str | None:
    """None when the cell holds (or is refused / limited as the tables say); else what is wrong."""
    cm, exports = quantized(arch, recipe)
    target = exports[_FORMAT[client]]
    refused = _match(REFUSED, arch, recipe, client)
    if refused is not None:
        if not isinstance(target, ExportError):
            return f"expected a refusal matching {refused!r}; the export was written"
        if not re.search(refused, str(target)) or "\n" in str(target):
            return f"refused otherwise: {target}"
        return None
    if not isinstance(target, Path):
        return f"refused unexpectedly: {target}"
    outcome = client_results(client, cells)[str(target)]
    limit = _match(CLIENT_LIMITS, arch, recipe, client)
    if limit is not None:
        if "error" in outcome and re.search(limit, outcome["error"]):
            return None
        return f"the client's known limit {limit!r} no longer holds: {str(outcome)[-300:]}"
    if "error" in outcome:
        return outcome["error"][-400:]
    theirs = outcome["tokens"]
    if len(theirs) != NEW_TOKENS and not (client == "genai" and theirs and theirs[-1] == EOS):
        return f"{len(theirs)} tokens"
    worst, exact = judge(cm, theirs)
    w8a8 = recipe.startswith("w8a8")
    margin = max(MARGIN[client], W8A8_MARGIN) if w8a8 else MARGIN[client]
    least = min(EXACT[client], W8A8_EXACT) if w8a8 else EXACT[client]
    if worst > margin or exact < least * len(theirs):
        return f"a token {worst:.3g} std below our top one (margin {margin}), {exact}/{len(theirs)} ours"
    return None


def test_the_cover_reaches_every_architecture_recipe_refusal_and_client_limit():
    assert {a for a, _ in COVER} == set(ARCHS) and {r for _, r in COVER} == set(RECIPES)
    for table in (REFUSED, CLIENT_LIMITS):
        for key in table:
            hit = [(a, r, c) for a, r in COVER for c in CLIENTS if _match({key: 1}, a, r, c)]
            first = [cell for cell in hit if _match(table, *cell) == table[key]]  # the first match counts
            assert first, f"no cell of COVER reaches {key}"


@pytest.mark.parametrize(
    "cells",
    [
        pytest.param(tuple(COVER), id="cover", marks=pytest.mark.slow),
        pytest.param(tuple((a, r) for a in ARCHS for r in RECIPES), id="full", marks=pytest.mark.release),
    ],
)
def test_every_cell_generates_our_tokens_or_is_refused_with_the_reason(cells):
    """One test for all the cells: the venv clients run once each, beside the in-process ones."""
    clients = [c for c in CLIENTS if c not in _VENV or os.environ.get(_VENV[c])]
    for arch, recipe in cells:
        quantized(arch, recipe)
    with ThreadPoolExecutor(len(clients)) as pool:  # subprocesses and torch ops: they overlap
        results = dict(zip(clients, pool.map(client_results, clients, [cells] * len(clients))))
    unable = {c: r["unable"] for c, r in results.items() if "unable" in r}  # a client that cannot run here
    clients = [c for c in clients if c not in unable]
    failures = {}
    for arch, recipe in cells:
        for client in clients:
            wrong = cell_outcome(arch, recipe, client, cells)
            if wrong is not None:
                failures[f"{arch} / {recipe} / {client}"] = wrong
    assert not failures, "\n".join(f"{cell}: {why}" for cell, why in failures.items())
    skipped = {c: unable.get(c, f"set {_VENV.get(c)}, .ci/run builds it") for c in CLIENTS if c not in clients}
    if skipped:
        pytest.skip(f"every other cell holds; not run: {skipped}")
