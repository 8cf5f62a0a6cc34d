"""Half-precision products on a CPU without half-precision units run in float32
(qcompiler/calib/cpu_products.py): the same numbers as the native kernel to one unit in the last
place, closer to the exact product, and calibration of a bf16 checkpoint quantizes alike."""

import pytest
import torch
from test_streaming import _calibration, _llama_folder

import qcompiler as qc
from qcompiler.calib import cpu_products
from qcompiler.models import load

aten = torch.ops.aten
BOTH = frozenset({torch.bfloat16, torch.float16})


def _cases(dtype):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    x, w, b = r(33, 96), r(40, 96), r(40)
    return [
        (aten.linear.default, (x, w), {}),
        (aten.linear.default, (x, w, b), {}),
        (aten.mm.default, (x, w.T), {}),
        (aten.addmm.default, (b, x, w.T), {}),
        (aten.bmm.default, (r(3, 17, 96), r(3, 96, 9)), {}),
        (aten.matmul.default, (r(2, 3, 17, 96), r(96, 9)), {}),
    ]


def _ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at each entry of ``t``."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    exponent = torch.floor(torch.log2(t.double().abs().clamp_min(2.0**-14)))
    return 2.0 ** (exponent - mantissa)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_products_match_the_native_kernel_to_one_ulp_and_round_the_exact_product(dtype, monkeypatch):
    monkeypatch.setattr(cpu_products, "slow_half_dtypes", lambda: BOTH)
    for target, args, kwargs in _cases(dtype):
        fast = cpu_products.float32_product(target, args, kwargs)
        native = target(*args, **kwargs)
        exact = target(*(a.double() for a in args), **kwargs)
        assert fast is not None and fast.dtype == dtype and fast.shape == native.shape, target
        assert ((fast.double() - native.double()).abs() <= _ulp(native, dtype)).all(), target
        # float32 accumulation then one rounding: within half a unit of the exact product, plus slack
        # for the float32 sum (K = 96 terms of 2^-24 relative each)
        assert ((fast.double() - exact).abs() <= 0.5 * _ulp(exact, dtype) + 96 * 2.0**-24 * exact.abs().max()).all()
        assert (fast.double() - exact).abs().mean() <= (native.double() - exact).abs().mean() * 1.05 + 1e-12


def test_products_run_as_they_are_where_the_cpu_has_units_or_nothing_is_half(monkeypatch):
    target, args, kwargs = _cases(torch.bfloat16)[0]
    monkeypatch.setattr(cpu_products, "slow_half_dtypes", lambda: frozenset())
    assert cpu_products.float32_product(target, args, kwargs) is None
    monkeypatch.setattr(cpu_products, "slow_half_dtypes", lambda: BOTH)
    x, w = args
    assert cpu_products.float32_product(target, (x.float(), w.float()), {}) is None
    assert cpu_products.float32_product(target, (x, w.half()), {}) is None  # mixed dtypes: left to torch
    assert cpu_products.float32_product(aten.add.Tensor, (x, x), {}) is None


def test_a_bf16_checkpoint_calibrates_through_float32_products_and_quantizes_alike(tmp_path, monkeypatch):
    """GPTQ on a streamed bf16 model: every calibration product goes through float32 when the CPU
    is taken as lacking bf16 units, and the layers' errors and codes match the native kernels'."""
    folder = _llama_folder(tmp_path / "bf16", dtype=torch.bfloat16, layers=2)
    calls = []
    original = cpu_products.float32_product

    def counted(target, args, kwargs):
        out = original(target, args, kwargs)
        calls.append(out is not None)
        return out

    def run(slow):
        monkeypatch.setattr(cpu_products, "slow_half_dtypes", lambda: slow)
        streamed = load(folder, stream=True)
        x = streamed.example_inputs()
        cm = qc.compile(
            streamed.model, x, recipe="gptq-w4g128", calibration=_calibration(), progress=False, device=None
        )
        return {k: f["rel_error"] for k, f in cm.report.passes[0].layers.items()}, cm.graph_module.state_dict()

    native_err, native = run(frozenset())
    monkeypatch.setattr(cpu_products, "float32_product", counted)
    fast_err, fast = run(BOTH)
    assert sum(calls) >= 2 * 7 * 3, "every linear of both blocks, for each of 3 batches, in float32"
    assert native_err.keys() == fast_err.keys() and len(native_err) == 14
    for layer, err in native_err.items():
        assert fast_err[layer] == pytest.approx(err, rel=0.01), layer
    codes = [k for k, v in native.items() if v.dtype in (torch.int32, torch.uint8, torch.int8)]
    assert codes
    same = sum(int(torch.equal(native[k], fast[k])) for k in codes)
    agree = sum((native[k] == fast[k]).float().mean().item() for k in codes) / len(codes)
    assert agree >= 0.98, (same, len(codes), agree)
