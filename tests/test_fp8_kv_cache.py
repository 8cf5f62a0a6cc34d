"""The FP8 KV cache: calibrated per-tensor scales, the rounding compressed-tensors applies to keys and
values, the scales where its checkpoints keep them, and the graph with and without a cache."""

from __future__ import annotations

import json

import pytest
import torch
from causal_lms import calibration, causal_lm, prompt
from tiny_models import example_inputs, make_model

import qcompiler as qc
from qcompiler.algorithms.float_grid import round_to_element
from qcompiler.ir.op_registry import args_of, spec_of

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _inputs(seed=0):
    return {k: v for k, v in example_inputs("llama", 2, 9, seed=seed).items() if k != "use_cache"}


def _compile(recipe):
    calib = [example_inputs("llama", 4, 16, seed=s) for s in range(1, 4)]
    return qc.compile(make_model("llama"), example_inputs("llama"), recipe=recipe, calibration=calib, progress=False)


def _recorded_amax(model) -> dict[int, tuple[float, float]]:
    """max|k|, max|v| per layer over the calibration batches, as transformers' own attention
    receives them (post-rotary keys, before GQA's repeat)."""
    import transformers.models.llama.modeling_llama as llama

    original, seen = llama.ALL_ATTENTION_FUNCTIONS["sdpa"], {}

    def recording(module, query, key, value, *args, **kwargs):
        k, v = seen.get(module.layer_idx, (0.0, 0.0))
        seen[module.layer_idx] = (max(k, key.abs().max().item()), max(v, value.abs().max().item()))
        return original(module, query, key, value, *args, **kwargs)

    llama.ALL_ATTENTION_FUNCTIONS["sdpa"] = recording
    try:
        with torch.no_grad():
            for s in range(1, 4):
                model(**{k: v for k, v in example_inputs("llama", 4, 16, seed=s).items() if k != "use_cache"})
    finally:
        llama.ALL_ATTENTION_FUNCTIONS["sdpa"] = original
    return seen


def test_scales_are_the_calibrated_ranges_and_every_attention_reads_through_them():
    cm = _compile("fp8-kv")
    gm = cm.graph_module
    want = _recorded_amax(make_model("llama"))
    for node in (n for n in gm.graph.nodes if n.target is SDPA):
        k, v = node.args[1:3]
        assert spec_of(k).name == spec_of(v).name == "fp8_kv_quant"
    stored = dict(gm.named_parameters()) | dict(gm.named_buffers())
    for layer in range(2):
        for i, kind in enumerate("kv"):
            scale = stored[f"model.layers.{layer}.self_attn.{kind}_scale"]
            assert scale.item() == pytest.approx(want[layer][i] / 448, rel=1e-6)


def test_the_rounding_is_compressed_tensors_own_and_idempotent():
    """Keys rounded by the op equal compressed-tensors' fake quantization with the same static
    per-tensor scale (the FP8 KV cache scheme), bit for bit, and rounding twice changes nothing."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
    x = torch.randn(2, 4, 9, 16, generator=torch.Generator().manual_seed(3)) * 5
    scale = torch.tensor([x.abs().max().item() / 448 * 0.7])  # some values saturate
    ours = torch.ops.qc.fp8_kv_quant(x, scale)
    assert torch.equal(ours, fake_quantize(x, scale, None, args))
    assert torch.equal(torch.ops.qc.fp8_kv_quant(ours, scale), ours)
    assert torch.equal(ours, round_to_element(x / scale, "e4m3") * scale)


def test_the_checkpoint_holds_the_scales_where_compressed_tensors_reads_them(tmp_path):
    """``kv_cache_scheme`` parses as the library's QuantizationArgs (the FP8 tensor scheme llm-compressor
    writes), and each attention's ``k_scale`` / ``v_scale`` is a float32 [1] tensor beside its
    projections, equal to the graph's. (transformers 5.25 renamed the attention's ``past_key_values``
    argument to ``cache``; compressed-tensors 0.20 finds no cached attention there and ignores any
    checkpoint's kv_cache_scheme, so the library cannot run it in this environment: docs/formats.md.)"""
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    cm = _compile("fp8-dynamic-kv")
    cm.export("compressed-tensors", tmp_path / "ct")
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(config)
    kv = parsed.kv_cache_scheme
    assert (kv.num_bits, kv.type, kv.strategy, kv.symmetric, kv.dynamic) == (8, "float", "tensor", True, False)
    state = load_file(str(tmp_path / "ct" / "model.safetensors"))
    gm = cm.graph_module
    stored = {
        str(args_of(n).scale.target): args_of(n).tensor(gm, "scale")
        for n in gm.graph.nodes
        if spec_of(n) is not None and spec_of(n).name == "fp8_kv_quant"
    }
    assert len(stored) == 4
    for name, scale in stored.items():
        assert state[name].dtype == torch.float32 and state[name].shape == (1,)
        assert torch.equal(state[name], scale.float().reshape(1))


