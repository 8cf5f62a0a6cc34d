"""SignRound: the tuning equals the algorithm written plainly, starts at round-to-nearest, stores
exactly the weights it tuned, and lowers the block's output error below round-to-nearest's."""

import pytest
import torch
from tiny_models import example_inputs, main_output, make_model

import qcompiler as qc
from qcompiler.algorithms.gptq import rtn_quantize
from qcompiler.algorithms.signround import (
    fake_quantize_rounding,
    initial_rounding,
    rounding_result,
    tune_rounding,
)


def _layer_problem(out=24, width=96, rows=256, seed=0):
    """A linear's weight and correlated inputs (rank 32 plus noise, as real activations are: with
    independent inputs round-to-nearest is already near the best, and no method can do much)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(rows, 32, generator=g) @ torch.randn(32, width, generator=g)
    X = X + 0.1 * torch.randn(rows, width, generator=g)
    return torch.randn(out, width, generator=g), X


def _ste_round(x):
    return x + (torch.round(x) - x).detach()


def reference_signround(W, X, bits, group, iters):
    """SignRound on one linear, asymmetric min-max start, written group by group from the paper:
    loss = mean((X Ŵᵀ − X Wᵀ)²), p ← p − lr_t·sign(∇p), lr_t = (1 − t/iters)/iters, best step kept."""
    maxq = 2**bits - 1
    out, width = W.shape
    groups = width // group
    V = torch.zeros(out, width, requires_grad=True)
    alpha = torch.ones(out, groups, requires_grad=True)
    beta = torch.ones(out, groups, requires_grad=True)
    target = X @ W.t()
    best, best_loss = None, float("inf")
    for step in range(iters):
        cols = []
        for j in range(groups):
            w = W[:, j * group : (j + 1) * group]
            hi = w.max(dim=1).values.clamp(min=0) * alpha[:, j]
            lo = w.min(dim=1).values.clamp(max=0) * beta[:, j]
            s = (hi - lo) / maxq
            s = (s + (s.half().float() - s).detach()).unsqueeze(1)
            z = _ste_round(-lo.unsqueeze(1) / s).clamp(0, maxq)
            q = (_ste_round(w / s + V[:, j * group : (j + 1) * group]) + z).clamp(0, maxq)
            cols.append(s * (q - z))
        loss = torch.mean((X @ torch.cat(cols, dim=1).t() - target) ** 2)
        if loss.item() < best_loss:
            best_loss, best = loss.item(), V.detach().clone()
        if step == iters - 1:
            break
        grads = torch.autograd.grad(loss, [V, alpha, beta])
        with torch.no_grad():
            for p, grad in zip((V, alpha, beta), grads):
                p -= (1 - step / iters) / iters * torch.sign(grad)
            V.clamp_(-0.5, 0.5)
            alpha.clamp_(0, 1)
            beta.clamp_(0, 1)
    return best, best_loss


def _tune_one_linear(W, X, bits, group, iters, start="minmax", sym=False):
    def loss(batch, trial):
        return torch.mean((X @ trial["w"].t() - X @ W.t()) ** 2)

    return tune_rounding({"w": W}, loss, 1, bits=bits, group_size=group, sym=sym, iters=iters, start=start)


def test_tuning_equals_the_algorithm_written_plainly():
    W, X = _layer_problem()
    tuned, log = _tune_one_linear(W, X, 3, 32, 40)
    ref_v, ref_loss = reference_signround(W, X, 3, 32, 40)
    assert log.best_loss == pytest.approx(ref_loss, rel=1e-5)
    # sign steps can part where a gradient is ~0 in float noise: nearly every offset agrees
    assert (tuned["w"].v - ref_v).abs().le(1e-5).float().mean() >= 0.99


@pytest.mark.parametrize("sym", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_step_zero_is_round_to_nearest_and_the_best_step_is_never_worse(sym):
    W, X = _layer_problem(seed=1)
    rtn = rtn_quantize(W, bits=3, group_size=32, sym=sym).dequantized
    start = fake_quantize_rounding(W, initial_rounding(W, 3, 32, sym), 3, 32, sym)
    assert torch.equal(start, rtn)
    tuned, log = _tune_one_linear(W, X, 3, 32, 60, sym=sym)
    assert log.first_loss == pytest.approx(torch.mean((X @ rtn.t() - X @ W.t()) ** 2).item(), rel=1e-5)
    assert log.best_loss <= log.first_loss
    assert log.best_loss <= 0.8 * log.first_loss, log  # measured 0.66x (asym), 0.44x (sym)


def test_mse_start_equals_the_searched_rtn_grid():
    W, _ = _layer_problem(seed=2)
    start = fake_quantize_rounding(W, initial_rounding(W, 3, 32, False, "mse"), 3, 32, False)
    assert torch.equal(start, rtn_quantize(W, bits=3, group_size=32, grid="mse").dequantized)


@pytest.mark.parametrize("sym", [False, True])
def test_stored_codes_reproduce_the_tuned_weights_exactly(sym):
    W, X = _layer_problem(width=80, seed=3)  # 80 = 2 whole groups of 32 and a partial one
    tuned, _ = _tune_one_linear(W, X, 4, 32, 20, sym=sym)
    res = rounding_result(W, tuned["w"], 4, 32, sym)
    want = fake_quantize_rounding(W, tuned["w"], 4, 32, sym)
    assert torch.equal(res.dequantized, want)
    g = res.g_idx.long()
    assert res.codes.min() >= 0 and res.codes.max() <= 15
    assert torch.equal(res.scales.half().float(), res.scales)
    assert torch.equal(res.scales[g].t() * (res.codes.float() - res.zeros[g].t()), want)


def _logit_error(model, cm, arch="llama"):
    inputs = {k: v for k, v in example_inputs(arch, 4, 16, seed=11).items() if k != "use_cache"}
    ref = main_output(model(**inputs))
    return ((main_output(cm(**inputs)) - ref).pow(2).mean() / ref.pow(2).mean()).item()


@pytest.mark.parametrize(
    "rotate",  # through the online rotations: qc.hadamard's gradient is test_rotate's twin
    [pytest.param(False, id="plain"), pytest.param(True, id="rotated", marks=pytest.mark.slow)],
)
def test_the_pass_lowers_the_models_output_error_below_round_to_nearest(rotate):
    """On a rotated graph too: the block's gradients flow through the online ``qc.hadamard`` ops."""
    model = make_model("llama")
    calib = [example_inputs("llama", 4, 16, seed=s) for s in range(4)]
    first = [qc.passes.Rotate()] if rotate else []
    err = {}
    for name, p in {
        "rtn": qc.passes.RTN(bits=3, group_size=32, grid="mse"),
        "signround": qc.passes.SignRound(bits=3, group_size=32, iters=30),
    }.items():
        cm = qc.compile(model, example_inputs("llama"), recipe=first + [p], calibration=calib, progress=False)
        err[name] = _logit_error(model, cm)
        if name == "signround":
            notes = [n for n in cm.report.passes[-1].notes if "SignRound block output error" in n]
            assert len(notes) == 2, cm.report.passes[-1].notes  # one line per block
    assert err["signround"] <= 0.85 * err["rtn"], err  # measured 0.65x plain, 0.73x rotated


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"iters": -1}, "iters must be >= 0, got -1"),
        ({"lr": 0.0}, "lr must be positive, got 0.0"),
        ({"target": "teacher"}, "target='teacher'"),
        ({"start": "zero"}, "zero"),
        ({"bits": 9}, "9"),
    ],
)
def test_bad_settings_are_one_line_errors_naming_the_value(kwargs, match):
    with pytest.raises(qc.QCompilerError, match=match) as e:
        qc.passes.SignRound(**kwargs)
    assert "\n" not in str(e.value)


def test_signround_without_calibration_is_refused_before_any_work():
    model = make_model("llama")
    with pytest.raises(qc.QCompilerError, match="calibration"):
        qc.compile(model, example_inputs("llama"), recipe="signround-w4g128", progress=False)
