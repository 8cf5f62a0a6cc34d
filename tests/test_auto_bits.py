"""Automatic mixed precision: the knapsack is optimal, the error-minimizing grid is never worse than
min-max, and ``auto:B`` meets its budget exactly as the report counts bits, in one graph that reloads."""

import itertools
import random
import re

import pytest
import torch
from tiny_models import example_inputs, main_output, make_model

import qcompiler as qc
from qcompiler.algorithms.allocation import allocate, allocate_reference
from qcompiler.algorithms.gptq import gptq_quantize, gptq_quantize_reference, rtn_quantize
from qcompiler.algorithms.output_error import output_error
from qcompiler.algorithms.quant_grid import _row_error, fit_grid, search_grid
from qcompiler.errors import QCompilerError, QuantizationError, RecipeError
from qcompiler.evaluation.eval import bits_per_parameter
from qcompiler.evaluation.report_page import write_report
from qcompiler.layouts.gptq import GPTQ_TENSORS, pack_gptq

QL = torch.ops.qc.quant_linear.default
SMALL = ("gptq-w2g64", "gptq-w2g32", "gptq-w3g32", "gptq-w4g32", "gptq-w8g32", "rtn-w4g32")


def calib(n=2, seq=16):
    return [{"input_ids": torch.randint(0, 96, (4, seq), generator=torch.Generator().manual_seed(i))} for i in range(n)]


def test_knapsack_finds_the_least_distortion_within_the_budget():
    rng = random.Random(0)
    for _ in range(60):
        layers, cands = rng.randint(1, 5), rng.randint(1, 4)
        cost = [[rng.uniform(1, 10) for _ in range(cands)] for _ in range(layers)]
        dist = [[rng.uniform(0, 1) for _ in range(cands)] for _ in range(layers)]
        budget = rng.uniform(sum(map(min, cost)), sum(map(max, cost)) + 1)
        fast, slow = allocate(cost, dist, budget), allocate_reference(cost, dist, budget)
        assert sum(cost[i][c] for i, c in enumerate(fast)) <= budget
        assert sum(dist[i][c] for i, c in enumerate(fast)) == pytest.approx(
            sum(dist[i][c] for i, c in enumerate(slow)), abs=1e-12
        )


def test_knapsack_refuses_a_budget_below_the_cheapest_allocation():
    with pytest.raises(QuantizationError, match=r"no allocation fits 2 bits: the cheapest candidates need 3"):
        allocate([[1.0, 2.0], [2.0, 3.0]], [[1.0, 0.0], [1.0, 0.0]], 2.0)


@pytest.mark.parametrize("bits,sym", list(itertools.product([2, 3, 4], [False, True])))
def test_error_minimizing_grid_is_never_worse_than_min_max_per_row(bits, sym):
    torch.manual_seed(bits)
    w = torch.randn(64, 32) * torch.rand(64, 1) * 3
    w[::7, 3] *= 10  # outliers: clipping them pays
    imp = torch.rand(32) + 0.1
    minmax, searched = fit_grid(w, bits, sym), search_grid(w, bits, sym, imp)
    before, after = _row_error(w, minmax, bits, imp), _row_error(w, searched, bits, imp)
    assert bool((after <= before * (1 + 1e-6)).all())
    assert after.sum() < before.sum()  # and strictly better somewhere (a clipped range pays on some row)


def test_mse_grid_gptq_equals_its_reference_twin_and_lowers_the_output_error():
    torch.manual_seed(0)
    X = torch.randn(1024, 128) * torch.linspace(0.2, 3, 128)
    W = torch.randn(48, 128)
    W[:, :2] *= 8
    H = 2 * X.t() @ X / X.shape[0]
    for kw in [dict(), dict(act_order=True), dict(act_order=True, static_groups=True)]:
        fast = gptq_quantize(W, H, bits=3, group_size=32, grid="mse", **kw)
        ref = gptq_quantize_reference(W, H, bits=3, group_size=32, grid="mse", **kw)
        assert torch.allclose(fast.dequantized, ref.dequantized, atol=1e-5), kw
        plain = gptq_quantize(W, H, bits=3, group_size=32, **kw)
        assert output_error(W, fast.dequantized, H) < 0.95 * output_error(W, plain.dequantized, H), kw
    rtn_plain = rtn_quantize(W, bits=3, group_size=32)
    rtn_mse = rtn_quantize(W, bits=3, group_size=32, grid="mse", importance=torch.diagonal(H))
    assert output_error(W, rtn_mse.dequantized, H) < 0.95 * output_error(W, rtn_plain.dequantized, H)


