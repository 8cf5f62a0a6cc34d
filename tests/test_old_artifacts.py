"""Artifacts saved before a refactor still load and compute the same logits.

``tests/data/artifacts_before_layouts/`` holds one tiny artifact per storage layout (GPTQ, a
llama.cpp grid, SpQR, int8, and the GPTQ and SpQR experts ops of a Mixtral), saved by qcompiler at
commit 3cbcb9e — before storage layouts moved into ``qcompiler/layouts/`` — with the logits the
code of that commit computed from them on one thread (bit-identity holds at equal threads: a
Mixtral's expert matmuls round differently on two). On the CPU kind that saved them (AMD EPYC, AVX2)
they are bit-identical; on another kind the BLAS may order a small matmul's sums differently (an
AMX Xeon moved 45 of the Mixtral's 768 logits by one float32 step, 4.5e-8 at a largest logit of 0.51),
so the logits must agree within 2^-20 of the largest one: eight float32 steps, a million times
below what a wrong scale, code order or transposed tensor moves. A user's saved model must survive
the code moving around it."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import qcompiler as qc

DATA = Path(__file__).parent / "data" / "artifacts_before_layouts"
SAVED = sorted(p.name for p in DATA.iterdir() if p.is_dir())
OPS = {
    "llama-rtn-w4g128": {"quant_linear"},
    "llama-gptq-q4_1": {"gguf_linear"},
    "llama-spqr-w3g16": {"spqr_dense_linear", "sparse_outlier_linear"},
    "llama-w8a8": {"int8_linear"},
    "mixtral-rtn-w4g128": {"quant_linear", "quant_experts_linear"},
    "mixtral-spqr-w3g16": {"spqr_dense_linear", "sparse_outlier_linear", "spqr_experts_linear"},
}


def test_every_layout_has_a_saved_artifact():
    assert SAVED == sorted(OPS)


@pytest.mark.parametrize("name", SAVED)
def test_an_artifact_saved_before_the_layouts_room_computes_the_saved_logits(name):
    cm = qc.load(DATA / name)
    ops = {
        n.target._schema.name.split("::")[-1]
        for n in cm.graph_module.graph.nodes
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "qc"
    }
    assert ops == OPS[name]
    expected = load_file(str(DATA / f"{name}.expected.safetensors"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            logits = cm(input_ids=expected["input_ids"]).logits
    finally:
        torch.set_num_threads(threads)
    reference = expected["logits"]
    assert (logits - reference).abs().max() <= 2**-20 * reference.abs().max()
