"""The GPTQ checkpoint export as GPTQModel (the maintained GPTQ loader, also behind transformers'
GPTQ support) loads it: same logits within bf16 rounding, our greedy tokens (up to bf16 near-ties).

GPTQModel declares a newer torch than the project's, so it lives in its own virtual environment
(`.ci/run` builds one; recipe in docs/formats.md) named by ``QC_GPTQMODEL_PYTHON``; without it the
test is skipped and says why.
"""

import json
import os
import textwrap

import pytest
import torch
from client_runtimes import greedy_gaps, quantized_tinylm, run_client

import qcompiler as qc
from qcompiler.interop import export_gptq

GPTQMODEL_PYTHON = os.environ.get("QC_GPTQMODEL_PYTHON")

_CLIENT = textwrap.dedent("""
    import json, sys, torch
    from gptqmodel import BACKEND, GPTQModel
    folder, ids = sys.argv[1], torch.tensor(json.loads(sys.argv[2]))
    model = GPTQModel.load(folder, backend=BACKEND.GPTQ_TORCH, device="cpu", dtype=torch.bfloat16)
    kernels = {}
    for m in model.model.modules():
        if "Linear" in type(m).__name__:
            kernels[type(m).__name__] = kernels.get(type(m).__name__, 0) + 1
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    out = model.generate(input_ids=ids, max_new_tokens=16, do_sample=False)
    torch.save(logits, folder + "/client_logits.pt")
    print("RESULT" + json.dumps({"tokens": out.tolist(), "kernels": kernels}))
""")


# A mixed-precision plan (what auto:B makes): 8, 4 and 3 bits, groups 128 and 64, written with
# GPTQModel's per-module ``dynamic`` overrides.
MIXED = [
    qc.passes.MixedPrecision(
        plan=(
            ("model.layers.0.mlp.down_proj", "gptq-w8g128"),
            ("model.layers.1.self_attn.q_proj", "gptq-w3g64"),
            ("model.layers.2.mlp.gate_proj", "gptq-w3g128"),
        ),
        default="gptq-w4g128",
    )
]


@pytest.mark.slow
@pytest.mark.skipif(not GPTQMODEL_PYTHON, reason="set QC_GPTQMODEL_PYTHON to a python with gptqmodel (see .ci/run)")
@pytest.mark.parametrize(
    "recipe",  # plain 4-bit: the conformance cover's llama / gptq-w4g128 / gptqmodel cell and [mixed] cover it
    [pytest.param("gptq-w4g128", id="w4g128", marks=pytest.mark.release), pytest.param(MIXED, id="mixed")],
)
def test_gptqmodel_loads_the_export_with_the_same_outputs(tmp_path, recipe):
    tinylm, cm = quantized_tinylm(recipe)
    # GPTQModel refuses asymmetric checkpoints in the v1 zero-point format from other quantizers
    # (an old AutoGPTQ bug), so asymmetric grids travel as v2 (real zero points).
    export_gptq(cm, tmp_path / "ckpt", zero_format="v2", progress=lambda _m: None)
    ids = tinylm.encode("def parse(self, text):\n    return")
    result = run_client(GPTQMODEL_PYTHON, _CLIENT, tmp_path / "ckpt", json.dumps(ids.tolist()), timeout=600)
    # its own GPTQ kernel for all 28 block linears; lm_head stays a plain Linear (not quantized)
    assert result["kernels"] == {"TorchLinear": 28, "Linear": 1}, result["kernels"]
    ours = cm(input_ids=ids).logits
    theirs = torch.load(tmp_path / "ckpt" / "client_logits.pt", weights_only=True)
    rel = ((theirs - ours).norm() / ours.norm()).item()
    assert rel < 0.01, rel  # bf16 activations in GPTQModel: measured 0.003
    # its greedy tokens, fed back through our fp32 model: each our argmax or a bf16 near-tie
    prompt = ids[0].tolist()
    tokens = result["tokens"][0][len(prompt) :]
    gap = greedy_gaps(cm, prompt, tokens)
    assert len(tokens) == 16 and float(gap.max()) < 0.1, gap.tolist()
    assert int((gap == 0).sum()) >= 14, gap.tolist()  # measured: all 16


@pytest.mark.slow
@pytest.mark.skipif(not GPTQMODEL_PYTHON, reason="set QC_GPTQMODEL_PYTHON to a python with gptqmodel (see .ci/run)")
def test_gptqmodel_runs_gpt2s_conv1d_layers_from_the_export(tmp_path):
    """GPT-2 stores its linears as Conv1D ([in, out]); the GPTQ export packs them as GPTQModel's
    GPT-2 support expects (compressed-tensors refuses them: its loaders skip Conv1D)."""
    from causal_lms import calibration, causal_lm, prompt

    cm = qc.compile(
        causal_lm("gpt2"), {"input_ids": prompt()}, recipe="gptq-w4g128", calibration=calibration(), progress=False
    )
    export_gptq(cm, tmp_path / "ckpt", zero_format="v2", progress=lambda _m: None)
    ids = prompt(1, 8)
    result = run_client(GPTQMODEL_PYTHON, _CLIENT, tmp_path / "ckpt", json.dumps(ids.tolist()), timeout=600)
    assert result["kernels"] == {"TorchLinear": 8, "Linear": 1}, result["kernels"]  # 2 blocks x 4 Conv1D
    ours = cm(input_ids=ids).logits
    theirs = torch.load(tmp_path / "ckpt" / "client_logits.pt", weights_only=True)
    assert ((theirs - ours).norm() / ours.norm()).item() < 0.01  # bf16 activations: measured 0.006


@pytest.mark.slow
@pytest.mark.skipif(not GPTQMODEL_PYTHON, reason="set QC_GPTQMODEL_PYTHON to a python with gptqmodel (see .ci/run)")
def test_gptqmodel_runs_phi3_with_its_fused_gate_up_split(tmp_path):
    """GPTQModel's Phi-3 reads gate_proj / up_proj ("Missing required quantized weights" for the
    fused gate_up_proj): the export writes the halves. A 256-token vocabulary gets the byte
    tokenizer, which GPTQModel insists on loading."""
    import transformers
    from causal_lms import calibration, config, prompt

    cfg = config("phi3")
    cfg.vocab_size = 256
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    cm = qc.compile(model, {"input_ids": prompt()}, recipe="gptq-w4g128", calibration=calibration(), progress=False)
    export_gptq(cm, tmp_path / "ckpt", zero_format="v2", progress=lambda _m: None)
    ids = prompt(1, 8)
    result = run_client(GPTQMODEL_PYTHON, _CLIENT, tmp_path / "ckpt", json.dumps(ids.tolist()), timeout=600)
    assert result["kernels"] == {"TorchLinear": 10, "Linear": 1}, result["kernels"]  # 2 x qkv, o, gate, up, down
    ours = cm(input_ids=ids).logits
    theirs = torch.load(tmp_path / "ckpt" / "client_logits.pt", weights_only=True)
    assert ((theirs - ours).norm() / ours.norm()).item() < 0.01  # bf16 activations: measured 0.0055
