"""Causal LMs as users load them (use_cache=True): capture with the KV cache, generate, backends."""

import warnings

import onnx
import pytest
import torch
from causal_lms import ARCHITECTURES, calibration, causal_lm, prompt

import qcompiler as qc
from qcompiler.frontend import causal_lm as cache_graph
from qcompiler.generation import SamplingConfig

# The default suite runs four families (LLaMA-style GQA, GPT-2 Conv1D, Falcon, MoE); `pytest -m slow`
# (run by .ci/run) runs all thirteen.
FAST = {"llama", "gpt2", "falcon", "qwen2_moe"}
ARCH_PARAMS = [pytest.param(a, marks=() if a in FAST else pytest.mark.slow) for a in ARCHITECTURES]


class _Steps:
    """Wraps a runner to record the sequence length of every graph call."""

    def __init__(self, cm):
        self.inner, self.lengths = cm._runner, []
        cm._runner = self

    def __call__(self, **inputs):
        self.lengths.append((inputs["input_ids"].shape[1], inputs["past"][0].shape[2]))
        return self.inner(**inputs)


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_default_config_captures_and_generates_like_transformers(arch):
    model = causal_lm(arch)
    ids = prompt()
    fp = qc.compile(model, {"input_ids": ids}, recipe="none", progress=False)
    assert fp.cache_layout is not None
    reference = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(fp.generate(ids, 16), reference)  # token for token

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = qc.compile(model, {"input_ids": ids}, recipe="gptq-w4g128", calibration=calibration(), progress=False)
    steps = _Steps(q)
    out = q.generate(ids, 8)
    assert out.shape == (1, 14)
    # one prefill call over the prompt, then one call per token on a growing cache (no re-run of the prefix)
    assert steps.lengths == [(6, 0)] + [(1, 6 + i) for i in range(7)]
    fp_logits = fp(input_ids=ids).logits
    rel = ((q(input_ids=ids).logits - fp_logits).norm() / fp_logits.norm()).item()
    assert 0 < rel < 0.6, rel  # quantized (Falcon's linears too)
    quantized = [path for path in q.report.layer_table()]
    assert quantized, "no layer was quantized"
    if arch not in FAST:  # ORT export ~10 s each: the slow run covers every arch (MoE by default: test_moe_experts)
        ort = q.with_backend("onnxruntime", accuracy_level=0)
        assert torch.equal(ort.generate(ids, 8), out)  # same greedy tokens through ORT


def test_moe_router_stays_in_full_precision_with_a_note():
    model = causal_lm("qwen2_moe")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = qc.compile(model, {"input_ids": prompt()}, recipe="rtn-w4g128", progress=False)
    notes = " ".join(q.report.passes[0].notes)
    assert "model.layers.0.mlp.gate: kept in full precision (mixture-of-experts router)" in notes
    assert "model.layers.0.mlp.shared_expert_gate: kept in full precision" in notes
    paths = {row["layer"] for row in q.report.layer_table()}
    assert "model.layers.0.self_attn.q_proj" in paths and "model.layers.0.mlp.gate" not in paths


@pytest.fixture(scope="module")
def llama():
    return causal_lm("llama")


@pytest.fixture(scope="module")
def llama_w4(llama):
    return qc.compile(llama, {"input_ids": prompt()}, recipe="gptq-w4g128", calibration=calibration(), progress=False)


def _left_padded():
    a, b = prompt(1, 7, seed=3), prompt(1, 4, seed=4)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], 1)])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return (a, b), ids, mask


def test_a_left_padded_batch_generates_what_each_prompt_does_alone(llama):
    fp = qc.compile(llama, {"input_ids": prompt()}, recipe="none", progress=False)
    (a, b), ids, mask = _left_padded()
    batch = fp.generate(ids, 10, attention_mask=mask)
    assert torch.equal(batch[0, 7:], fp.generate(a, 10)[0, 7:])
    assert torch.equal(batch[1, 7:], fp.generate(b, 10)[0, 4:])
    assert torch.equal(batch, llama.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False))


def test_onnxruntime_backend_generates_the_eager_tokens(llama_w4, tmp_path):
    ort = llama_w4.with_backend("onnxruntime", path=tmp_path / "model.onnx", accuracy_level=0)
    session = ort._runner.session
    assert [i.name for i in session.get_inputs()][3:5] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert [o.name for o in session.get_outputs()][:3] == ["logits", "present.0.key", "present.0.value"]
    _, ids, mask = _left_padded()
    assert torch.equal(ort.generate(ids, 12, attention_mask=mask), llama_w4.generate(ids, 12, attention_mask=mask))
    # attention is one GroupQueryAttention node per layer (backends/onnx_attention.py), numerically the
    # eager graph's for left padding, decode steps and batched chunks with a past
    model = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    assert sum(n.op_type == "GroupQueryAttention" for n in model.graph.node) == llama_w4.cache_layout.layers
    assert not any(n.op_type == "Softmax" for n in model.graph.node)
    assert_same_steps(llama_w4._runner, ort._runner, llama_w4.cache_layout)


