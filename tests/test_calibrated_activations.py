"""Activations with calibrated scales: static FP8 (one ``input_scale`` per tensor) and NVFP4 W4A4
(one ``input_global_scale`` per tensor, e4m3 scales per 16 inputs at run time) — the rounding
against compressed-tensors' own, the scales against the input ranges a plain transformers model
sees, and the checkpoints against transformers running them."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import example_inputs, make_model

import qcompiler as qc
from qcompiler.errors import PassError
from qcompiler.ir.op_registry import args_of, quantized_layer_path, spec_of
from qcompiler.layouts.fp8 import dequantize_fp8, quantize_fp8_activations
from qcompiler.layouts.nvfp4 import dequantize_nvfp4, quantize_nvfp4_activations


def _activations(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 64, generator=gen) * 0.3
    x[0, 3, 5] = 4.0  # beyond the calibrated range below: saturates
    x[1, 2, 16:32] = 0.0  # an all-zero group of 16
    x[2, 1, 40] = 1e-9  # a group whose scale is below e4m3's smallest step
    return x.to(dtype)


def _library_module(name: str, value: torch.Tensor):
    from compressed_tensors.quantization import QuantizationStatus

    module = torch.nn.Linear(64, 8)
    setattr(module, name, torch.nn.Parameter(value, requires_grad=False))
    module.quantization_status = QuantizationStatus.FROZEN
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_rounding_is_compressed_tensors_own_bit_for_bit(dtype):
    """NVFP4's run-time rounding (its NVFP4 preset's ``dynamic: local`` activations, given the
    global scale) and static FP8 (its FP8 preset's activations, given the scale) equal the
    library's ``forward_quantize`` bit for bit on float32 inputs; static FP8 also on bfloat16 ones
    (the library divides by the float32 scale, so it rounds in float32 as we do)."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    x = _activations(dtype)
    amax = 0.8 * x.float().abs().amax()
    g = torch.tensor([448.0 * 6.0 / amax.item()])
    nvfp4 = preset_name_to_scheme("NVFP4", ["Linear"]).input_activations
    if dtype == torch.float32:  # in bfloat16 the library computes max|x| / 6 in bfloat16 (see below)
        theirs = forward_quantize(_library_module("input_global_scale", g), x, "input", nvfp4)
        ours = quantize_nvfp4_activations(x, g)
        assert torch.equal(ours, theirs)
        assert ours.unique().numel() > 50  # not all zeros: the check has teeth

    scale = torch.tensor([amax.item() / 448.0])
    fp8 = preset_name_to_scheme("FP8", ["Linear"]).input_activations
    assert (fp8.strategy, fp8.dynamic) == ("tensor", False)
    theirs = forward_quantize(_library_module("input_scale", scale), x, "input", fp8)
    ours = quantize_fp8_activations(x.float(), "static", scale)
    assert theirs.dtype == torch.float32 and torch.equal(ours, theirs)
    assert ours.abs().max() == 448.0 * scale  # 4.0 saturates at the scale's 448 steps


def _calibration():
    batches = [example_inputs("llama", 2, 16, seed=s) for s in range(1, 4)]
    batches[1]["attention_mask"] = torch.ones(2, 16, dtype=torch.long)
    batches[1]["attention_mask"][1, 11:] = 0  # padded positions: never served, never calibrated
    return batches


def _float_nodes(gm, op):
    return [n for n in gm.graph.nodes if (s := spec_of(n)) is not None and s.name == op]


@pytest.mark.parametrize("recipe", ["fp8-static", "nvfp4-w4a4"])
def test_each_scale_is_the_range_transformers_feeds_that_layer(recipe, tmp_path):
    """Each layer's scale is made from ``max|x|`` over the calibration's real tokens, where ``x`` is
    what the layer receives with every weight quantized: the same model in transformers, its
    weights replaced by the graph's dequantized ones, fed the same batches (hooks, padded tokens
    left out) gives each range within float32 rounding. The artifact reloads to the same logits."""
    model = make_model("llama")
    calib = _calibration()
    cm = qc.compile(model, example_inputs("llama"), recipe=recipe, calibration=calib, progress=False)
    gm = cm.graph_module
    op, scale_name = ("fp8_linear", "input_scale") if recipe == "fp8-static" else ("nvfp4_linear", "input_global_scale")
    nodes = _float_nodes(gm, op)
    assert len(nodes) == 14
    reference = make_model("llama")
    ranges, masks = {}, [None]
    for node in nodes:
        a = args_of(node)
        path = quantized_layer_path(a)
        if op == "fp8_linear":
            w = dequantize_fp8(*a.tensors(gm, "weight_fp8", "weight_scale"), int(a.block))
        else:
            w = dequantize_nvfp4(*a.tensors(gm, "weight_packed", "weight_scale", "weight_global_scale"))
        module = reference.get_submodule(path)
        module.weight.data.copy_(w)

        def hook(mod, inputs, path=path):
            x, mask = inputs[0].detach(), masks[0]
            x = x if mask is None else x[mask.bool()]
            ranges[path] = max(ranges.get(path, 0.0), float(x.abs().amax()))

        module.register_forward_pre_hook(hook)
    with torch.no_grad():
        for batch in calib:
            masks[0] = batch.get("attention_mask")
            reference(**{k: v for k, v in batch.items() if k != "use_cache"})
    for node in nodes:
        a = args_of(node)
        path = quantized_layer_path(a)
        stored = a.tensor(gm, scale_name).item()
        expected = ranges[path] / 448.0 if op == "fp8_linear" else 448.0 * 6.0 / ranges[path]
        assert stored == pytest.approx(expected, rel=1e-5), path
    assert cm.report.passes[-1].modified
    cm.save(tmp_path / "artifact")
    ids = example_inputs("llama", 2, 9, seed=4)["input_ids"]
    assert torch.equal(qc.load(tmp_path / "artifact")(input_ids=ids).logits, cm(input_ids=ids).logits)


def test_transformers_runs_each_w4a4_layer_like_the_graph(tmp_path):
    """The NVFP4 W4A4 export carries compressed-tensors' NVFP4 scheme (``dynamic: local`` inputs)
    and each layer's ``input_global_scale``; transformers loads it, and each of its layers (run in
    float32, on its bfloat16-decompressed weights) computes from an input exactly what our op's
    rounding of that input times those weights gives — and not the weight-only product.

    Run in bfloat16 the library's rounding of the same inputs differs in a few groups of 16: it
    computes ``max|x| / 6`` in bfloat16 before the e4m3 scale, where FP4 kernels (vLLM's
    ``scaled_fp4_quant``) and our op compute in float32."""
    import transformers

    model = make_model("llama").to(torch.bfloat16)
    cm = qc.compile(model, example_inputs("llama"), recipe="nvfp4-w4a4", calibration=_calibration(), progress=False)
    cm.export("compressed-tensors", tmp_path / "ct")
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    (group,) = config["config_groups"].values()
    acts = group["input_activations"]
    assert (acts["num_bits"], acts["type"], acts["strategy"], acts["group_size"], acts["dynamic"]) == (
        4,
        "float",
        "tensor_group",
        16,
        "local",
    )
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.bfloat16).eval()
    ids = {k: v for k, v in example_inputs("llama", 2, 9, seed=4).items() if k != "use_cache"}
    with torch.no_grad():
        loaded(**ids)  # the first forward decompresses the weights
    gm = cm.graph_module
    gen = torch.Generator().manual_seed(5)
    for node in _float_nodes(gm, "nvfp4_linear"):
        a = args_of(node)
        module = loaded.get_submodule(quantized_layer_path(a)).float()
        g = a.tensor(gm, "input_global_scale")
        assert torch.equal(module.input_global_scale.reshape(1), g)
        w = dequantize_nvfp4(*a.tensors(gm, "weight_packed", "weight_scale", "weight_global_scale"))
        w = w.to(torch.bfloat16).float()  # what the library decompresses to
        assert torch.equal(module.weight, w)
        x = torch.randn(2, 9, module.in_features, generator=gen) * (2688.0 / g.item()) / 3
        with torch.no_grad():
            theirs = module(x)
        expected = torch.nn.functional.linear(quantize_nvfp4_activations(x, g), w)
        assert (theirs - expected).abs().max() <= 1e-6 * expected.abs().max()
        weight_only = torch.nn.functional.linear(x, w)
        assert (theirs - weight_only).abs().mean() > 0.02 * weight_only.abs().mean()


def test_activation_passes_refuse_graphs_without_their_format_by_name():
    model = make_model("llama")
    with pytest.raises(PassError, match=r"NVFP4Activations found no NVFP4 linear"):
        qc.compile(
            model,
            example_inputs("llama"),
            recipe=[qc.passes.RTN(bits=8, group_size=-1, grid="fp8"), qc.passes.NVFP4Activations()],
            calibration=[example_inputs("llama", 2, 8)],
            progress=False,
        )
    with pytest.raises(PassError, match=r"FP8Activations found no FP8 linear"):
        qc.compile(
            model,
            example_inputs("llama"),
            recipe=[qc.passes.RTN(bits=4, group_size=16, grid="nvfp4"), qc.passes.FP8Activations("static")],
            calibration=[example_inputs("llama", 2, 8)],
            progress=False,
        )