def test_prefill_and_decode_with_the_cache_read_the_same_fp8_keys(tmp_path):
    """A causal LM captured with its KV cache: generation (prefill, then one token at a time from
    the cache) gives the tokens of the full forward — the rounding is idempotent, so cached positions
    read the same values; the artifact reloads bit-identically; formats without a KV cache scale
    refuse it by name."""
    model = causal_lm("llama")
    cm = qc.compile(model, {"input_ids": prompt()}, recipe="fp8-kv", calibration=calibration(), progress=False)
    assert sum(1 for n in cm.graph_module.graph.nodes if spec_of(n) is not None) == 2 * model.config.num_hidden_layers
    ids = prompt(1, 6, seed=4)
    out = cm.generate(ids, max_new_tokens=6)
    with torch.no_grad():
        full = cm(input_ids=out[:, :-1]).logits[0, -6:].argmax(-1)
    assert torch.equal(out[0, 6:], full)
    cm.save(tmp_path / "a")
    with torch.no_grad():
        assert torch.equal(qc.load(tmp_path / "a")(input_ids=ids).logits, cm(input_ids=ids).logits)
    for fmt, words in (
        ("gptq", "FP8 KV cache"),
        ("gguf", "llama.cpp quantizes its own cache"),
        ("onnx", "not exported to ONNX"),
    ):
        with pytest.raises(Exception, match=words):
            cm.export(fmt, tmp_path / f"x.{fmt}")


_RUN_IN_CLIENT = """
import sys, torch, transformers
folder, inputs = sys.argv[1], torch.load(sys.argv[2])
model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
assert hasattr(model.model.layers[0].self_attn, "k_scale"), "the library registered no k_scale"
with torch.no_grad():
    torch.save(model(input_ids=inputs, use_cache=True).logits, sys.argv[3])
"""


@pytest.mark.slow
def test_transformers_with_a_kv_cache_quantizing_compressed_tensors_runs_it_like_the_graph(tmp_path):
    """In the vLLM venv (transformers 5.19, compressed-tensors 0.17, whose attention still takes
    ``past_key_values``), transformers loads the export, the library puts our ``k_scale`` / ``v_scale``
    on each attention and rounds keys and values through its KV cache hook: logits equal the graph's
    bit for bit, FP8 weights and activations included (measured also with transformers 5.17 and
    compressed-tensors 0.19, llm-compressor 0.14's pins)."""
    import os
    import subprocess

    python = os.environ.get("QC_VLLM_PYTHON")
    if not python:
        pytest.skip("QC_VLLM_PYTHON names no venv with transformers < 5.20 (.ci/client-venvs builds it)")
    cm = _compile("fp8-dynamic-kv")
    cm.export("compressed-tensors", tmp_path / "ct")
    ids = _inputs(5)["input_ids"]
    torch.save(ids, tmp_path / "ids.pt")
    (tmp_path / "client.py").write_text(_RUN_IN_CLIENT)
    done = subprocess.run(
        [python, str(tmp_path / "client.py"), str(tmp_path / "ct"), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "out.pt"), cm(input_ids=ids).logits)


def test_a_streamed_model_gets_its_scales_where_the_keys_are():
    """The command line streams weights from disk (placeholders on the meta device until read): the
    scales are made where the calibration ran, and the streamed compile equals the loaded one."""
    from qcompiler import models

    streamed, loaded = models.load("tinylm", stream=True), models.load("tinylm")
    calib = loaded.calibration(2, 64)
    cms = [
        qc.compile(m.model, m.example_inputs(), recipe="fp8-kv", calibration=calib, progress=False)
        for m in (streamed, loaded)
    ]
    ids = loaded.example_inputs()["input_ids"]
    with torch.no_grad():
        assert torch.equal(cms[0](input_ids=ids).logits, cms[1](input_ids=ids).logits)
