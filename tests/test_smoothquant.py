"""SmoothQuant folding is exact on every architecture, reports its forms, and rescues W8A8 from outliers."""

import pytest
import torch
from causal_lms import causal_lm
from tiny_models import ARCHS, Stack, example_inputs, main_output, make_model

import qcompiler as qc
from qcompiler.algorithms.smoothquant import search_alpha, smoothing_scales

# Producer groups per block and the form each must get.
FORMS = {
    "llama": {"input_layernorm": "norm", "post_attention_layernorm": "norm", "mlp.up_proj": "linear"},
    "opt": {"self_attn_layer_norm": "norm", "self_attn.v_proj": "linear", "final_layer_norm": "norm", "fc1": "linear"},
    "gpt2": {"ln_1": "norm", "ln_2": "norm"},
    "bert": {"attention.self.value": "linear", "attention.output.LayerNorm": "explicit"},
}


def strip(inputs):
    return {k: v for k, v in inputs.items() if k != "use_cache"}


@pytest.mark.parametrize("arch", ARCHS)
def test_smoothing_alone_keeps_outputs_and_reports_forms(arch):
    model = make_model(arch)
    calib = [example_inputs(arch, 4, 16, seed=s) for s in range(2)]
    cm = qc.compile(
        model, example_inputs(arch), recipe=[qc.passes.SmoothQuant(alpha=0.5)], calibration=calib, progress=False
    )
    inputs = example_inputs(arch, 3, 11, seed=7)
    ref = main_output(model(**inputs))
    got = main_output(cm(**strip(inputs)))
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-4
    layers = cm.report.passes[0].layers
    prefix = {
        "llama": "model.layers.",
        "opt": "model.decoder.layers.",
        "gpt2": "transformer.h.",
        "bert": "encoder.layer.",
    }[arch]
    for block in (0, 1):
        for suffix, form in FORMS[arch].items():
            figures = layers[f"{prefix}{block}.{suffix}"]
            assert figures["form"] == form and figures["consumers"]
            assert figures["s_min"] > 0 and figures["alpha"] == 0.5
    # Anything not smoothed is explained, never silently skipped.
    consumers_smoothed = sum(len(f["consumers"].split(",")) for f in layers.values())
    n_notes = len([n for n in cm.report.passes[0].notes if n.startswith("not smoothed")])
    per_block = {"llama": 7, "opt": 6, "gpt2": 4, "bert": 6}[arch]
    assert consumers_smoothed + n_notes == 2 * per_block


def test_smoothing_keeps_pretrained_minilm(minilm):
    calib = minilm.calibration(16, 64)
    cm = qc.compile(
        minilm.model,
        minilm.example_inputs(),
        recipe=[qc.passes.SmoothQuant(alpha=0.8)],
        calibration=calib,
        progress=False,
    )
    enc = minilm.tokenizer(
        ["Return the number of items in a container.", "Smoothing is exact."], padding=True, return_tensors="pt"
    )
    ref = minilm.model(**enc).last_hidden_state
    got = cm(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-4
    forms = {f["form"] for f in cm.report.passes[0].layers.values()}
    assert forms == {"explicit", "linear"}  # post-LN norms cannot absorb 1/s; v -> o folds


def outlier_block():
    """One block whose normalized activations carry a few huge channels, met by small weights
    (as in LLMs, where the model keeps those channels' contribution bounded)."""
    model = Stack(d=64, depth=1)
    outliers = [3, 17, 40]
    with torch.no_grad():
        model.layers[0].norm.weight[outliers] = 60.0
        model.layers[0].fc1.weight[:, outliers] /= 60.0
    return model


def test_smoothquant_rescues_w8a8_from_activation_outliers():
    model = outlier_block()
    x = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(0))
    calib = [(torch.randn(8, 32, 64, generator=torch.Generator().manual_seed(s)),) for s in range(1, 3)]
    delta = model(x) - x  # the block's own contribution (the residual is not quantized)
    errors = {}
    for name in ("w8a8", "w8a8-smoothquant", "w8a8-smoothquant-auto"):
        cm = qc.compile(model, (x,), recipe=name, calibration=calib, progress=False)
        errors[name] = ((cm(x) - x - delta).norm() / delta.norm()).item()
    assert errors["w8a8"] >= 5 * errors["w8a8-smoothquant"]
    assert errors["w8a8-smoothquant-auto"] <= errors["w8a8-smoothquant"] * 1.05


