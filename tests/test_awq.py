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


@pytest.mark.parametrize("grid,group,limit", [("nvfp4", 16, 0.9), ("mxfp4", 32, 0.98)])  # measured 0.79x, 0.95x
def test_the_search_on_a_float_grid_matches_the_activations_and_helps(grid, group, limit):
    """On NVFP4 / MXFP4 (q/k/v-like siblings: NVFP4's global scale shared by the group, as vLLM fuses
    them) the Hessian form equals the activations' error, and scaling lowers it on outlier channels
    (less on MXFP4: its power-of-two scales already follow the group's range coarsely)."""
    X = _outlier_inputs()
    gen = torch.Generator().manual_seed(3)
    weights = [torch.randn(64, 256, generator=gen) * (1 + i) for i in range(2)]
    H = 2 * X.t() @ X / X.shape[0]
    s = awq_scales((torch.diagonal(H) / 2).sqrt(), 0.5)
    fast = scaled_output_error(weights, H, s, 4, group, grid=grid)
    assert fast == pytest.approx(scaled_output_error_reference(X, weights, s, 4, group, grid), rel=1e-5)
    s, alpha, err, plain = search_awq_scales(weights, H, 4, group, grid=grid)
    assert alpha > 0 and err < limit * plain, (alpha, err, plain)


def test_awq_nvfp4_searches_on_that_grid_and_its_rtn_stores_nvfp4():
    """``awq-nvfp4``: each group's scales searched on the NVFP4 grid (never worse than unscaled there,
    by construction of the search) and the weights then stored as NVFP4."""
    from collections import Counter

    from qcompiler.ir.op_registry import spec_of

    model = make_model("llama")
    calib = [example_inputs("llama", 2, 16, seed=s) for s in range(2)]
    cm = qc.compile(model, example_inputs("llama"), recipe="awq-nvfp4", calibration=calib, progress=False)
    awq = cm.report.passes[0]
    assert awq.config["grid"] == "nvfp4" and awq.layers
    assert all(f["scaled_rtn_error"] <= f["rtn_error"] for f in awq.layers.values())
    layouts = Counter(sp.name for n in cm.graph_module.graph.nodes if (sp := spec_of(n)) is not None)
    assert set(layouts) == {"nvfp4_linear"}, layouts


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