@pytest.fixture(scope="module")
def llama():
    return make_model("llama")


@pytest.mark.parametrize("budget", [2.5, 3.25, 4.5])
def test_auto_meets_its_budget_as_the_report_counts_bits(llama, budget):
    recipe = [qc.passes.AutoBits(budget=budget, candidates=SMALL, samples=4)]
    cm = qc.compile(llama, example_inputs("llama"), recipe=recipe, calibration=calib(), progress=False)
    bits = bits_per_parameter(cm.graph_module)
    assert budget - 0.02 <= bits <= budget, bits
    layers = cm.report.passes[0].layers
    assert all("candidate" in f and "sensitivity" in f for f in layers.values())
    params = {path: _weights(llama, path) for path in layers}
    total = sum(f["bits_per_weight"] * params[p] for p, f in layers.items()) / sum(params.values())
    assert total == pytest.approx(bits, rel=1e-9)  # the report's per-layer figures add up to bits_per_parameter
    widths = {
        n.kwargs.get("bits", n.args[6] if len(n.args) > 6 else None)
        for n in cm.graph_module.graph.nodes
        if n.target is QL
    }
    assert len(widths) > 1, widths  # a real mix, not one width everywhere


def test_tied_siblings_share_a_candidate_and_stay_within_the_budget(llama):
    recipe = [qc.passes.AutoBits(budget=3.25, candidates=SMALL, samples=4, tie_siblings=True)]
    cm = qc.compile(llama, example_inputs("llama"), recipe=recipe, calibration=calib(), progress=False)
    layers = cm.report.passes[0].layers
    for block in ("model.layers.0.", "model.layers.1."):  # what vLLM fuses shares one setting
        for siblings in (
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            ("mlp.gate_proj", "mlp.up_proj"),
        ):
            assert len({layers[block + s]["candidate"] for s in siblings}) == 1, block
    assert bits_per_parameter(cm.graph_module) <= 3.25


def _weights(model, path):
    return model.get_submodule(path).weight.numel()


def test_more_bits_never_measure_worse_on_the_allocators_own_objective(llama):
    """The allocation's summed sensitivity falls as the budget grows (the knapsack is monotone)."""
    damage = []
    for budget in (2.5, 3.0, 3.5, 4.5):
        recipe = [qc.passes.AutoBits(budget=budget, candidates=SMALL, samples=4)]
        cm = qc.compile(llama, example_inputs("llama"), recipe=recipe, calibration=calib(), progress=False)
        damage.append(sum(f["sensitivity"] for f in cm.report.passes[0].layers.values()))
    assert damage == sorted(damage, reverse=True), damage


def test_auto_artifact_reloads_bit_identical(llama, tmp_path):
    cm = qc.compile(
        llama,
        example_inputs("llama"),
        recipe=[qc.passes.AutoBits(budget=3.0, candidates=SMALL, samples=2)],
        calibration=calib(),
        progress=False,
    )
    cm.save(tmp_path / "art")
    back = qc.load(tmp_path / "art")
    x = example_inputs("llama")
    assert torch.equal(main_output(cm(**x)), main_output(back(**x)))
    assert back.recipe.passes[0] == qc.passes.AutoBits(budget=3.0, candidates=SMALL, samples=2)
    page = write_report(tmp_path / "art", tmp_path / "report").read_text()
    assert "## Allocation" in page and page.count("| <code>model.layers.") == 14


def test_mixed_precision_plan_is_followed_layer_by_layer(llama):
    plan = (("model.layers.0.mlp.down_proj", "gptq-w8g32"), ("model.layers.1.self_attn.q_proj", "rtn-w2g32"))
    p = qc.passes.MixedPrecision(plan=plan, default="gptq-w4g32")
    cm = qc.compile(llama, example_inputs("llama"), recipe=[p], calibration=calib(), progress=False)
    layers = cm.report.passes[0].layers
    assert layers["model.layers.0.mlp.down_proj"]["candidate"] == "gptq-w8g32"
    assert layers["model.layers.1.self_attn.q_proj"]["candidate"] == "rtn-w2g32"
    assert layers["model.layers.1.mlp.up_proj"]["candidate"] == "gptq-w4g32"
    assert {f["bits"] for f in layers.values()} == {2, 4, 8}