def test_zero_channels_give_finite_scales_and_alpha_is_validated():
    act = torch.tensor([0.0, 2.0, 5.0])
    w = torch.tensor([1.0, 0.0, 0.5])
    s = smoothing_scales(act, w, 0.5)
    assert torch.isfinite(s).all() and s[0] == 1.0 and s[1] == 1.0
    assert s[2] == pytest.approx((5.0**0.5) / (0.5**0.5))
    for bad in (-0.1, 1.5, "best"):
        with pytest.raises(qc.QuantizationError, match="alpha must be in"):
            qc.passes.SmoothQuant(alpha=bad)
    X = torch.randn(64, 8)
    alpha, err = search_alpha(X, [torch.randn(4, 8)], X.abs().amax(0), grid=(0.3, 0.6))
    assert alpha in (0.3, 0.6) and err >= 0


def test_dead_calibration_channel_stays_finite():
    model = Stack(d=32)
    with torch.no_grad():
        model.layers[0].norm.weight[5] = 0.0  # channel 5 of the normalized input is always zero
        model.layers[0].norm.bias[5] = 0.0
    x = torch.randn(2, 8, 32)
    cm = qc.compile(model, (x,), recipe="w8a8-smoothquant", calibration=[(torch.randn(4, 8, 32),)], progress=False)
    out = cm(x)
    assert torch.isfinite(out).all()
    assert ((out - model(x)).norm() / model(x).norm()) < 0.02


def test_model_without_foldable_producer_is_reported_not_crashed():
    model = torch.nn.Sequential()
    model.add_module("layers", torch.nn.ModuleList())
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))

    class NoNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([mlp])

        def forward(self, x):
            return self.layers[0](torch.tanh(x))

    m = NoNorm().eval()
    x = torch.randn(2, 4, 16)
    gm = qc.capture(m, (x,))
    ctx = qc.PassContext(example_inputs=((x,), {}), calibration=[((x,), {})], progress=False)
    assert not qc.passes.SmoothQuant().run(gm, ctx) and not ctx.record.layers
    assert any("no producer group could be smoothed" in n for n in ctx.record.notes)
    assert any("layers.0.0" in n and "no norm or linear producer" in n for n in ctx.record.notes)
    # in a pipeline, SmoothQuant provides SMOOTHED: smoothing nothing fails its contract, naming why
    with pytest.raises(
        qc.PassError,
        match="pass #1 SmoothQuant provides SMOOTHED, but it reported that it changed "
        "nothing .*no producer group could be smoothed",
    ):
        qc.compile(m, (x,), recipe=[qc.passes.SmoothQuant()], calibration=[(x,)], progress=False)


@pytest.mark.parametrize("recipe", ["smoothquant", "awq"])
def test_gemma_norms_absorb_the_scales_at_all_three_sites_of_a_block(recipe):
    """Gemma's RMSNorm computes in float32, scales by 1 + w and casts back with type_as: SmoothQuant
    and AWQ fold 1/s into that weight (w' = (1 + w)/s - 1) at input_layernorm -> q/k/v and
    pre_feedforward_layernorm -> gate/up, and into up_proj's rows for down_proj — every site of every
    block (they used to be skipped: "type_as has no norm or linear producer") — and the scaled model
    computes the FP model's logits."""
    model = causal_lm("gemma3_text")
    with torch.no_grad():  # non-trivial norm weights: a wrong fold (w/s instead of (1+w)/s - 1) shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    passes = [qc.passes.SmoothQuant(alpha=0.5)] if recipe == "smoothquant" else [qc.passes.AWQ(bits=4, group_size=32)]
    calibration = [
        {"input_ids": torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(s))} for s in range(2)
    ]
    cm = qc.compile(
        model, {"input_ids": torch.randint(0, 128, (2, 8))}, recipe=passes, calibration=calibration, progress=False
    )
    forms = {path.split(".", 3)[-1]: figures["form"] for path, figures in cm.report.passes[0].layers.items()}
    assert forms == {"input_layernorm": "norm", "pre_feedforward_layernorm": "norm", "mlp.up_proj": "linear"}
    assert len(cm.report.passes[0].layers) == 6  # three sites x two blocks
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref, got = model(input_ids=ids).logits, cm(input_ids=ids).logits
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5
