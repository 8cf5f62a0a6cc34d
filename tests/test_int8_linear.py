"""The int8 linear op is integer-exact, and close to the FP matmul within its rounding bound."""

import pytest
import torch
from tiny_models import example_inputs, main_output, make_model

import qcompiler as qc
from qcompiler.algorithms.int8 import quantize_per_token, quantize_weight_per_channel
from qcompiler.layouts.int8 import int8_matmul

I8 = torch.ops.qc.int8_linear.default


def test_int8_linear_equals_independent_integer_matmul():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 48, generator=gen)
    W = torch.randn(20, 48, generator=gen)
    wq, ws = quantize_weight_per_channel(W)
    bias = torch.randn(20, generator=gen)
    y = torch.ops.qc.int8_linear(x, wq, ws, bias, None, None)
    # independent: plain Python-int dot products of the same int8 codes
    xq, sx = quantize_per_token(x)
    xi, wi = xq.reshape(-1, 48).tolist(), wq.tolist()
    acc = torch.tensor([[sum(a * b for a, b in zip(row, wrow)) for wrow in wi] for row in xi], dtype=torch.int64)
    assert torch.equal(int8_matmul(xq.reshape(-1, 48), wq).long(), acc)
    expected = acc.double().reshape(3, 5, 20) * sx.double() * ws.double() + bias.double()
    assert torch.allclose(y.double(), expected, rtol=1e-6, atol=1e-6)
    # rounding bound: x·w − x̂·ŵ = (x − x̂)·ŵ + x·(w − ŵ), |x − x̂| <= s_x/2, |w − ŵ| <= s_w/2
    ref = x @ W.t() + bias
    wh = wq.float() * ws.unsqueeze(1)
    bound = (sx / 2) * wh.abs().sum(1) + x.abs().sum(-1, keepdim=True) * (ws / 2)
    assert ((y - ref).abs() <= bound + 1e-5).all()
    assert ((y - ref).abs() > 0).any()


def test_static_scale_and_fused_smoothing_inputs():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 32, generator=gen)
    W = torch.randn(16, 32, generator=gen)
    wq, ws = quantize_weight_per_channel(W)
    inv = torch.rand(32, generator=gen) + 0.5
    scale = torch.tensor(x.abs().max().item() / 127)
    y = torch.ops.qc.int8_linear(x, wq, ws, None, scale, inv)
    xq = torch.clamp(torch.round(x * inv / scale), -127, 127).to(torch.int8)
    assert torch.allclose(y, (xq.float() @ wq.float().t()) * scale * ws, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "bert", "gpt2"])
def test_lowering_replaces_block_linears_and_fuses_explicit_smoothing(arch):
    model = make_model(arch)
    calib = [example_inputs(arch, 4, 16, seed=s) for s in range(2)]
    cm = qc.compile(model, example_inputs(arch), recipe="w8a8-smoothquant", calibration=calib, progress=False)
    gm = cm.graph_module
    n_int8 = sum(n.target is I8 for n in gm.graph.nodes)
    assert n_int8 == {"llama": 14, "bert": 12, "gpt2": 8}[arch]
    assert not any("qc_smooth_inv" in n.meta for n in gm.graph.nodes)  # explicit multiplies were fused
    inputs = example_inputs(arch, 3, 9, seed=3)
    ref = main_output(model(**inputs))
    got = main_output(cm(**{k: v for k, v in inputs.items() if k != "use_cache"}))
    assert ((got - ref).norm() / ref.norm()) < 0.05
    static = qc.compile(model, example_inputs(arch), recipe="w8a8-static", calibration=calib, progress=False)
    assert all(n.args[4] is not None for n in static.graph_module.graph.nodes if n.target is I8)


def test_lowering_settings_are_validated():
    with pytest.raises(qc.QuantizationError, match="activations must be one of"):
        qc.passes.LowerInt8(activations="per_tensor_dynamic")
    with pytest.raises(qc.PipelineError, match="LowerInt8 needs calibration data"):
        qc.compile(make_model("llama"), example_inputs("llama"), recipe="w8a8-static", progress=False)


@pytest.mark.parametrize("m, k, n", [(1, 3000, 5), (33, 7, 9), (4, 2048, 64)])
def test_int8_matmul_is_exact_where_float32_is_not(m, k, n):
    # all codes at ±127: the sums reach k·127², past float32's 2^24 exact-integer range for k > 1040
    gen = torch.Generator().manual_seed(m)
    xq = (torch.randint(0, 2, (m, k), generator=gen) * 254 - 127).to(torch.int8)
    wq = (torch.randint(0, 2, (n, k), generator=gen) * 254 - 127).to(torch.int8)
    exact = xq.long() @ wq.long().t()
    got = int8_matmul(xq, wq)
    assert got.dtype == torch.int32 and torch.equal(got.long(), exact)
