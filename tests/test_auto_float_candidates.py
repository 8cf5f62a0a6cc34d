"""``auto:B`` with the floating-point formats GPUs serve as candidates (``gptq-fp8``, ``gptq-nvfp4``,
``gptq-mxfp4``, beside the integer ones): the allocation meets its budget counted from the stored
tensors, mixes the layouts per layer, and its compressed-tensors checkpoint — one config group per
scheme — runs in transformers like the graph."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from tiny_models import example_inputs, make_model

import qcompiler as qc
from qcompiler.errors import QuantizationError
from qcompiler.ir.model_size import model_size
from qcompiler.ir.op_registry import spec_of
from qcompiler.passes.mixed_precision import candidate_quantizer

# the float formats only: transformers' compressed-tensors (0.20.1) cannot size the asymmetric int4
# candidates' zero points (a known limit of that client, docs/formats.md)
MIX = ("gptq-mxfp4", "gptq-nvfp4", "gptq-fp8")


def test_float_candidate_names_are_gptq_on_that_grid():
    assert candidate_quantizer("gptq-nvfp4") == qc.passes.GPTQ(bits=4, group_size=16, grid="nvfp4")
    assert candidate_quantizer("gptq-fp8-block") == qc.passes.GPTQ(bits=8, group_size=128, grid="fp8-block")
    assert candidate_quantizer("rtn-mxfp4") == qc.passes.RTN(bits=4, group_size=32, grid="mxfp4")
    with pytest.raises(QuantizationError, match="candidate 'gptq-fp16' is not .* a floating-point format: fp8"):
        candidate_quantizer("gptq-fp16")


def test_rotate_auto_float_is_the_rotation_then_the_float_allocator():
    rotated, plain = qc.get_recipe("rotate-auto-float:4.25"), qc.get_recipe("auto-float:4.25")
    assert rotated.passes == (qc.passes.Rotate(), *plain.passes) and plain.passes[0].candidates == MIX


def test_auto_mixes_float_layouts_within_its_budget_and_transformers_runs_the_checkpoint(tmp_path):
    """``auto-float:4.5``: the tiny LLaMA gets layers in each of the three formats; bits per quantized weight
    within 0.02 below the budget; transformers' logits from the bfloat16 model within two bfloat16
    steps of the largest (the FP4 formats decompress to bf16)."""
    import transformers

    model = make_model("llama").to(torch.bfloat16)
    calib = [example_inputs("llama", 2, 16, seed=s) for s in range(4)]
    cm = qc.compile(model, example_inputs("llama"), recipe="auto-float:4.5", calibration=calib, progress=False)
    assert cm.recipe.passes[0].candidates == MIX
    bits = model_size(cm.graph_module).bits_per_quantized_weight
    assert 4.48 <= bits <= 4.5, bits
    layouts = Counter(s.name for n in cm.graph_module.graph.nodes if (s := spec_of(n)) is not None)
    assert {"mxfp4_linear", "nvfp4_linear", "fp8_linear"} <= set(layouts), layouts
    cm.export("compressed-tensors", tmp_path / "ct")
    groups = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["config_groups"]
    chosen = Counter(f["candidate"] for f in cm.report.passes[0].layers.values())
    assert len(groups) == len(chosen)  # one scheme per chosen candidate
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.bfloat16).eval()
    ids = {k: v for k, v in example_inputs("llama", 2, 9, seed=4).items() if k != "use_cache"}
    with torch.no_grad():
        ours, theirs = cm(**ids).logits.float(), loaded(**ids).logits.float()
    assert (ours - theirs).abs().max() <= 2**-7 * ours.abs().max()