@pytest.mark.parametrize(
    "recipe,message",
    [
        ("auto:abc", r"'abc' is not a number of bits per parameter"),
        ("auto:17", r"budget 17.0 bits per parameter is outside \(0, 16\]"),
        ("auto:0", r"budget 0.0 bits per parameter is outside"),
        (
            "auto:1.0",
            r"budget 1 bits per parameter is below the smallest allocation these candidates allow "
            r"\(at least 2\.\d+\)",
        ),
    ],
)
def test_bad_budgets_are_one_line_errors_naming_the_value(llama, recipe, message):
    with pytest.raises((QCompilerError, RecipeError), match=message) as info:
        qc.compile(llama, example_inputs("llama"), recipe=recipe, calibration=calib(), progress=False)
    assert "\n" not in str(info.value)


def test_auto_without_calibration_is_refused_before_any_work(llama):
    with pytest.raises(QCompilerError, match="calibration"):
        qc.compile(llama, example_inputs("llama"), recipe="auto:3", progress=False)


def test_a_mixed_plan_from_a_recipe_file_runs_and_its_artifact_reloads(llama, tmp_path):
    (tmp_path / "mixed.yaml").write_text(
        "name: mixed\npasses:\n  - pass: MixedPrecision\n    default: gptq-w4g32\n"
        "    plan: [[model.layers.0.mlp.down_proj, gptq-w8g32], [model.layers.1.self_attn.q_proj, gptq-w2g32]]\n"
    )
    cm = qc.compile(
        llama, example_inputs("llama"), recipe=str(tmp_path / "mixed.yaml"), calibration=calib(), progress=False
    )
    assert cm.report.passes[0].layers["model.layers.0.mlp.down_proj"]["bits"] == 8
    cm.save(tmp_path / "art")
    back = qc.load(tmp_path / "art")
    assert back.recipe.passes == cm.recipe.passes
    x = example_inputs("llama")
    assert torch.equal(main_output(cm(**x)), main_output(back(**x)))
    (tmp_path / "bad.yaml").write_text(
        "name: bad\npasses:\n  - pass: MixedPrecision\n    plan: [[a.b, gptq-w4g32, x]]\n"
    )
    with pytest.raises(
        RecipeError, match=r"plan=\[\['a.b', 'gptq-w4g32', 'x'\]\] must be a list of \[string, string\]"
    ):
        qc.compile(llama, example_inputs("llama"), recipe=str(tmp_path / "bad.yaml"), calibration=calib())


def test_a_mixed_graph_exports_gptq_with_per_module_overrides_and_imports_bit_identical(llama, tmp_path):
    import json

    from qcompiler import import_gptq
    from qcompiler.interop import export_compressed_tensors, export_gptq

    plan = (("model.layers.0.mlp.down_proj", "gptq-w8g32"), ("model.layers.1.self_attn.q_proj", "rtn-w2g64"))
    cm = qc.compile(
        llama,
        example_inputs("llama"),
        recipe=[qc.passes.MixedPrecision(plan=plan, default="gptq-w4g32")],
        calibration=calib(),
        progress=False,
    )
    export_gptq(cm, tmp_path / "gptq", progress=lambda _: None)
    quant = json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]
    assert (quant["bits"], quant["group_size"]) == (4, 32)  # the setting holding the most weights
    assert quant["dynamic"] == {
        r"+:model\.layers\.0\.mlp\.down_proj$": {"bits": 8, "group_size": 32},
        r"+:model\.layers\.1\.self_attn\.q_proj$": {"bits": 2, "group_size": 64},
    }
    back = import_gptq(tmp_path / "gptq")
    x = example_inputs("llama")
    assert torch.equal(main_output(cm(**x)), main_output(back(**x)))
    assert {p: f["bits"] for p, f in back.report.passes[0].layers.items()} == {
        p: f["bits"] for p, f in cm.report.passes[0].layers.items()
    }
    export_compressed_tensors(cm, tmp_path / "ct", progress=lambda _: None)
    groups = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["config_groups"]
    widths = sorted((g["weights"]["num_bits"], g["weights"]["group_size"], len(g["targets"])) for g in groups.values())
    assert widths == [(2, 64, 1), (4, 32, 12), (8, 32, 1)]  # one group of 64 spans the row, written as a group


