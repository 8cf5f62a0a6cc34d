"""GPTQ and RTN as graph passes: the rewrite is exact, and GPTQ beats RTN layer by layer."""
import copy

import pytest
import torch

import qcompiler as qc
from qcompiler.ops import dequantize_gptq
from tiny_models import Stack, example_inputs, main_output, make_model

QL = torch.ops.qc.quant_linear.default


def calib(n=4, seq=16, seed=0):
    return [{"input_ids": torch.randint(0, 96, (4, seq), generator=torch.Generator().manual_seed(seed + i))}
            for i in range(n)]


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
@pytest.mark.parametrize("recipe", ["rtn-w4g128", [qc.passes.GPTQ(bits=3, group_size=32, act_order=True)]],
                         ids=["rtn", "gptq3-act"])
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


def test_gptq_report_has_error_damping_and_time():
    cm = qc.compile(make_model("llama"), example_inputs("llama"), recipe="gptq-w4g128", calibration=calib(),
                    progress=False)
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
    cm = qc.compile(Stack(), (x,), recipe=[qc.passes.GPTQ(bits=4, group_size=32)],
                    calibration=[(torch.randn(4, 8, 32),)], progress=False)
    assert sum(n.target is QL for n in cm.graph_module.graph.nodes) == 4
    # a layer the packed layout cannot hold is kept in FP with a note naming it (here: all of them,
    # which the report and a warning say loudly)
    with pytest.warns(UserWarning, match="RTN quantized no layer"):
        cm = qc.compile(Stack(d=36), (torch.randn(2, 5, 36),), recipe=[qc.passes.RTN(bits=3, group_size=-1)],
                        progress=False)
    notes = " ".join(cm.report.passes[0].notes)
    assert "layers.0.fc1: kept in full precision (in_features=36 cannot be stored" in notes, notes
    assert "nothing was quantized" in notes and not cm.report.passes[0].modified


def test_pass_settings_are_validated_when_made():
    with pytest.raises(qc.QuantizationError, match="bits=6"):
        qc.passes.GPTQ(bits=6)
    with pytest.raises(qc.QuantizationError, match="damp must be in"):
        qc.passes.GPTQ(damp=0)
    with pytest.raises(qc.QuantizationError, match="group_size=-2"):
        qc.passes.RTN(group_size=-2)


def test_a_second_quantization_pass_changes_nothing():
    cm = qc.compile(make_model("llama"), example_inputs("llama"),
                    recipe=[qc.passes.RTN(bits=4, group_size=32), qc.passes.GPTQ(bits=3, group_size=32),
                            qc.passes.LowerInt8()], calibration=calib(), progress=False)
    first, second, third = cm.report.passes
    assert first.modified and len(first.layers) == 14
    assert not second.modified and not second.layers and not third.modified
    assert sum(n.target is QL for n in cm.graph_module.graph.nodes) == 14
