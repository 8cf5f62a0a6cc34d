"""``backend="triton"`` gives the eager backend's outputs on the bundled models; fallbacks are reported."""

import warnings

import pytest
import torch
from tiny_models import example_inputs, main_output, make_model

import qcompiler as qc
from qcompiler.backends import prepare_triton
from qcompiler.backends.triton import _OnDevice
from qcompiler.errors import BackendError
from qcompiler.models import load

# fp32 activations: kernels and references differ only in summation order.
TOLERANCE = 1e-4  # max |triton − eager| / max |eager|
# W8A8 with the RMSNorm fused into its quantizer: the norm's sum of squares adds in another order, so
# scales move by ~1e-7 and, downstream, an int8 code can cross a rounding boundary — W8A8 is
# discontinuous, so the outputs part by more than rounding (tinylm 2x16 tokens: 8.5e-3) while the
# quantized model stays exactly as good: its error against the FP model must equal eager's within 2 %.
RECIPES = ["w8a8-smoothquant", "gptq-w4g128", "gptq-w3g128", "spqr-w3g16"]


@pytest.fixture(scope="module")
def tinylm():
    return load("tinylm")


def _on_triton(cm, runner):
    return qc.CompiledModel(cm.graph_module, cm.recipe, cm.report, "triton", runner, cm.example_inputs)


def _relative_gap(cm, runner, inputs):
    with torch.no_grad():
        expected = main_output(cm(**inputs))
        got = main_output(_on_triton(cm, runner)(**inputs))  # called like the model (a causal LM's cache graph too)
    return _gap(got, expected)


# Every kernel these run has its plain-torch twin test in test_triton_kernels.py (SpQR dense, CSR SpMM,
# 3-bit GEMM, W8A8 GEMM, MiniLM's LayerNorm path): CI runs tinylm's W4 and W8A8 end to end (slow
# tier); the rest only a release checks.
_TRITON_TIER = {("tinylm", "w8a8-smoothquant"): pytest.mark.slow, ("tinylm", "gptq-w4g128"): pytest.mark.slow}


@pytest.mark.parametrize(
    "model_name,recipe",
    [
        pytest.param(m, r, id=f"{m}-{r}", marks=_TRITON_TIER.get((m, r), pytest.mark.release))
        for m in ("tinylm", "minilm")
        for r in RECIPES
    ],
)
def test_triton_backend_matches_eager_on_bundled_models(model_name, recipe, tinylm, minilm):
    loaded = tinylm if model_name == "tinylm" else minilm
    cm = qc.compile(
        loaded.model, loaded.example_inputs(), recipe=recipe, calibration=loaded.calibration(8), progress=False
    )
    runner = prepare_triton(cm.graph_module)
    kernels = {figures["kernel"] for figures in runner.record.layers.values()}
    assert kernels and not any(k.startswith("reference") for k in kernels) and not runner.record.notes
    prefix, count = ("model.layers.", 28) if model_name == "tinylm" else ("encoder.layer.", 36)
    assert len(runner.record.layers) == count and all(k.startswith(prefix) for k in runner.record.layers)
    fused_norm = any("in its RMSNorm" in k for k in kernels)  # tinylm's W8A8 (MiniLM has LayerNorms)
    sizes = [(1, 1), (1, 8)] + ([(2, 16)] if model_name == "tinylm" else [])  # GEMV, split-K, prefill
    for batch, seq in sizes:
        inputs = loaded.example_inputs(batch=batch, seq=seq)
        if not fused_norm:
            assert _relative_gap(cm, runner, inputs) < TOLERANCE
            continue
        with torch.no_grad():
            fp = main_output(loaded.model(**inputs))
        err_eager = _gap(main_output(cm(**inputs)), fp)
        err_triton = _gap(main_output(_on_triton(cm, runner)(**inputs)), fp)
        assert abs(err_triton - err_eager) <= 0.02 * err_eager, (batch, seq, err_triton, err_eager)


