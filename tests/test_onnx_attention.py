"""KV-cache attention exported as ORT's GroupQueryAttention: the fused graph computes the captured
one; attention it cannot fuse stays plain ops, named; ``fused_attention=False`` is standard ONNX."""

import warnings

import onnx
import pytest
import torch
from causal_lms import causal_lm, prompt

import qcompiler as qc
from qcompiler.backends.onnx_attention import fuse_kv_cache_attention
from qcompiler.backends.onnx_layout import lower_for_onnx
from qcompiler.frontend import causal_lm as cache_graph


def _compile(arch: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qc.compile(causal_lm(arch), {"input_ids": prompt()}, recipe="none", progress=False)


def _valid(x: torch.Tensor, mask: torch.Tensor, new: int) -> torch.Tensor:
    """Rows of ``x`` [B, new, ...] at real (unpadded) new tokens: padding rows are unspecified."""
    return x[mask[:, -new:].bool()]


# The exported node against the eager graph (left padding, decode, batched chunks with a past):
# tests/test_causal_lm.py::test_onnxruntime_backend_generates_the_eager_tokens, on its quantized export.


@pytest.mark.parametrize("arch", ["gemma2", "bloom"])  # soft-capped / ALiBi attention: the models' eager code
def test_eager_attention_stays_plain_ops_and_says_so(arch):
    fp = _compile(arch)
    lowered, _ = lower_for_onnx(fp.graph_module)
    assert fuse_kv_cache_attention(lowered) == [
        "plain-op attention: no scaled_dot_product_attention in the graph (the model's eager attention)"
    ]
    inputs = cache_graph.graph_inputs(fp.cache_layout, prompt(1, 4))
    with torch.no_grad():
        assert torch.equal(lowered(**inputs)[0], fp.graph_module(**inputs)[0])


def test_attention_without_a_kv_cache_is_not_fused_and_is_named():
    class Attention(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q = torch.randn(1, 2, 3, 8)
    program = torch.export.export(Attention(), (q, q, q, torch.ones(1, 1, 3, 3, dtype=torch.bool)))
    gm = program.graph_module
    assert fuse_kv_cache_attention(gm) == [
        "plain-op attention in scaled_dot_product_attention: keys/values are "
        "not cat([past, new], dim=2) of the KV cache"
    ]


@pytest.mark.parametrize("arch", ["gpt2", "mistral"])
def test_fused_graph_equals_the_captured_one_in_torch(arch):
    """The torch reference of qc.kv_cache_attention (used by export tracing) computes what the
    captured sdpa did, at every real token: GPT-2's full heads (no repeat_kv), Mistral's
    sliding-window cache (the present is a slice of the concatenation)."""
    fp = _compile(arch)
    lowered, _ = lower_for_onnx(fp.graph_module)
    assert fuse_kv_cache_attention(lowered) == ["2 attention layer(s) as com.microsoft GroupQueryAttention"]
    ids = prompt(2, 6, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    inputs = cache_graph.graph_inputs(fp.cache_layout, ids, mask)
    with torch.no_grad():
        (want, _), (got, _) = fp.graph_module(**inputs), lowered(**inputs)
    assert torch.allclose(_valid(got, mask, 6), _valid(want, mask, 6), atol=1e-6)


@pytest.mark.slow
def test_plain_attention_export_uses_standard_onnx_ops_only(tmp_path):
    """``fused_attention=False`` (CLI ``--plain-attention``): an FP export with no contrib op at all,
    for ONNX runtimes without ORT's; same logits as the fused export."""
    fp = _compile("llama")
    plain = fp.export_onnx(tmp_path / "plain.onnx", accuracy_level=0, fused_attention=False)
    model = onnx.load(str(plain), load_external_data=False)
    assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}
    fused = fp.export_onnx(tmp_path / "fused.onnx", accuracy_level=0)
    from qcompiler.backends.onnxruntime import session_for

    inputs = cache_graph.graph_inputs(
        fp.cache_layout, prompt(2, 5), past=tuple(torch.randn_like(t) for t in fp.cache_layout.empty_past(2, 3))
    )
    feeds = {
        "input_ids": inputs["input_ids"].numpy(),
        "attention_mask": inputs["attention_mask"].numpy(),
        "position_ids": inputs["position_ids"].numpy(),
    }
    for i in range(fp.cache_layout.layers):
        feeds[f"past_key_values.{i}.key"] = inputs["past"][2 * i].numpy()
        feeds[f"past_key_values.{i}.value"] = inputs["past"][2 * i + 1].numpy()
    a, b = (session_for(p).run(None, feeds) for p in (plain, fused))
    for x, y in zip(a, b):
        assert abs(x - y).max() <= 1e-5 * abs(x).max()


@pytest.mark.parametrize(
    "providers, fused", [(["CPUExecutionProvider"], True), (["CUDAExecutionProvider", "CPUExecutionProvider"], False)]
)
def test_onnxruntime_backend_fuses_attention_only_for_the_cpu_provider(monkeypatch, providers, fused):
    """ORT's CUDA GroupQueryAttention takes fp16/bf16 only: an fp32 node would run on the CPU and
    copy the cache every step, so with the CUDA provider installed the backend exports plain ops."""
    import onnxruntime

    from qcompiler.backends import onnxruntime as backend

    seen = {}

    def stop(gm, path, example_inputs, **options):
        seen.update(options)
        raise RuntimeError("stop before exporting")

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: providers)
    monkeypatch.setattr(backend, "export_onnx", stop)
    with pytest.raises(RuntimeError, match="stop before exporting"):
        backend.prepare_onnxruntime(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()), ((), {}))
    assert seen["fused_attention"] is fused
    with pytest.raises(RuntimeError, match="stop before exporting"):  # an explicit choice wins
        backend.prepare_onnxruntime(
            torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()), ((), {}), fused_attention=not fused
        )
    assert seen["fused_attention"] is (not fused)