def assert_same_steps(eager, onnx_run, layout):
    """Prefill of a left-padded batch, a decode step, a batched chunk of 3 with a past, a decode step:
    logits and present K/V equal at every real token (padding rows are unspecified), rel 1e-5."""
    ids = prompt(2, 5, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    past = None
    for step, new in enumerate((5, 1, 3, 1)):
        if step:
            ids = prompt(2, new, seed=10 + step)
            mask = torch.cat([mask, torch.ones(2, new, dtype=mask.dtype)], 1)
        inputs = cache_graph.graph_inputs(layout, ids, mask, past=past)
        with torch.no_grad():
            (want, want_present), (got, got_present) = eager(**inputs), onnx_run(**inputs)
        rows = mask[:, -new:].bool()
        assert (got[rows] - want[rows]).abs().max() <= 1e-5 * want.abs().max(), (step, new)
        real = mask.bool()[:, None, :, None]  # cache rows of real tokens
        for a, b in zip(got_present, want_present):
            assert a.shape == b.shape
            assert ((a - b) * real).abs().max() <= 1e-5 * b.abs().max(), (step, new)
        past = want_present  # both continue from the same cache


def test_saved_artifact_keeps_the_cache_graph_and_generates(llama_w4, tmp_path):
    llama_w4.save(tmp_path / "a")
    loaded = qc.load(tmp_path / "a")
    ids = prompt(1, 5, seed=7)
    assert torch.equal(loaded.generate(ids, 12), llama_w4.generate(ids, 12))


def test_streaming_sampling_and_eos(llama_w4):
    ids = prompt()
    streamed = []
    out = llama_w4.generate(ids, 9, streamer=streamed.append)
    assert torch.equal(torch.stack(streamed, 1), out[:, 6:])
    assert torch.equal(llama_w4.generate(ids, 9, do_sample=True, top_k=1, seed=5), out)  # top-1 sampling = greedy
    a = llama_w4.generate(ids, 9, do_sample=True, temperature=1.5, top_p=0.9, seed=11)
    assert torch.equal(a, llama_w4.generate(ids, 9, do_sample=True, temperature=1.5, top_p=0.9, seed=11))
    sampling = SamplingConfig(do_sample=True, temperature=1.5, top_p=0.9)  # one object for generate and stream
    assert torch.equal(a, llama_w4.generate(ids, 9, sampling=sampling, seed=11))
    assert torch.equal(torch.stack(list(llama_w4.stream(ids, 9, sampling=sampling, seed=11)), 1), a[:, 6:])
    with pytest.raises(TypeError, match="not both"):
        llama_w4.generate(ids, 2, sampling=sampling, top_k=3)
    eos = int(out[0, 8])  # the third generated token
    stopped = llama_w4.generate(ids, 9, eos_token_id=eos)
    assert stopped.shape[1] == 9 and int(stopped[0, -1]) == eos


def test_explicit_use_cache_false_keeps_the_plain_graph(llama):
    cm = qc.compile(llama, {"input_ids": prompt(), "use_cache": False}, recipe="none", progress=False)
    assert cm.cache_layout is None
    with pytest.raises(ValueError, match="generate needs a causal LM captured with its KV cache"):
        cm.generate(prompt(), 4)


@pytest.mark.parametrize(
    "call,words",
    [
        (lambda cm: cm.generate(prompt(1, 100), 40), "exceeds the model's context of 128"),
        (lambda cm: cm.generate(prompt(), -1), "max_new_tokens must be an integer >= 0, got -1"),
        (lambda cm: cm.generate(prompt(1, 0), 4), "the prompt is empty"),
        (lambda cm: cm.generate(prompt(), 4, do_sample=True, temperature=0), "temperature must be > 0"),
        (lambda cm: cm.generate(prompt(), 4, do_sample=True, top_p=1.5), "top_p must be in (0, 1]"),
        (
            lambda cm: cm.generate(prompt(2, 4), 4, attention_mask=torch.zeros(2, 4, dtype=torch.long)),
            "masks every token of sequence 0",
        ),
        (lambda cm: cm(input_ids=prompt(), attention_mask=torch.ones(1, 3)), "must be (1, 6)"),
        (
            lambda cm: cm(input_ids=prompt(1, 3), attention_mask=torch.tensor([[1, 2, 1]])),
            "attention_mask holds 2 at (0, 1); it must be 0 (padding) or 1 (a token)",
        ),
        (
            lambda cm: cm.generate(prompt(2, 3), 2, attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]])),
            "prompt 0 is right-padded (its last position is padding); generate needs prompts padded on the left",
        ),
    ],
)
def test_bad_generation_inputs_are_one_line_errors(call, words, llama_w4):
    with pytest.raises(ValueError) as info:
        call(llama_w4)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_generate_on_an_encoder_is_refused():
    from tiny_models import example_inputs, make_model

    cm = qc.compile(make_model("bert"), example_inputs("bert"), recipe="none", progress=False)
    with pytest.raises(ValueError, match="generate needs a causal LM.*BertModel"):
        cm.generate(prompt(), 4)