def test_compile_with_triton_backend_reports_its_plan_and_gives_the_eager_outputs(tinylm):
    cm = qc.compile(tinylm.model, tinylm.example_inputs(), recipe="rtn-w4g128", backend="triton", progress=False)
    plan = cm.report.passes[-1]
    assert plan.name == "backend:triton"
    assert plan.layers["model.layers.0.self_attn.q_proj"] == {"kernel": "layout_gemv/gemm"}
    assert len(plan.layers) == 4 * 7
    inputs = tinylm.example_inputs(batch=1, seq=5)
    with torch.no_grad():
        got, expected = main_output(cm(**inputs)), main_output(cm.with_backend("eager")(**inputs))
    assert ((got - expected).abs().max() / expected.abs().max()).item() < TOLERANCE


def test_unsupported_combination_falls_back_with_a_named_warning():
    model = make_model("llama").double()
    inputs = example_inputs("llama")
    cm = qc.compile(model, inputs, recipe="rtn-w4g128", progress=False)
    with pytest.warns(UserWarning, match="torch.float64 activations are not supported.*fell back to the reference"):
        runner = prepare_triton(cm.graph_module)
    assert all(f["kernel"].startswith("reference (torch.float64") for f in runner.record.layers.values())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fallback runs the reference ops, silently now
        torch.testing.assert_close(main_output(runner(**inputs)), main_output(cm(**inputs)))


def test_no_gpu_and_no_interpreter_is_a_clear_error(monkeypatch):
    from qcompiler.kernels import tuning

    monkeypatch.setattr(tuning, "INTERPRET", False)
    cm = qc.compile(make_model("llama"), example_inputs("llama"), recipe="rtn-w4g128", progress=False)
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(BackendError, match="TRITON_INTERPRET=1"):
        prepare_triton(cm.graph_module)


@pytest.mark.slow
def test_gpu_decode_benchmark_runs_and_its_engines_agree(tmp_path):
    """benchmarks/gpu_decode.py --smoke: the GPU decode benchmark's path on a 2-layer toy; every
    triton engine (static cache) gives the eager backend's greedy tokens for its recipe."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "gpu_decode.py"
    spec = importlib.util.spec_from_file_location("gpu_decode_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--out", str(tmp_path / "gpu_decode.json")]) == 0
    rows = {r["engine"]: r for r in json.loads((tmp_path / "gpu_decode.json").read_text())["rows"]}
    for recipe in bench.RECIPES:
        label = "fp16" if recipe == "none" else recipe
        assert rows[f"triton {label}"]["tokens"] == rows[f"eager {label}"]["tokens"], recipe
        assert rows[f"triton {label}"]["decode_tokens_per_s"] > 0
    assert rows["triton fp16, dynamic cache"]["tokens"] == rows["triton fp16"]["tokens"]


def test_w8a8_siblings_quantize_their_shared_input_once_inside_their_rms_norm():
    """q/k/v and gate/up read one RMSNorm's output: one fused norm + quantizer launch each, the norm's
    own ops gone from the graph (the final norm, read by the fp head, stays); outputs equal eager's."""
    model, inputs = make_model("llama"), example_inputs("llama")
    cm = qc.compile(model, inputs, recipe="w8a8", progress=False)
    runner = prepare_triton(cm.graph_module)
    names = [getattr(n.target, "__name__", "") for n in runner.graph.nodes]
    layers = runner.record.layers
    blocks = len({k.split(".self_attn")[0].split(".mlp")[0] for k in layers})
    assert names.count("triton_rmsnorm_quantize") == 2 * blocks and "triton_quantize_rows" not in names
    fused = [k for k, v in layers.items() if "quantized in its RMSNorm" in v["kernel"]]
    assert len(fused) == 5 * blocks  # (q, k, v) and (gate, up) per block; o_proj and down_proj read no norm
    rsqrt = [n for n in runner.graph.nodes if n.target == torch.ops.aten.rsqrt.default]
    assert len(rsqrt) == 1  # the final norm's
    with torch.no_grad():  # W8A8_NORM note above: as good as eager against the FP model
        fp, eager, fused = (main_output(f(**inputs)) for f in (model, cm, runner))
    assert abs(_gap(fused, fp) - _gap(eager, fp)) <= 0.02 * _gap(eager, fp)


