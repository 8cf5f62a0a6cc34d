"""GPTQ and RTN as graph passes: the rewrite is exact, and GPTQ beats RTN layer by layer."""

import copy

import pytest
import torch
from tiny_models import Stack, example_inputs, main_output, make_model

import qcompiler as qc
from qcompiler.layouts.gptq import dequantize_gptq

QL = torch.ops.qc.quant_linear.default


def calib(n=4, seq=16, seed=0):
    return [
        {"input_ids": torch.randint(0, 96, (4, seq), generator=torch.Generator().manual_seed(seed + i))}
        for i in range(n)
    ]


def with_dequantized_weights(model, gm):
    """A copy of ``model`` whose quantized linears hold what the packed tensors stand for."""
    model = copy.deepcopy(model)
    for node in gm.graph.nodes:
        if node.target is QL:
            qweight, qzeros, scales, g_idx = (gm.get_buffer(a.target) for a in node.args[1:5])
            path = node.args[1].target.rsplit(".", 1)[0]
            W = dequantize_gptq(qweight, qzeros, scales, g_idx, node.args[6])
            module = model.get_submodule(path)
            with torch.no_grad():
                module.weight.copy_(W.t() if type(module).__name__ == "Conv1D" else W)
    return model


@pytest.mark.parametrize("arch", ["llama", "opt", "gpt2", "bert"])
@pytest.mark.parametrize(
    "recipe",
    ["rtn-w4g128", [qc.passes.GPTQ(bits=3, group_size=32, act_order=True, static_groups=False)]],
    ids=["rtn", "gptq3-act"],
)
def test_rewrite_equals_model_with_dequantized_weights(arch, recipe):
    model = make_model(arch)
    batches = [dict(example_inputs(arch, 4, 16, seed=s)) for s in range(3)]
    cm = qc.compile(model, example_inputs(arch), recipe=recipe, calibration=batches, progress=False)
    gm = cm.graph_module
    n_quant = sum(n.target is QL for n in gm.graph.nodes)
    assert n_quant == {"llama": 14, "opt": 12, "gpt2": 8, "bert": 12}[arch]
    assert len(cm.report.passes[0].layers) == n_quant
    # Linears outside the blocks (lm_head, pooler) stay in full precision.
    assert any(n.target is torch.ops.aten.linear.default for n in gm.graph.nodes)
    inputs = example_inputs(arch, 3, 11, seed=99)
    expected = main_output(with_dequantized_weights(model, gm)(**inputs))
    got = main_output(cm(**{k: v for k, v in inputs.items() if k != "use_cache"}))
    assert (got - expected).abs().max().item() <= 1e-4
    assert (got - main_output(model(**inputs))).abs().max().item() > 1e-3  # it did quantize


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("recipe", ["gptq-w4g128", "rtn-w4g128", "spqr-w3g16", "w8a8-smoothquant"])
def test_compile_leaves_the_users_model_as_it_was(arch, recipe):
    """GPTQ swept an fp32 GPT-2's Conv1D weights in place: ``W.t().contiguous()`` of the ``[out, in]``
    view is the stored ``[in, out]`` parameter itself, so the user's model came back overwritten."""
    model = make_model(arch)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [dict(example_inputs(arch, 4, 16, seed=s)) for s in range(2)]
    qc.compile(model, example_inputs(arch), recipe=recipe, calibration=batches, progress=False)
    assert [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])] == []


def test_gptq_report_has_error_damping_and_time():
    cm = qc.compile(
        make_model("llama"), example_inputs("llama"), recipe="gptq-w4g128", calibration=calib(), progress=False
    )
    figures = cm.report.passes[0].layers["model.layers.1.mlp.down_proj"]
    assert set(figures) >= {"rel_error", "damp", "seconds", "bits"}
    assert 0 < figures["rel_error"] < 0.5 and figures["damp"] == 0.01


def test_gptq_layer_errors_below_rtn_on_tiny_llama():
    model = make_model("llama")
    errs = {}
    for name in ("rtn-w3g128", "gptq-w3g128"):
        cm = qc.compile(model, example_inputs("llama"), recipe=name, calibration=calib(8, 32), progress=False)
        errs[name] = {k: v["rel_error"] for k, v in cm.report.passes[0].layers.items()}
    for layer, rtn in errs["rtn-w3g128"].items():
        assert errs["gptq-w3g128"][layer] < rtn, layer


def test_plain_module_blocks_and_unpackable_layer_is_named():
    x = torch.randn(2, 5, 32)
    cm = qc.compile(
        Stack(),
        (x,),
        recipe=[qc.passes.GPTQ(bits=4, group_size=32)],
        calibration=[(torch.randn(4, 8, 32),)],
        progress=False,
    )
    assert sum(n.target is QL for n in cm.graph_module.graph.nodes) == 4
    # a layer the packed layout cannot hold is kept in FP with a note naming it; when that is all of
    # them, the pass contract fails: RTN provides QUANTIZED_WEIGHTS and quantized nothing
    gm = qc.capture(Stack(d=36), (torch.randn(2, 5, 36),))
    ctx = qc.PassContext(example_inputs=((torch.randn(2, 5, 36),), {}), progress=False)
    assert not qc.passes.RTN(bits=3, group_size=-1).run(gm, ctx)
    notes = " ".join(ctx.record.notes)
    assert "layers.0.fc1: kept in full precision (in_features=36 cannot be stored" in notes, notes
    with pytest.raises(
        qc.PassError,
        match=r"pass #1 RTN provides QUANTIZED_WEIGHTS, but it added no node .*"
        r"nothing was quantized: every eligible layer was kept in full precision \(4\)",
    ):
        qc.compile(Stack(d=36), (torch.randn(2, 5, 36),), recipe=[qc.passes.RTN(bits=3, group_size=-1)], progress=False)


