"""GPTQ as a pure function: the lazy-batch version equals the column-by-column reference, and
beats round-to-nearest on the quantity it minimises."""

import pytest
import torch

from qcompiler.algorithms.gptq import (
    gptq_quantize,
    gptq_quantize_reference,
    group_index,
    hessian_factor,
    inverse_hessian_cholesky,
    invert_lower_triangular_,
    rtn_quantize,
)
from qcompiler.algorithms.output_error import output_error
from qcompiler.algorithms.quant_grid import fake_quantize, fit_grid
from qcompiler.errors import QuantizationError


def problem(out=32, n=96, seed=0, tokens=512):
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(n, n, generator=gen) * 0.3
    X = torch.randn(tokens, n, generator=gen) @ mix + torch.randn(n, generator=gen)
    X[:, 5] *= 20  # an outlier input channel
    return torch.randn(out, n, generator=gen), 2 * X.T @ X / tokens


SPECS = [
    dict(group_size=-1),
    dict(group_size=32),
    dict(group_size=32, act_order=True),
    dict(group_size=32, act_order=True, static_groups=True),
    dict(group_size=40),
    dict(group_size=64, sym=True),
]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_lazy_batch_equals_column_by_column_reference(bits, spec):
    W, H = problem(seed=bits)
    lazy = gptq_quantize(W, H, bits=bits, block_size=64, **spec)
    ref = gptq_quantize_reference(W, H, bits=bits, **spec)
    differ = (lazy.codes != ref.codes).float().mean().item()
    assert differ <= 0.002  # float reassociation can flip a rounding tie, nothing more
    rel = (lazy.dequantized - ref.dequantized).norm() / ref.dequantized.norm()
    assert rel <= 1e-4 or differ > 0
    assert torch.equal(lazy.g_idx, ref.g_idx)


@pytest.mark.parametrize("bits,group", [(4, 32), (3, 32), (3, -1), (2, 32)])
def test_gptq_beats_rtn_on_output_error(bits, group):
    W, H = problem(seed=7)
    gptq = gptq_quantize(W, H, bits=bits, group_size=group)
    rtn = rtn_quantize(W, bits=bits, group_size=group)
    assert output_error(W, gptq.dequantized, H) < 0.8 * output_error(W, rtn.dequantized, H)


@pytest.mark.parametrize("act_order", [False, True])
def test_a_shared_hessian_factor_gives_what_a_fresh_one_gives(act_order):
    """q/k/v share one Hessian; the pass factors it once and passes it to each (passes/gptq.py)."""
    W, H = problem(seed=4)
    H[:, 7] = H[7, :] = 0  # a dead column: zeroed in every weight that uses the factor
    factor = hessian_factor(H, 0.01, act_order)
    for W_k in (W, W.flip(0) * 0.5):
        fresh = gptq_quantize(W_k, H, bits=3, group_size=32, act_order=act_order)
        reused = gptq_quantize(W_k, None, bits=3, group_size=32, act_order=act_order, factor=factor)
        assert torch.equal(fresh.codes, reused.codes) and torch.equal(fresh.dequantized, reused.dequantized)
        assert bool((reused.dequantized[:, 7] == 0).all())


def test_output_error_is_the_relative_error_of_the_layer_outputs():
    """From the Hessian alone it equals ‖(W − Ŵ)X‖ / ‖WX‖ computed on the activations in float64."""
    gen = torch.Generator().manual_seed(3)
    X = torch.randn(400, 96, generator=gen) * torch.linspace(0.1, 5, 96)
    W = torch.randn(48, 96, generator=gen)
    W_hat = rtn_quantize(W, bits=3, group_size=32).dequantized
    H = 2 * X.T @ X / X.shape[0]
    direct = ((W - W_hat).double() @ X.double().T).norm() / (W.double() @ X.double().T).norm()
    assert output_error(W, W_hat, H) == pytest.approx(direct.item(), rel=1e-5)


@pytest.mark.parametrize(
    "spec",
    [dict(group_size=32), dict(group_size=32, act_order=True, static_groups=True), dict(group_size=-1, act_order=True)],
    ids=["g32", "act-static", "channel-act"],
)
def test_gptq_sweep_errors_give_the_output_error_without_a_gemm(spec):
    """tr(ΔW (H + λI) ΔWᵀ) = ‖E‖² for the sweep's scaled errors E: the report's rel_error from them
    equals the Hessian GEMM's, with a dead input and on a rank-deficient H (where λ‖ΔW‖² is most of ‖E‖²)."""
    for seed, dead, low_rank in ((1, False, False), (2, True, False), (3, True, True)):
        W, H = problem(seed=seed, tokens=40 if low_rank else 512)  # 40 rows < 96 inputs: rank-deficient H
        if dead:
            H[:, 9] = H[9, :] = 0
        res = gptq_quantize(W, H, bits=3, **spec)
        via_gemm = output_error(W, res.dequantized, H)
        assert output_error(W, res.dequantized, H, res.damped_error) == pytest.approx(via_gemm, rel=1e-4)


