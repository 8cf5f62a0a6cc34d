"""SpQR: reduces to GPTQ without outliers, lazy equals straightforward, exact storage and bit accounting."""

import re
from fractions import Fraction

import pytest
import torch
from tiny_models import example_inputs, main_output, make_model

import qcompiler as qc
from qcompiler.algorithms.gptq import gptq_quantize, hessian_factor
from qcompiler.algorithms.output_error import output_error
from qcompiler.algorithms.quant_grid import fit_grid
from qcompiler.algorithms.spqr import (
    SpQRPart,
    leave_one_out_reduction,
    quantize_stats,
    spqr_quantize,
    spqr_quantize_many,
    spqr_quantize_reference,
)
from qcompiler.evaluation.eval import bits_per_parameter
from qcompiler.layouts import stored_bits
from qcompiler.layouts.spqr import dequantize_spqr_dense, pack_spqr, sparse_outlier_linear, spqr_dense_linear


def problem(out=64, n=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(1024, n, generator=gen) @ (torch.randn(n, n, generator=gen) * 0.3) + torch.randn(n, generator=gen)
    W = torch.randn(out, n, generator=gen)
    W[3, 7], W[10, 50], W[40, 99] = 12.0, -9.0, 7.5  # planted outliers
    return W, 2 * X.T @ X / X.shape[0]


def test_without_outliers_and_stat_quantization_spqr_is_gptq_g16():
    W, H = problem()
    s = spqr_quantize(W, H, bits=3, group_size=16, stat_bits=None, outlier_threshold=float("inf"), act_order=True)
    g = gptq_quantize(W, H, bits=3, group_size=16, act_order=True)
    assert not s.outliers.any()
    codes_orig = torch.empty_like(s.codes)
    codes_orig[:, s.perm] = s.codes
    assert (codes_orig != g.codes).float().mean() <= 0.002
    assert torch.allclose(s.dequantized, g.dequantized, atol=1e-6)


@pytest.mark.parametrize("tau", [0.2, 1.0])
def test_lazy_equals_straightforward_reference(tau):
    W, H = problem(seed=1)
    lazy = spqr_quantize(W, H, outlier_threshold=tau, block_size=32)
    ref = spqr_quantize_reference(W, H, outlier_threshold=tau)
    assert (lazy.outliers != ref.outliers).sum() <= 2 and (lazy.codes != ref.codes).float().mean() <= 0.002
    assert lazy.outliers.any()
    no_outliers = spqr_quantize(W, H, outlier_threshold=float("inf"))
    assert output_error(W, lazy.dequantized, H) < output_error(W, no_outliers.dequantized, H)


def test_a_shared_hessian_factor_gives_the_same_solve():
    """auto:B's candidates and q/k/v share one factor of H (pipeline/shared_factors.py): SpQR given
    GPTQ's factor of the same H and damping is its own solve, bit for bit."""
    W, H = problem(seed=2)
    H[7, :], H[:, 7] = 0.0, 0.0  # a dead input
    own = spqr_quantize(W, H, outlier_threshold=0.3)
    shared = spqr_quantize(W, H, outlier_threshold=0.3, factor=hessian_factor(H, 0.01, True))
    for field in ("codes", "dequantized", "outliers", "outlier_values", "perm", "scales", "zeros"):
        assert torch.equal(getattr(own, field), getattr(shared, field)), field


@pytest.mark.parametrize("tau", [0.3, float("inf")])
def test_stacked_parts_are_each_parts_own_solve_bit_for_bit(tau):
    """auto:B's SpQR candidates of a layer in one sweep: widths and outlier thresholds per row; rows of
    one layer with its whole weight's threshold; a second layer (another τ) on the same Hessian."""
    W, H = problem(out=96, seed=4)
    other = problem(out=64, seed=5)[0][16:48] * 3.0
    parts = [SpQRPart(W[:48], 3, W), SpQRPart(W[:48], 4, W), SpQRPart(other, 2), SpQRPart(W, 3)]
    f = hessian_factor(H, 0.01, True)
    stacked = spqr_quantize_many(parts, H, outlier_threshold=tau, block_size=32, factor=f)
    for part, got in zip(parts, stacked):
        alone = spqr_quantize(
            part.W, H, bits=part.bits, tau_weight=part.tau_weight, outlier_threshold=tau, block_size=32, factor=f
        )
        for field in got._fields:
            a, b = getattr(got, field), getattr(alone, field)
            assert torch.equal(a, b) if torch.is_tensor(a) else a == b, (part.bits, field)
    assert stacked[0].threshold != stacked[2].threshold or tau == float("inf")
    assert not torch.equal(stacked[0].codes, stacked[1].codes)


def test_leave_one_out_matches_brute_force():
    gen = torch.Generator().manual_seed(2)
    G = torch.randn(5, 8, generator=gen)
    G[2, 3] = 9.0
    d = torch.rand(8, generator=gen) + 0.5

    def group_error(cols, bits=3):
        sub = G[:, cols]
        grid = fit_grid(sub, bits, sym=False)
        q = torch.clamp(torch.round(sub / grid.scale + grid.zero), 0, 7)
        return ((grid.scale * (q - grid.zero) - sub) / d[cols]).pow(2).sum(1)

    brute = torch.stack(
        [group_error(list(range(8))) - group_error([c for c in range(8) if c != i]) for i in range(8)], dim=1
    )
    red = leave_one_out_reduction(G, d, 3)
    assert torch.allclose(red, brute, rtol=1e-5, atol=1e-6)
    assert red[2].argmax() == 3  # the planted outlier helps most when left out


def test_stats_quantization_roundtrip():
    v = torch.rand(32) * 0.1 + 0.01
    codes, table, v_hat = quantize_stats(v, 3, 16)
    assert table.dtype == torch.float16 and codes.max() <= 7
    step, low = table[:, 0].float().repeat_interleave(16), table[:, 1].float().repeat_interleave(16)
    assert torch.equal(v_hat, step * codes.float() + low)
    assert (v_hat - v).abs().max() <= step.max() / 2 + 1e-3


def test_stored_tensors_reproduce_the_weight_and_the_ops_compute_it():
    W, H = problem()
    res = spqr_quantize(W, H, outlier_threshold=0.5)
    t = pack_spqr(res, 3, 3)
    dense = dequantize_spqr_dense(
        t["codes"], t["scale_codes"], t["zero_codes"], t["scale_stats"], t["zero_stats"], t["perm"], 3, 16, 3, 16
    )
    assert torch.allclose(dense, res.dense, atol=1e-6)
    S = torch.zeros_like(W)
    rows = torch.repeat_interleave(torch.arange(64), (t["row_ptr"][1:] - t["row_ptr"][:-1]).long())
    S[rows, t["col_idx"].long()] = t["values"].float()
    assert torch.equal(S != 0, res.outliers & (res.outlier_values != 0))
    assert torch.allclose(dense + S, res.dequantized, atol=1e-6)
    x = torch.randn(2, 5, 128)
    y = spqr_dense_linear(
        x,
        t["codes"],
        t["scale_codes"],
        t["zero_codes"],
        t["scale_stats"],
        t["zero_stats"],
        t["perm"],
        None,
        3,
        16,
        3,
        16,
    ) + sparse_outlier_linear(x, t["row_ptr"], t["col_idx"], t["values"], 64)
    assert torch.allclose(y, x @ (dense + S).t(), atol=1e-4)
    # outliers keep their GPTQ-updated value: the residual is exactly what fp16 can hold of w − dense
    assert (res.outlier_values[~res.outliers] == 0).all()


@pytest.mark.parametrize("tau", [0.3, 1.0, 5.0, float("inf")])
def test_bits_per_weight_from_stored_tensors_equals_formula(tau):
    W, H = problem(seed=3)
    res = spqr_quantize(W, H, outlier_threshold=tau)
    t = pack_spqr(res, 3, 3)
    out, n = W.shape
    nnz = int(res.outliers.sum())
    formula = (
        3
        + Fraction(3 + 3, 16)
        + Fraction(64, 16 * 16)
        + 32 * Fraction(nnz, out * n)
        + Fraction(32 * (out + 1), out * n)
    )
    assert Fraction(stored_bits(t), out * n) == formula


def test_pass_rewrites_linear_into_dense_plus_sparse():
    model = make_model("llama")
    calib = [example_inputs("llama", 4, 16, seed=s) for s in range(3)]
    cm = qc.compile(
        model,
        example_inputs("llama"),
        recipe=[qc.passes.SpQR(outlier_threshold=0.5)],
        calibration=calib,
        progress=False,
    )
    gm = cm.graph_module
    sparse = [n for n in gm.graph.nodes if n.target is torch.ops.qc.sparse_outlier_linear.default]
    dense = [n for n in gm.graph.nodes if n.target is torch.ops.qc.spqr_dense_linear.default]
    assert len(sparse) == len(dense) == 14
    for s in sparse:  # add(dense(x), sparse(x)) on the same x
        (add,) = s.users
        assert add.target is torch.ops.aten.add.Tensor and add.args[0].target is torch.ops.qc.spqr_dense_linear.default
        assert add.args[0].args[0] is s.args[0]
    figures = cm.report.passes[0].layers["model.layers.0.mlp.up_proj"]
    assert 0 < figures["outlier_fraction"] < 0.1 and figures["top_outlier_columns"]
    assert figures["bits_per_weight"] > 3.625  # 3 + 6/16 + 64/256, plus outliers and row pointers
    layers = cm.report.passes[0].layers
    sizes = {p: model.get_submodule(p).weight.numel() for p in layers}
    weighted = sum(f["bits_per_weight"] * sizes[p] for p, f in layers.items()) / sum(sizes.values())
    assert bits_per_parameter(gm) == pytest.approx(weighted, rel=1e-12)  # model figure = layers' figures
    inputs = example_inputs("llama", 3, 11, seed=9)
    ref = main_output(model(**inputs))
    got = main_output(cm(input_ids=inputs["input_ids"]))
    assert ((got - ref).norm() / ref.norm()) < 0.2


def test_bad_settings_and_narrow_layers():
    for bad in (1.0, -0.1):
        with pytest.raises(qc.QuantizationError, match="outlier_fraction must be in"):
            qc.passes.SpQR(outlier_fraction=bad)
    with pytest.raises(qc.QuantizationError, match="selects every weight"):
        qc.passes.SpQR(outlier_threshold=0)
    with pytest.raises(qc.QuantizationError, match=r"SpQR\(stat_bits=None\)"):
        qc.passes.SpQR(stat_bits=None)
    W, H = problem()
    with pytest.raises(qc.QuantizationError, match="selects every weight"):
        spqr_quantize(W, H, outlier_threshold=0.0)
    with pytest.raises(qc.QuantizationError, match="not a multiple of the SpQR group size"):
        spqr_quantize(W[:, :8], H[:8, :8])

    class Narrow(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(32, 8)])

        def forward(self, x):
            return self.layers[0](x)

    gm = qc.capture(Narrow(), (torch.randn(2, 32),))  # skipped with a note, not an abort of the pass ...
    ctx = qc.PassContext(
        example_inputs=((torch.randn(2, 32),), {}), calibration=[((torch.randn(16, 32),), {})], progress=False
    )
    assert not qc.passes.SpQR().run(gm, ctx)
    notes = " ".join(ctx.record.notes)
    with pytest.raises(qc.PassError, match="SpQR provides OUTLIERS_SPLIT"):  # ... but the pipeline's contract fails
        qc.compile(
            Narrow(), (torch.randn(2, 32),), recipe="spqr-w3g16", calibration=[(torch.randn(16, 32),)], progress=False
        )
    assert re.search(r"layers\.0: kept in full precision \(.*(narrower than one group|cannot be stored)", notes), notes