def test_pass_settings_are_validated_when_made():
    with pytest.raises(qc.QuantizationError, match="bits=6"):
        qc.passes.GPTQ(bits=6)
    with pytest.raises(qc.QuantizationError, match="damp must be in"):
        qc.passes.GPTQ(damp=0)
    with pytest.raises(qc.QuantizationError, match="group_size=-2"):
        qc.passes.RTN(group_size=-2)


def test_orders_that_make_a_pass_a_no_op_are_refused_before_anything_runs():
    for recipe, words in (
        ([qc.passes.RTN(), qc.passes.GPTQ()], "pass #2 GPTQ would change nothing: RTN already"),
        (
            [qc.passes.GPTQ(), qc.passes.SmoothQuant(), qc.passes.LowerInt8()],
            "pass #2 SmoothQuant would change nothing: GPTQ already",
        ),
        ([qc.passes.LowerInt8(), qc.passes.SpQR()], "pass #2 SpQR would change nothing"),
    ):
        with pytest.raises(qc.PipelineError, match=words):
            qc.compile(make_model("llama"), example_inputs("llama"), recipe=recipe, calibration=calib(), progress=False)


def test_a_pass_runs_standalone_with_a_default_context():
    from qcompiler.compiler import normalize_calibration
    from qcompiler.frontend.capture import capture

    gm = capture(make_model("llama"), example_inputs("llama"))
    ctx = qc.PassContext(
        example_inputs=((), example_inputs("llama")),
        calibration=normalize_calibration(calib(), gm.meta["qcompiler"]),
        progress=False,
    )
    assert qc.passes.SmoothQuant().run(gm, ctx) and ctx.record.layers
    assert qc.passes.RTN(bits=4, group_size=32).run(gm, ctx)
    assert sum(n.target is QL for n in gm.graph.nodes) == 14


def test_a_model_with_nothing_to_quantize_says_so():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
    with pytest.raises(
        qc.PassError,
        match="RTN provides QUANTIZED_WEIGHTS, .*nothing was quantized: no unquantized "
        "linear layer inside a transformer block",
    ):
        qc.compile(model, (torch.randn(2, 32),), recipe="rtn-w4g128", progress=False)


def test_lm_head_option_quantizes_the_head_and_leaves_a_tied_embedding_alone():
    from qcompiler.ir.tensors import get_tensor

    model = make_model("gpt2")  # lm_head.weight is tied to transformer.wte.weight
    assert model.lm_head.weight is model.transformer.wte.weight
    plain = qc.compile(model, example_inputs("gpt2"), recipe=[qc.passes.RTN(bits=4, group_size=32)], progress=False)
    head = qc.compile(
        model, example_inputs("gpt2"), recipe=[qc.passes.RTN(bits=4, group_size=32, lm_head=True)], progress=False
    )
    assert "lm_head" in head.report.passes[0].layers and "lm_head" not in plain.report.passes[0].layers
    assert (
        sum(n.target is QL for n in head.graph_module.graph.nodes)
        == sum(n.target is QL for n in plain.graph_module.graph.nodes) + 1
    )
    tables = [
        get_tensor(head.graph_module, n.args[0].target)
        for n in head.graph_module.graph.nodes
        if n.target is torch.ops.aten.embedding.default
    ]
    token_table = next(t for t in tables if t.shape[0] == 96)
    assert torch.equal(token_table, model.transformer.wte.weight)  # the tied embedding still reads FP weights
    inputs = example_inputs("gpt2", batch=1, seq=6, seed=4)
    a, b = main_output(plain(**inputs)), main_output(head(**inputs))
    assert not torch.equal(a, b)  # the head really is 4-bit now
    assert ((b - a).norm() / a.norm()).item() < 0.2  # and its 4-bit error is bounded


def test_weight_quantizer_hooks_run_around_each_blocks_solves():
    """before_block sees the block's inputs (its engine collects them) before any layer of the block
    is solved; after_block follows the solves; the walk and report are the base's."""
    from dataclasses import dataclass

    calls = []

    @dataclass(frozen=True)
    class Hooked(qc.passes.RTN):
        def before_block(self, gm, block, engine, ctx):
            stats = engine.collect(block, block.linears[:1], hessian=False)
            calls.append(
                ("before", block.name, sum(p.startswith(block.name + ".") for p in ctx.record.layers), len(stats))
            )

        def after_block(self, gm, block, ctx):
            calls.append(("after", block.name, sum(p.startswith(block.name + ".") for p in ctx.record.layers), 0))

    cm = qc.compile(
        make_model("llama"),
        example_inputs("llama"),
        recipe=[Hooked(bits=4, group_size=32)],
        calibration=calib(),
        progress=False,
    )
    assert calls == [
        ("before", "model.layers.0", 0, 1),
        ("after", "model.layers.0", 7, 0),
        ("before", "model.layers.1", 0, 1),
        ("after", "model.layers.1", 7, 0),
    ]
    assert len(cm.report.passes[0].layers) == 14