@pytest.mark.parametrize(
    "name",
    ["gptq-w3g32", "rtn-w2g64", "gptq-w8g128", "spqr-w3g16", "gptq-fp8", "rtn-fp8-block", "gptq-nvfp4", "gptq-mxfp4"],
)
def test_the_early_budget_check_counts_what_a_candidate_stores(name):
    from qcompiler.ir.graph import LinearLayer
    from qcompiler.layouts import stored_bits
    from qcompiler.passes.auto_bits import _least_bits
    from qcompiler.passes.mixed_precision import candidate_quantizer

    W, X = torch.randn(64, 96), torch.randn(512, 96)
    layer = LinearLayer(None, "x", None, None, None, False)
    stored = stored_bits(candidate_quantizer(name).quantize_layer(layer, W, 2 * X.t() @ X / 512).tensors)
    if name.startswith("spqr"):
        assert _least_bits(name, 64, 96) < stored  # a lower bound: its statistics and outliers come on top
    else:
        assert _least_bits(name, 64, 96) == stored  # exact: codes and scales (96 = 1.5 groups of 64), NVFP4's global


SIGNROUND_SMALL = ("gptq-w2g32", "gptq-w3g32", "gptq-w4g32", "gptq-w8g32")


def test_signround_follows_a_plan_layer_by_layer_and_starts_from_each_layers_rtn(llama):
    """SignRound with a plan and no tuning steps stores each layer's searched-grid round-to-nearest
    at its planned bits and group size: codes, scales and zeros exactly ``rtn_quantize``'s."""
    paths = [n for n, m in llama.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    widths = ((2, 32), (3, 32), (4, 32), (8, 32), (4, 16))
    plan = {p: widths[i % len(widths)] for i, p in enumerate(paths)}
    recipe = [qc.passes.SignRound(plan=tuple((p, f"gptq-w{b}g{g}") for p, (b, g) in plan.items()), iters=0)]
    cm = qc.compile(llama, example_inputs("llama"), recipe=recipe, calibration=calib(), progress=False)
    state = cm.graph_module.state_dict()
    for path, (bits, group) in plan.items():
        ref = rtn_quantize(llama.get_submodule(path).weight.detach(), bits=bits, group_size=group, grid="mse")
        packed = pack_gptq(ref.codes, ref.scales, ref.zeros, ref.g_idx, bits, group)
        for name, want in zip(GPTQ_TENSORS, packed):
            assert torch.equal(state[f"{path}.{name}"], want), (path, name)
    layers = cm.report.passes[0].layers
    assert {p: (f["bits"], f["candidate"]) for p, f in layers.items()} == {
        p: (b, f"gptq-w{b}g{g}") for p, (b, g) in plan.items()
    }


def test_auto_signround_quantizes_autos_allocation_within_the_budget(llama):
    """``finish="signround"``: the allocation auto makes from the same candidates, each layer at its
    planned bits, tuned (the block error never above round-to-nearest's), within the budget."""
    kw = dict(budget=3.25, candidates=SIGNROUND_SMALL, samples=4)
    x = example_inputs("llama")
    plain = qc.compile(llama, x, recipe=[qc.passes.AutoBits(**kw)], calibration=calib(), progress=False)
    tuned = qc.compile(
        llama, x, recipe=[qc.passes.AutoBits(**kw, finish="signround")], calibration=calib(), progress=False
    )
    plan = {p: f["candidate"] for p, f in plain.report.passes[0].layers.items()}
    layers = tuned.report.passes[0].layers
    assert {p: f["candidate"] for p, f in layers.items()} == plan
    bits = bits_per_parameter(tuned.graph_module)
    assert bits == pytest.approx(bits_per_parameter(plain.graph_module), rel=1e-12) and bits <= 3.25
    notes = [n for n in tuned.report.passes[0].notes if "SignRound block output error" in n]
    assert len(notes) == 2  # one tuning per block
    for note in notes:
        first, best = (float(v) for v in re.findall(r"error ([\d.e-]+) .*-> ([\d.e-]+)", note)[0])
        assert best <= first, note


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(finish="awq"), "finish='awq'; choose one of gptq, signround"),
        (dict(finish="signround", candidates=("gptq-w4g32", "spqr-w3g16")), "gptq- candidates only, not spqr-w3g16"),
    ],
)
def test_bad_finishers_are_one_line_errors(kwargs, message):
    with pytest.raises(QuantizationError, match=re.escape(message)):
        qc.passes.AutoBits(budget=3.0, **kwargs)


def test_a_signround_plan_that_misses_a_layer_is_an_error(llama):
    plan = (("model.layers.0.mlp.down_proj", "gptq-w3g32"),)
    with pytest.raises(QCompilerError, match="is not in the SignRound plan"):
        qc.compile(
            llama, example_inputs("llama"), recipe=[qc.passes.SignRound(plan=plan, iters=2)], calibration=calib()
        )