def test_auto_bits_spqr_candidates_solved_together_store_each_candidates_own_tensors():
    """What auto:B scores on a sample of a layer's rows: both default SpQR candidates from one sweep,
    as LayerQuants equal to ``SpQR.quantize_rows``'s bit for bit (τ the whole layer's); GPTQ left out."""
    from types import SimpleNamespace

    from qcompiler.passes.mixed_precision import candidate_quantizer
    from qcompiler.passes.spqr_candidates import solve_spqr_candidates

    W, H = problem(out=128, seed=6)
    layer = SimpleNamespace(path="model.layers.0.mlp.down_proj", transposed=False)
    quantizers = {n: candidate_quantizer(n) for n in ("spqr-w3g16", "spqr-w4g16", "gptq-w4g128")}
    rows = torch.cat([torch.arange(32), torch.arange(64, 96)])
    solved = solve_spqr_candidates(quantizers, [(layer, W.index_select(0, rows), W)], H)[layer.path]
    assert set(solved) == {"spqr-w3g16", "spqr-w4g16"}
    for name, got in solved.items():
        want = quantizers[name].quantize_rows(layer, W, H, rows)
        assert got.tensors.keys() == want.tensors.keys()
        for key in want.tensors:
            assert torch.equal(got.tensors[key], want.tensors[key]), (name, key)
        assert torch.equal(got.dequantized, want.dequantized)
        assert got.figures == want.figures and got.rewrite == want.rewrite


