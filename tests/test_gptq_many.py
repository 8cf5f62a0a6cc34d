"""``auto:B``'s GPTQ candidates of a layer solved in one sweep over their stacked rows
(qcompiler/algorithms/gptq_many.py, passes/gptq_candidates.py) give each candidate's own solve,
code for code."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qcompiler import passes as P
from qcompiler.algorithms.gptq import gptq_quantize, hessian_factor
from qcompiler.algorithms.gptq_many import GridSpec, gptq_quantize_many
from qcompiler.passes.gptq_candidates import solve_gptq_candidates
from qcompiler.passes.mixed_precision import candidate_quantizer

SPECS = [
    GridSpec(2, 32, False, "mse"),
    GridSpec(3, 64, True, "mse"),
    GridSpec(4, 128, False, "minmax"),
    GridSpec(8, 128, False, "mse"),
    GridSpec(4, 48, True, "minmax"),  # groups that do not divide the width: a shorter last group
]


def _problem(out: int, n_in: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(4 * n_in, n_in, generator=gen) @ torch.randn(n_in, n_in, generator=gen) * 0.2
    X[:, 5] = 0.0  # a dead input column
    return torch.randn(out, n_in, generator=gen), 2 * X.t() @ X / X.shape[0]


@pytest.mark.parametrize("act_order", [True, False])
def test_one_sweep_over_stacked_candidates_equals_each_candidates_own_solve(act_order):
    W, H = _problem(96, 200)
    factor = hessian_factor(H, 0.01, act_order)
    together = gptq_quantize_many(W, factor, SPECS, block_size=64)
    for spec, got in zip(SPECS, together):
        want = gptq_quantize(
            W,
            None,
            bits=spec.bits,
            group_size=spec.group_size,
            sym=spec.sym,
            act_order=act_order,
            static_groups=True,
            block_size=64,
            factor=factor,
            grid=spec.grid,
        )
        for field in ("codes", "scales", "zeros", "g_idx", "dequantized"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (spec, field)
        assert got.damped_error[0] == pytest.approx(want.damped_error[0], rel=1e-5)
        assert got.damped_error[1] == want.damped_error[1]


def test_grids_that_cannot_share_a_sweep_are_refused():
    W, H = _problem(32, 64)
    with pytest.raises(ValueError, match="cannot share a sweep"):
        gptq_quantize_many(W, hessian_factor(H, 0.01, True), [GridSpec(4, -1, False, "mse")])


def test_the_candidates_solved_together_store_each_candidates_own_tensors():
    """What auto:B scores: every default GPTQ candidate through the shared sweep, as LayerQuants whose
    stored tensors equal ``GPTQ.quantize_layer``'s bit for bit; the others (SpQR, a llama.cpp grid,
    natural-order GPTQ) are left to their own solves."""
    W, H = _problem(64, 256)
    layer = SimpleNamespace(path="model.layers.0.mlp.down_proj", transposed=False)
    names = ("gptq-w2g32", "gptq-w3g64", "gptq-w4g128", "gptq-w8g128", "spqr-w3g16", "gptq-q4_k")
    quantizers = {n: candidate_quantizer(n) for n in names}
    quantizers["natural"] = P.GPTQ(bits=4, group_size=32, act_order=False, static_groups=False)
    solved = solve_gptq_candidates(quantizers, [(layer, W)], H)[layer.path]
    assert set(solved) == {"gptq-w2g32", "gptq-w3g64", "gptq-w4g128", "gptq-w8g128"}
    for name, got in solved.items():
        want = quantizers[name].quantize_layer(layer, W, H)
        assert got.tensors.keys() == want.tensors.keys()
        for key in want.tensors:
            assert torch.equal(got.tensors[key], want.tensors[key]), (name, key)
        assert torch.equal(got.dequantized, want.dequantized)
        assert got.rewrite == want.rewrite


def test_siblings_candidates_share_one_sweep_and_each_gets_its_own_solve():
    """q/k/v (or gate/up) read one input, so one H: their candidates stacked into one sweep give every
    layer's own ``GPTQ.quantize_layer`` tensors bit for bit, whatever each layer's row count."""
    W, H = _problem(96, 256)
    q, k = W[:64], W[64:] * 3.0
    layers = [SimpleNamespace(path=f"model.layers.0.self_attn.{n}_proj", transposed=False) for n in "qk"]
    quantizers = {n: candidate_quantizer(n) for n in ("gptq-w3g64", "gptq-w4g128", "spqr-w3g16")}
    solved = solve_gptq_candidates(quantizers, [(layers[0], q), (layers[1], k)], H)
    assert set(solved) == {layer.path for layer in layers}
    for layer, weight in zip(layers, (q, k)):
        assert set(solved[layer.path]) == {"gptq-w3g64", "gptq-w4g128"}
        for name, got in solved[layer.path].items():
            want = quantizers[name].quantize_layer(layer, weight, H)
            for key in want.tensors:
                assert torch.equal(got.tensors[key], want.tensors[key]), (layer.path, name, key)
            assert torch.equal(got.dequantized, want.dequantized)
