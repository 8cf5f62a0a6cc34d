"""AWQ: the Hessian form of its objective equals the activations', its folding is exact on every
architecture, and it lowers round-to-nearest's loss on the pretrained encoder."""

import pytest
import torch
from causal_lms import calibration as lm_calibration
from causal_lms import causal_lm, prompt
from tiny_models import ARCHS, example_inputs, main_output, make_model

import qcompiler as qc
from qcompiler.algorithms.awq import awq_scales, scaled_output_error, scaled_output_error_reference, search_awq_scales
from qcompiler.evaluation.quality import QualityJudge


def _outlier_inputs(n=4096, width=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g) * (torch.rand(width, generator=g) ** 4 * 20 + 0.1)


def test_hessian_error_equals_the_error_on_the_activations():
    X = _outlier_inputs()
    W = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    H = 2 * X.t() @ X / X.shape[0]
    for alpha in (0.0, 0.3, 0.7):
        s = awq_scales((torch.diagonal(H) / 2).sqrt(), alpha)
        fast, ref = scaled_output_error([W], H, s, 3, 64), scaled_output_error_reference(X, [W], s, 3, 64)
        assert fast == pytest.approx(ref, rel=1e-5)


def test_search_is_never_worse_than_no_scaling_and_helps_with_outlier_channels():
    X = _outlier_inputs()
    W = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    H = 2 * X.t() @ X / X.shape[0]
    s, alpha, err, plain = search_awq_scales([W], H, 3, 64)
    assert err <= plain and alpha > 0
    assert err < 0.9 * plain  # measured 0.80x here
    assert float(s.max() * s.min()) == pytest.approx(1.0, rel=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_awq_alone_keeps_the_fp_outputs(arch):
    model = make_model(arch)
    calib = [example_inputs(arch, 4, 16, seed=s) for s in range(2)]
    cm = qc.compile(
        model, example_inputs(arch), recipe=[qc.passes.AWQ(bits=3, group_size=32)], calibration=calib, progress=False
    )
    inputs = {k: v for k, v in example_inputs(arch, 3, 11, seed=7).items() if k != "use_cache"}
    ref, got = main_output(model(**inputs)), main_output(cm(**inputs))
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-4
    layers = cm.report.passes[0].layers
    assert layers and all(f["scaled_rtn_error"] <= f["rtn_error"] for f in layers.values())


def test_awq_runs_on_a_mixture_of_experts_model_and_keeps_its_outputs():
    model = causal_lm("mixtral")
    cm = qc.compile(
        model,
        {"input_ids": prompt()},
        recipe=[qc.passes.AWQ(bits=4, group_size=32)],
        calibration=lm_calibration(),
        progress=False,
    )
    ids = prompt(2, 7, seed=3)
    ref, got = model(input_ids=ids).logits, cm(input_ids=ids).logits
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-4
    record = cm.report.passes[0]
    assert any(f["alpha"] > 0 for f in record.layers.values())  # it scaled something: the check above means it
    assert not any(f["consumers"] == "gate" for f in record.layers.values())  # routers: never quantized, never scaled
    assert any("mixture-of-experts router" in note for note in record.notes)


@pytest.mark.slow  # 20 s: CI runs it with -m slow
def test_awq_lowers_round_to_nearests_loss_on_minilm(minilm):
    judge = QualityJudge(minilm, sentences=96)
    calib = minilm.calibration(32, 128)
    loss = {}
    for recipe in ("rtn-w4g128", "awq-w4g128"):
        cm = qc.compile(minilm.model, minilm.example_inputs(), recipe=recipe, calibration=calib, progress=False)
        loss[recipe] = judge.loss(1.0, judge.score(cm))
    assert loss["awq-w4g128"] <= 0.85 * loss["rtn-w4g128"], loss  # benchmark (128 sentences): 0.75x


def test_awq_without_calibration_is_refused_before_any_work():
    with pytest.raises(qc.QCompilerError, match="calibration"):
        qc.compile(make_model("llama"), example_inputs("llama"), recipe="awq-w4g128", progress=False)