def test_siblings_spqr_candidates_share_one_sweep_and_each_gets_its_own_solve():
    """Two layers reading one input (one H), one solved on a sample of its rows, the other whole: both
    candidates of both in one sweep, each result its own ``quantize_rows`` / ``quantize_layer``'s."""
    from types import SimpleNamespace

    from qcompiler.passes.mixed_precision import candidate_quantizer
    from qcompiler.passes.spqr_candidates import solve_spqr_candidates

    W, H = problem(out=128, seed=7)
    other = W[:64].flip(0) * 2.0
    q, k = (SimpleNamespace(path=f"model.layers.0.self_attn.{n}_proj", transposed=False) for n in "qk")
    quantizers = {n: candidate_quantizer(n) for n in ("spqr-w3g16", "spqr-w4g16")}
    rows = torch.arange(32, 96)
    solved = solve_spqr_candidates(quantizers, [(q, W.index_select(0, rows), W), (k, other, None)], H)
    for name, quantizer in quantizers.items():
        for layer, got, want in (
            (q, solved[q.path][name], quantizer.quantize_rows(q, W, H, rows)),
            (k, solved[k.path][name], quantizer.quantize_layer(k, other, H)),
        ):
            for key in want.tensors:
                assert torch.equal(got.tensors[key], want.tensors[key]), (layer.path, name, key)
            assert torch.equal(got.dequantized, want.dequantized)