def test_w8a8_siblings_without_an_rms_norm_share_one_plain_quantizer():
    """OPT's LayerNorm is not fused: q/k/v sharing its output share one plain quantizer launch
    (bit-identical to eager under the interpreter: the quantizer kernel is exact; on a GPU the FP ops
    around the int8 GEMM round differently from the CPU's, 2e-7 apart on the H200)."""
    model, inputs = make_model("opt"), example_inputs("opt")
    cm = qc.compile(model, inputs, recipe="w8a8", progress=False)
    runner = prepare_triton(cm.graph_module)
    names = [getattr(n.target, "__name__", "") for n in runner.graph.nodes]
    assert "triton_rmsnorm_quantize" not in names and "triton_quantize_rows" in names
    with torch.no_grad():
        tol = dict(rtol=1e-5, atol=1e-6) if isinstance(runner, _OnDevice) else dict(rtol=0, atol=0)
        torch.testing.assert_close(main_output(runner(**inputs)), main_output(cm(**inputs)), **tol)


def _gap(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _as_good_as_eager(cm, runner, fp_model, inputs, activations_rounded: bool) -> None:
    """Weight-only formats: the kernels give eager's outputs (fp32 rounding). FP8 activations are
    discontinuous: an input moved by 3e-6 (another summation order upstream) can flip one e4m3
    rounding by half a step (up to 1/16 of that value) and the flips compound over the layers — so
    there the model must be exactly as good: its error against the FP model within 5 % of eager's."""
    with torch.no_grad():
        eager = main_output(cm(**inputs))
        got = main_output(_on_triton(cm, runner)(**inputs))
        if not activations_rounded:
            assert _gap(got, eager) < TOLERANCE
            return
        fp = main_output(fp_model(**inputs))
    err_eager, err_triton = _gap(eager, fp), _gap(got, fp)
    assert abs(err_triton - err_eager) <= 0.05 * err_eager, (err_triton, err_eager)


@pytest.mark.parametrize(
    "recipe,label",
    [("fp8-dynamic", "fp8_gemm"), ("rtn-fp8", "fp8_gemm"), ("rtn-mxfp4", "fp4_gemv/dequant")],
)
def test_triton_backend_runs_the_float_formats(recipe, label):
    """Each FP8 / FP4 node becomes its kernel (no fallback) and the model gives eager's outputs."""
    model = make_model("llama")
    cm = qc.compile(model, example_inputs("llama"), recipe=recipe, progress=False)
    runner = prepare_triton(cm.graph_module)
    assert {f["kernel"] for f in runner.record.layers.values()} == {label} and not runner.record.notes
    _as_good_as_eager(cm, runner, model, example_inputs("llama"), recipe == "fp8-dynamic")


def test_nvfp4_w4a4_and_the_fp8_kv_cache_run_kernels_too():
    """W4A4 emulated (the inputs rounded to NVFP4 by a kernel, an fp32 matmul) and the KV cache's
    e4m3 rounding: every qc node of both recipes is a kernel, and the outputs are eager's."""
    model, inputs = make_model("llama"), example_inputs("llama")
    for recipe, labels in (
        ("nvfp4-w4a4", {"fp4_gemv/dequant (W4A4"}),
        ("fp8-dynamic-kv", {"fp8_gemm", "fp8_kv_quant"}),
    ):
        cm = qc.compile(model, inputs, recipe=recipe, calibration=[inputs], progress=False)
        runner = prepare_triton(cm.graph_module)
        assert {f["kernel"][:22] for f in runner.record.layers.values()} == labels and not runner.record.notes
        with torch.no_grad():
            assert _gap(main_output(_on_triton(cm, runner)(**inputs)), main_output(cm(**inputs))) < TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fp8-block-dynamic", "gptq-nvfp4"])
def test_triton_backend_runs_the_float_formats_on_tinylm(recipe, tinylm):
    """128 x 128 weight blocks with per-128 activation groups, and GPTQ-solved NVFP4: decode (GEMV,
    split-K) and prefill (dequantize + matmul; the fp8 prefill tiles) on a trained model."""
    cm = qc.compile(
        tinylm.model, tinylm.example_inputs(), recipe=recipe, calibration=tinylm.calibration(8), progress=False
    )
    runner = prepare_triton(cm.graph_module)
    assert len(runner.record.layers) == 28 and not runner.record.notes
    for batch, seq in ((1, 1), (1, 8), (2, 16)):
        _as_good_as_eager(cm, runner, tinylm.model, tinylm.example_inputs(batch=batch, seq=seq), "dynamic" in recipe)