def test_codes_scales_and_zeros_reproduce_the_dequantized_weight():
    W, H = problem()
    for res in (gptq_quantize(W, H, bits=3, group_size=32, act_order=True), rtn_quantize(W, bits=3, group_size=32)):
        g = res.g_idx.long()
        rebuilt = (res.codes.float() - res.zeros[g].t()) * res.scales[g].t()
        assert torch.equal(rebuilt, res.dequantized)
        assert torch.equal(res.scales, res.scales.half().float())  # fp16-representable: storage is exact


def test_act_order_g_idx_groups_by_hessian_diagonal():
    W, H = problem()
    res = gptq_quantize(W, H, bits=4, group_size=32, act_order=True)
    order = torch.argsort(torch.diagonal(H), descending=True)
    assert torch.equal(res.g_idx[order], torch.arange(96, dtype=torch.int32) // 32)
    static = gptq_quantize(W, H, bits=4, group_size=32, act_order=True, static_groups=True)
    assert torch.equal(static.g_idx, torch.arange(96, dtype=torch.int32) // 32)


def test_rtn_equals_grid_rounding_per_group():
    W, _ = problem()
    res = rtn_quantize(W, bits=4, group_size=32)
    for g in range(3):
        cols = W[:, g * 32 : (g + 1) * 32]
        assert torch.equal(res.dequantized[:, g * 32 : (g + 1) * 32], fake_quantize(cols, fit_grid(cols, 4, False), 4))


def test_dead_inputs_get_zero_weight():
    W, H = problem()
    H[7, :] = 0
    H[:, 7] = 0
    res = gptq_quantize(W, H, bits=4, group_size=32)
    assert (res.dequantized[:, 7] == 0).all() and torch.isfinite(res.dequantized).all()


def test_inverse_hessian_factor_is_the_upper_cholesky_of_the_damped_inverse():
    _, H = problem(n=64)
    U, damp, steps = inverse_hessian_cholesky(H, 0.01)
    damped = H.double() + 0.01 * H.diagonal().mean().double() * torch.eye(64, dtype=torch.float64)
    assert steps == 0 and torch.equal(U, torch.triu(U)) and bool((U.diagonal() > 0).all())
    want = torch.linalg.cholesky(torch.linalg.inv(damped), upper=True)  # the definition, in float64
    assert ((U.double() - want).abs().max() / want.abs().max()).item() < 1e-5


@pytest.mark.parametrize("n,parts", [(67, 4), (64, 1), (7, 8)])
def test_blocked_triangular_inverse_is_the_inverse(n, parts):
    """Uneven blocks, one block, more blocks than rows: L⁻¹ against float64 inversion."""
    _, H = problem(n=n)
    L = torch.linalg.cholesky(H + 0.01 * torch.eye(n))
    got = invert_lower_triangular_(L.clone(), parts)
    want = torch.linalg.inv(L.double())
    assert torch.equal(got, torch.tril(got))
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    in_place = invert_lower_triangular_(L, parts)  # the solver's memory-saving variant: the same values
    assert in_place.data_ptr() == L.data_ptr() and torch.equal(in_place, got)


def test_damping_is_raised_until_the_hessian_factors():
    n = 16
    v = torch.randn(n, 1, generator=torch.Generator().manual_seed(0))
    H = v @ v.T - 0.05 * (v.norm() ** 2 / n) * torch.eye(n)  # indefinite: λ = 0.01·mean(diag) is too small
    U, damp, steps = inverse_hessian_cholesky(H, 0.01)
    assert steps >= 1 and damp == pytest.approx(0.01 * 10**steps)
    assert torch.isfinite(U).all()
    res = gptq_quantize(torch.randn(8, n), H, bits=4, group_size=-1)
    assert res.damp_steps == steps
    with pytest.raises(QuantizationError, match="not positive definite"):
        inverse_hessian_cholesky(-torch.eye(n), 0.01, max_steps=2)


def test_unsupported_settings_are_named():
    W, H = problem()
    with pytest.raises(QuantizationError, match="bits=5 is not supported"):
        gptq_quantize(W, H, bits=5)
    with pytest.raises(QuantizationError, match="group_size=0 is not supported"):
        rtn_quantize(W, bits=4, group_size=0)


def test_group_size_not_dividing_input_dim_makes_a_short_last_group():
    assert torch.equal(torch.bincount(group_index(100, 32).long()), torch.tensor([32, 32, 32, 4]))
    W, H = problem(n=96)
    res = gptq_quantize(W, H, bits=4, group_size=40)  # groups of 40, 40, 16
    assert res.scales.shape == (3, 32)


def test_gptq_reads_a_transposed_view_without_writing_to_it():
    """A Conv1D weight arrives as the ``[out, in]`` view of an ``[in, out]`` tensor: same result as
    the contiguous copy, and the stored tensor is left as it was."""
    W, H = problem(n=64)
    stored = W.t().contiguous()
    kept = stored.clone()
    got = gptq_quantize(stored.t(), H, bits=4, group_size=16)
    want = gptq_quantize(W.clone(), H, bits=4, group_size=16)
    assert torch.equal(stored, kept)
    assert torch.equal(got.codes, want.codes) and torch.equal(got.dequantized, want.dequantized)
