"""Rotations (passes/rotate.py): exact in floating point, better quantization, honest refusals."""

import warnings

import pytest
import scipy.linalg
import torch
from causal_lms import calibration, causal_lm, prompt

import qcompiler as qc
from qcompiler.algorithms.hadamard import block_size, random_signs, rotation_matrix
from qcompiler.errors import PassError
from qcompiler.interop import ExportError, export_compressed_tensors, export_gptq
from qcompiler.ir.ops import hadamard

ROTATABLE = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3"]  # RMSNorm models: the residual stream too


@pytest.mark.parametrize("width", [64, 96, 1536])
def test_hadamard_op_is_the_dense_randomized_hadamard(width):
    """Twin: ``x @ diag(s) · blockdiag(H_b)/√b`` with H_b from scipy, a different construction."""
    b = block_size(width)
    signs = random_signs(width, 7)
    h = torch.tensor(scipy.linalg.hadamard(b), dtype=torch.float64) / b**0.5
    dense = torch.diag(signs.double()) @ torch.block_diag(*([h] * (width // b)))
    x = torch.randn(3, 5, width, dtype=torch.float64)
    torch.testing.assert_close(hadamard(x.float(), signs, b).double(), x @ dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotation_matrix(signs, b), dense)
    torch.testing.assert_close(dense @ dense.t(), torch.eye(width, dtype=torch.float64))  # orthogonal
    x.requires_grad_(True)
    (hadamard(x, signs, b) * dense[0]).sum().backward()  # its gradient: grad · Rᵀ (SignRound tunes through it)
    torch.testing.assert_close(x.grad, (dense[0].expand(3, 5, width) @ dense.t()), rtol=1e-10, atol=1e-10)


def _rel(a, b):
    return ((a - b).norm() / a.norm()).item()


@pytest.mark.parametrize("arch", ROTATABLE + ["gpt2", "opt", "mixtral"])  # the last three: heads and online only
def test_rotation_keeps_the_fp_logits_and_tokens(arch):
    model = causal_lm(arch)
    ids = prompt(2, 12)
    fp = qc.compile(model, {"input_ids": prompt()}, recipe="none", progress=False)
    rot = qc.compile(model, {"input_ids": prompt()}, recipe=[qc.passes.Rotate()], progress=False)
    assert _rel(fp(input_ids=ids).logits, rot(input_ids=ids).logits) < 1e-5
    assert torch.equal(rot.generate(prompt(), 16), fp.generate(prompt(), 16))  # through the (rotated) KV cache
    record = rot.report.passes[0]
    rotated = any("residual stream rotated" in n for n in record.notes)
    assert rotated == (arch in ROTATABLE), record.notes
    assert all("rotation" in entry for entry in record.layers.values()) and len(record.layers) >= 8


def test_rotation_changes_the_weights_it_claims():
    model = causal_lm("llama")
    rot = qc.compile(model, {"input_ids": prompt()}, recipe=[qc.passes.Rotate()], progress=False)
    state = dict(rot.graph_module.named_parameters()) | dict(rot.graph_module.named_buffers())
    original = model.state_dict()
    assert not torch.allclose(state["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
    assert torch.equal(state["model.norm.weight"], torch.ones(64))  # folded into lm_head
    assert any(t.endswith("hadamard_signs") for t in state)  # the online rotation before down_proj


def test_residual_rotation_refuses_a_post_ln_model_naming_the_norm(minilm):
    with pytest.raises(
        PassError, match=r"Rotate\(residual=True\): node layer_norm .* in embeddings\.LayerNorm is a LayerNorm"
    ):
        qc.compile(minilm.model, minilm.example_inputs(), recipe=[qc.passes.Rotate(residual=True)], progress=False)


def test_a_norm_that_silences_a_channel_keeps_the_stream_unrotated_and_says_which():
    """Gemma-3's norms multiply some channels by exactly 0 (``1 + γ = 0`` where its massive
    activations are): the stream is then left unrotated with a note naming the norm (measured on
    the real 270M: rotate-rtn-w4g128 KL 19.6 with the stream rotated, 0.40 without, 0.55 plain
    RTN), the heads and online rotations still apply and the FP output is unchanged;
    ``residual=True`` refuses it by name."""
    model = causal_lm("gemma3_text")
    with torch.no_grad():
        model.model.layers[1].pre_feedforward_layernorm.weight[5] = -1.0
    ids = prompt()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    cm = qc.compile(model, {"input_ids": ids}, recipe=[qc.passes.Rotate()], progress=False)
    notes = cm.report.passes[0].notes
    assert any(
        "residual stream not rotated: model.layers.1.pre_feedforward_layernorm multiplies 1 channel" in n for n in notes
    )
    assert not any(n.startswith("residual stream rotated") for n in notes)
    assert any(v == "heads (64)" or "heads" in str(v) for v in cm.report.passes[0].layers.values())
    with torch.no_grad():
        assert ((cm(input_ids=ids).logits - want).abs().max() / want.abs().max()).item() < 1e-5
    with pytest.raises(
        PassError, match=r"Rotate\(residual=True\): model\.layers\.1\.pre_feedforward_layernorm multiplies"
    ):
        qc.compile(model, {"input_ids": ids}, recipe=[qc.passes.Rotate(residual=True)], progress=False)


def test_bad_rotate_settings_are_one_line_errors():
    with pytest.raises(ValueError, match="residual must be None, True or False"):
        qc.passes.Rotate(residual="yes")


@pytest.fixture(scope="module")
def minilm_quality():
    from qcompiler import models
    from qcompiler.evaluation.quality import QualityJudge

    loaded = models.load("minilm")
    judge = QualityJudge(loaded)
    cal = loaded.calibration(32, 128)
    fp32 = judge.score(loaded.model)

    def loss(recipe):
        torch.manual_seed(0)
        cm = qc.compile(loaded.model, loaded.example_inputs(), recipe=recipe, calibration=cal, progress=False)
        return judge.loss(fp32, judge.score(cm))

    return loss


@pytest.mark.slow  # exactness on every architecture: test_rotation_keeps_the_fp_logits_and_tokens
def test_rotation_is_exact_on_minilm(minilm_quality):
    """MiniLM is post-LN (no residual rotation): heads and online rotations only."""
    assert minilm_quality([qc.passes.Rotate()]) < 1e-6


@pytest.mark.slow
def test_rotation_helps_rtn_and_w8a8_on_minilm(minilm_quality):
    """benchmarks/frontier.py, 128 sentences: RTN w4g128 0.0407 -> 0.0353, W8A8 0.00102 (SmoothQuant) -> 0.00029."""
    assert minilm_quality("rotate-rtn-w4g128") < 0.95 * minilm_quality("rtn-w4g128")
    assert minilm_quality("rotate-w8a8") < 0.5 * minilm_quality("w8a8-smoothquant")


@pytest.mark.slow
def test_rotated_gptq_beats_gptq_on_minilm(minilm_quality):
    """benchmarks/frontier.py, 128 sentences: w4g128 0.0139 -> 0.0118, w3g128 0.0508 -> 0.0438."""
    assert minilm_quality("rotate-gptq-w3g128") < 0.95 * minilm_quality("gptq-w3g128")


@pytest.fixture(scope="module")
def rotated_llama():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qc.compile(
            causal_lm("llama"),
            {"input_ids": prompt()},
            recipe="rotate-gptq-w4g128",
            calibration=calibration(),
            progress=False,
        )


def test_online_rotations_run_in_onnxruntime_and_reload(rotated_llama, tmp_path):
    ids = prompt(1, 12)
    ort = rotated_llama.with_backend("onnxruntime", accuracy_level=0)
    assert _rel(rotated_llama(input_ids=ids).logits, ort(input_ids=ids).logits) < 1e-4
    assert torch.equal(ort.generate(prompt(), 8), rotated_llama.generate(prompt(), 8))
    rotated_llama.save(tmp_path / "art")
    again = qc.load(tmp_path / "art")
    assert torch.equal(again(input_ids=ids).logits, rotated_llama(input_ids=ids).logits)


@pytest.mark.parametrize("export", [export_compressed_tensors, export_gptq])
def test_checkpoint_exports_refuse_online_rotations_by_name(rotated_llama, export, tmp_path):
    with pytest.raises(ExportError, match=r"down_proj\.hadamard is qc\.hadamard: an online Hadamard .*online=False"):
        export(rotated_llama, tmp_path / "out", progress=lambda _: None)
    assert not (tmp_path / "out").exists()


def test_offline_rotation_exports_an_ordinary_checkpoint_transformers_runs(tmp_path):
    """Rotate(online=False): residual and heads only, so the compressed-tensors folder is a plain
    LLaMA checkpoint (symmetric: this transformers' compressed-tensors loader mis-sizes asymmetric
    zero points whatever the rotation)."""
    import transformers

    recipe = [qc.passes.Rotate(online=False), qc.passes.GPTQ(bits=4, group_size=32, sym=True)]
    cm = qc.compile(
        causal_lm("llama"), {"input_ids": prompt()}, recipe=recipe, calibration=calibration(), progress=False
    )
    assert not any(n.target == torch.ops.qc.hadamard.default for n in cm.graph_module.graph.nodes)
    export_compressed_tensors(cm, tmp_path / "ct", progress=lambda _: None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ct").eval()
    ids = prompt(1, 12)
    assert _rel(cm(input_ids=ids).logits, hf(input_ids=ids).logits) < 1e-5
    assert torch.equal(hf.generate(prompt(), max_new_tokens=16, do_sample=False), cm.generate(prompt(), 16))


def test_offline_rotation_leaves_a_stream_that_needs_online_rotations_alone():
    """Gemma-2 adds its post-norms' outputs into the stream: without online rotations, no residual step."""
    rot = qc.compile(
        causal_lm("gemma2"), {"input_ids": prompt()}, recipe=[qc.passes.Rotate(online=False)], progress=False
    )
    notes = rot.report.passes[0].notes
    assert any("need online rotations (online=False)" in n for n in notes), notes
    assert not any(n.target == torch.ops.qc.hadamard.default for n in rot.graph_module.graph.nodes)


@pytest.mark.slow  # the kernel alone: tests/test_triton_kernels.py (default run)
def test_triton_backend_runs_the_online_rotations_as_kernels():
    from qcompiler.models import load

    tinylm = load("tinylm")
    cm = qc.compile(
        tinylm.model,
        tinylm.example_inputs(),
        recipe="rotate-rtn-w4g128",
        calibration=tinylm.calibration(4),
        progress=False,
    )
    triton = cm.with_backend("triton")
    plan = triton.report.passes[-1].layers
    assert sum(1 for figures in plan.values() if figures["kernel"] == "hadamard") == 4  # one per down_proj
    inputs = tinylm.example_inputs(batch=1, seq=5)
    with torch.no_grad():
        got, expected = triton(**inputs).logits, cm(**inputs).logits
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-4
