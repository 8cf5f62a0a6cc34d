"""``cm.export(format, path, ...)``: one call for every registered export format, the format's own
settings as keywords (or an ``ExportOptions``), a setting the format does not read refused by name."""

import json

import pytest
import torch
from tiny_models import example_inputs, make_model

import qcompiler as qc
from qcompiler.export_formats import ExportOptions, export_format_names


@pytest.fixture(scope="module")
def cm():
    return qc.compile(make_model("llama"), example_inputs("llama"), recipe="rtn-q4_0", progress=False)


def test_every_built_in_format_is_one_export_call(cm, tmp_path):
    assert {"onnx", "onnx-genai", "gptq", "compressed-tensors", "gguf"} <= set(export_format_names())
    cm.export("gptq", tmp_path / "ckpt", zero_format="v2", progress=lambda _m: None)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["quantization_config"]["checkpoint_format"] == "gptq_v2"
    cm.export("gguf", tmp_path / "m.gguf", ExportOptions(progress=lambda _m: None))
    gguf_file = tmp_path / "m.gguf"
    assert gguf_file.read_bytes()[:4] == b"GGUF"
    # the same bytes as the format's own function writes
    from qcompiler.interop.gguf_export import export_gguf

    export_gguf(cm, tmp_path / "direct.gguf", progress=lambda _m: None)
    assert (tmp_path / "direct.gguf").read_bytes() == gguf_file.read_bytes()


def test_a_setting_the_format_does_not_read_is_refused_by_name(cm, tmp_path):
    with pytest.raises(ValueError, match=r"export option zero_format applies to gptq, not gguf: it would do nothing"):
        cm.export("gguf", tmp_path / "m.gguf", zero_format="v1")
    with pytest.raises(ValueError, match=r"requantize applies to gguf, not onnx"):
        cm.export("onnx", tmp_path / "m.onnx", requantize="q8_0")
    with pytest.raises(ValueError, match=r"unknown export format 'safetensors'; available: onnx, onnx-genai"):
        cm.export("safetensors", tmp_path / "x")
    with pytest.raises(TypeError, match="not both"):
        cm.export("gptq", tmp_path / "c", ExportOptions(), zero_format="v2")
    assert not any(tmp_path.iterdir())  # nothing written by a refused call
    with torch.no_grad():  # the model is untouched by the refusals
        cm(**example_inputs("llama"))


def test_a_compressed_tensors_export_names_the_client_that_cannot_read_it(cm, tmp_path):
    """Asymmetric integer groups: the export says, in one line, that transformers' compressed-tensors
    0.20 refuses them (vLLM reads them); a symmetric recipe's export (Q4_0's grid) says nothing of it."""
    from qcompiler.interop.compressed_tensors import ASYMMETRIC_NOTE

    said = []
    cm.export("compressed-tensors", tmp_path / "sym", progress=said.append)
    assert said and ASYMMETRIC_NOTE not in said
    asym = qc.compile(make_model("llama"), example_inputs("llama"), recipe="rtn-w4g128", progress=False)
    asym.export("compressed-tensors", tmp_path / "asym", progress=said.append)
    assert ASYMMETRIC_NOTE in said and "\n" not in ASYMMETRIC_NOTE


def test_an_asymmetric_v1_gptq_export_names_the_client_that_refuses_it(cm, tmp_path):
    """GPTQModel refuses asymmetric v1 files it did not write: ``zero_format="auto"`` writing v1 for
    asymmetric groups says so in one line; v2, and a symmetric grid in v1, say nothing of it."""
    from qcompiler.interop.gptq_checkpoint import V1_ASYMMETRIC_NOTE

    said = []
    cm.export("gptq", tmp_path / "sym", progress=said.append)
    assert said and V1_ASYMMETRIC_NOTE not in said
    asym = qc.compile(make_model("llama"), example_inputs("llama"), recipe="rtn-w4g128", progress=False)
    asym.export("gptq", tmp_path / "v2", zero_format="v2", progress=said.append)
    assert V1_ASYMMETRIC_NOTE not in said and any(s.endswith("v2 zero points (as asked)") for s in said)
    asym.export("gptq", tmp_path / "v1", progress=said.append)
    assert V1_ASYMMETRIC_NOTE in said and "\n" not in V1_ASYMMETRIC_NOTE