def test_triton_backend_generates_the_eager_tokens(llama_w4):
    """Kernels on the GPU when there is one, else under TRITON_INTERPRET=1 (conftest sets it); on
    the GPU ``cache="auto"`` decodes over the static cache with the step replayed as a CUDA graph."""
    on_triton = llama_w4.with_backend("triton")
    want = llama_w4.generate(prompt(), 5)
    assert torch.equal(on_triton.generate(prompt(), 5), want)
    assert torch.equal(on_triton.generate(prompt(), 5, cache="static"), want)


def test_static_cache_generates_the_dynamic_cache_tokens(llama):
    """Preallocated slots, masked until filled: the same greedy tokens, a left-padded batch too."""
    fp = qc.compile(llama, {"input_ids": prompt()}, recipe="none", progress=False)
    _, ids, mask = _left_padded()
    want = fp.generate(ids, 12, attention_mask=mask, cache="dynamic")
    assert torch.equal(fp.generate(ids, 12, attention_mask=mask, cache="static"), want)
    with pytest.raises(ValueError, match="cache must be 'auto', 'dynamic' or 'static', got 'paged'"):
        fp.generate(ids, 2, cache="paged")


@pytest.mark.slow  # the static cache's tokens: test_static_cache_generates_the_dynamic_cache_tokens
def test_static_cache_stops_at_a_sliding_window():
    """Within the window a sliding-window model decodes on the static cache as on the dynamic one;
    past it the static cache would keep what the window drops: refused by name."""
    model = causal_lm("mistral")
    model.config.sliding_window = 12
    fp = qc.compile(model, {"input_ids": prompt()}, recipe="none", progress=False)
    assert torch.equal(fp.generate(prompt(), 5, cache="static"), fp.generate(prompt(), 5, cache="dynamic"))
    with pytest.raises(ValueError, match="12 positions reach this model's sliding window of 12"):
        fp.generate(prompt(), 6, cache="static")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_calibrate_and_quantize_in_their_dtype(dtype):
    """Hessians and GPTQ run in fp32; the graph keeps the model's dtype."""
    model = causal_lm("llama").to(dtype)
    q = qc.compile(model, {"input_ids": prompt()}, recipe="gptq-w4g128", calibration=calibration(), progress=False)
    out, ref = q(input_ids=prompt()).logits, model(input_ids=prompt()).logits
    assert out.dtype == dtype
    assert 0 < ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 0.3
    assert q.generate(prompt(), 4).shape == (1, 10)


def test_a_checkpoint_saying_use_cache_false_still_generates(tmp_path, capsys):
    """``use_cache: false`` is a training setting many fine-tuned checkpoints ship; a loaded model is
    captured with its cache anyway (generate and the onnx-genai export need it)."""
    from qcompiler.cli import main
    from qcompiler.models import load

    model = causal_lm("llama")
    model.config.use_cache = False
    model.save_pretrained(tmp_path / "model")
    loaded = load(tmp_path / "model")
    cm = qc.compile(loaded.model, loaded.example_inputs(), recipe="rtn-w4g128", progress=False)
    assert cm.cache_layout is not None
    reference = qc.compile(causal_lm("llama"), {"input_ids": prompt()}, recipe="rtn-w4g128", progress=False)
    assert torch.equal(cm.generate(prompt(), 8), reference.generate(prompt(), 8))
    out = tmp_path / "art"
    assert (
        main(["quantize", str(tmp_path / "model"), "--recipe", "rtn-w4g128", "--samples", "2", "--out", str(out)]) == 0
    )
    assert qc.load(out).cache_layout is not None
