"""A storage layout is one registered thing a method names by data: every built-in layout's ops are
registered, a result naming no layout (a closure) or an unknown one fails at once in one process —
not only later on another rank or in a resumed run — with one line, and the names a resumed run's
records carry from before the layouts room still find their layout."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from tiny_models import example_inputs, make_model

import qcompiler as qc
from qcompiler.ir.op_registry import spec
from qcompiler.layouts import LayerQuant, LayerRewrite, layout, layouts
from qcompiler.pipeline.solved import SolvedLayer, solved_from, solved_header, solved_tensors


def test_every_built_in_layout_registers_its_ops_and_resolves_its_earlier_names():
    assert set(layouts()) == {"gptq", "gguf", "spqr", "int8", "fp8", "nvfp4", "mxfp4"}
    for lay in layouts().values():
        assert lay.linear_op in lay.ops and all(spec(op) for op in lay.ops)
    # a resumable run written before layouts named the rewrite by its op
    assert layout("quant_linear") is layout("gptq") and layout("gguf_linear") is layout("gguf")
    with pytest.raises(
        qc.QuantizationError, match=r"no storage layout 'fp4'.*layouts: fp8, gguf, gptq, int8, mxfp4, nvfp4, spqr"
    ):
        layout("fp4")


@dataclass(frozen=True)
class _ClosureRTN(qc.passes.RTN):
    """RTN whose results swap the node by a closure instead of naming a layout."""

    def quantize_layer(self, layer, W, H):
        result = super().quantize_layer(layer, W, H)
        return result._replace(rewrite=lambda gm, layer, tensors: result.rewrite(gm, layer, tensors))


@dataclass(frozen=True)
class _UnknownLayoutRTN(qc.passes.RTN):
    def quantize_layer(self, layer, W, H):
        result = super().quantize_layer(layer, W, H)
        return result._replace(rewrite=LayerRewrite("fp4", {}))


@pytest.mark.parametrize(
    ("quantizer", "message"),
    [
        (_ClosureRTN(bits=4, group_size=32), r"names no storage layout \(LayerQuant.rewrite must be a LayerRewrite"),
        (_UnknownLayoutRTN(bits=4, group_size=32), r"no storage layout 'fp4'"),
    ],
)
def test_a_result_that_names_no_registered_layout_fails_in_one_process(quantizer, message):
    with pytest.raises(qc.PassError, match=r"layer model\.layers\.0\.self_attn\.q_proj: .*" + message):
        qc.compile(make_model("llama"), example_inputs("llama"), recipe=[quantizer], progress=False)


def test_a_solved_layer_crosses_as_json_and_tensors_and_rewrites_the_same():
    """What another rank or a resumed run receives (header + tensors) is the same layout call."""
    W = torch.randn(64, 64)
    result = qc.passes.RTN(bits=4, group_size=32).quantize_layer(None, W, None)
    assert isinstance(result, LayerQuant) and result.rewrite == LayerRewrite("gptq", {"bits": 4, "group_size": 32})
    solved = SolvedLayer({"bits": 4}, result.tensors, result.rewrite, W)
    back = solved_from(solved_header(solved), solved_tensors(solved))
    assert back.rewrite == solved.rewrite and back.figures == solved.figures
    assert all(torch.equal(back.tensors[k], v) for k, v in solved.tensors.items())
    old = {**solved_header(solved), "rewrite": ["quant_linear", {"bits": 4, "group_size": 32}]}  # before layouts
    assert layout(solved_from(old, solved_tensors(solved)).rewrite.layout).name == "gptq"
