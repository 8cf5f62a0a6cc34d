"""The onnx-genai export runs in the real onnxruntime-genai and generates what cm.generate does."""

import json
import warnings

import numpy as np
import onnx
import pytest
import torch
from client_runtimes import genai_tokens

import qcompiler as qc
from qcompiler.cli import main
from qcompiler.interop import ExportError, export_onnx_genai
from qcompiler.models import load

og = pytest.importorskip("onnxruntime_genai")


@pytest.fixture(scope="module")
def tinylm():
    return load("tinylm")


# all slow: the default run checks gptq-w4g128 through the CLI (tests/test_cli.py, the same export)
# a mixed-precision plan (what auto:B makes): MatMulNBits at 8, 3 and 4 bits, and SpQR's ops, in one graph
MIXED = [
    qc.passes.MixedPrecision(
        plan=(("model.layers.0.mlp.down_proj", "gptq-w8g128"), ("model.layers.1.mlp.up_proj", "spqr-w3g16")),
        default="gptq-w3g64",
    )
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe",
    ["gptq-w4g128", "w8a8-smoothquant", "spqr-w3g16", MIXED, "rotate-gptq-w4g128"],
    ids=["gptq", "w8a8", "spqr", "mixed", "rotated"],
)
def test_onnxruntime_genai_generates_the_same_32_greedy_tokens(recipe, tinylm, tmp_path):
    cm = qc.compile(
        tinylm.model, tinylm.example_inputs(), recipe=recipe, calibration=tinylm.calibration(8), progress=False
    )
    export_onnx_genai(cm, tmp_path / "genai", accuracy_level=0, progress=lambda _: None)
    config = json.loads((tmp_path / "genai" / "genai_config.json").read_text())
    assert config["model"]["decoder"]["num_hidden_layers"] == 4 and config["search"]["past_present_share_buffer"]
    prompt = tinylm.encode("class Parser:\n    def __init__(self")
    expected = cm.generate(prompt, 32)[0, prompt.shape[1] :].tolist()
    assert genai_tokens(tmp_path / "genai", prompt[0].tolist(), 32) == expected
    # the byte tokenizer travels as Hugging Face files: genai's own tokenizer gives our ids for text
    tokenizer = og.Tokenizer(og.Model(str(tmp_path / "genai")))
    text = "class Parser:\n    def __init__(self, é):  # 日本"
    assert tokenizer.encode(text).tolist() == tinylm.tokenize(text).tolist()
    assert tokenizer.decode(np.asarray(tinylm.tokenize(text), dtype=np.int32)) == text


@pytest.mark.slow
def test_cli_export_onnx_genai_from_an_artifact(tinylm, tmp_path, capsys):
    cm = qc.compile(tinylm.model, tinylm.example_inputs(), recipe="rtn-w4g128", progress=False)
    cm.save(tmp_path / "art", metadata={"source": "bundled:tinylm"})
    assert (
        main(
            [
                "export",
                str(tmp_path / "art"),
                "--format",
                "onnx-genai",
                "--out",
                str(tmp_path / "g"),
                "--plain-attention",
            ]
        )
        == 0
    )  # the fused node: tests/test_cli.py's genai export
    model = onnx.load(str(tmp_path / "g" / "model.onnx"), load_external_data=False)
    assert not any(n.op_type == "GroupQueryAttention" for n in model.graph.node)
    # plain-op attention concatenates its cache: genai must hand it a growing past, not a shared buffer
    assert not json.loads((tmp_path / "g" / "genai_config.json").read_text())["search"]["past_present_share_buffer"]
    assert sorted(p.name for p in (tmp_path / "g").iterdir()) == [
        ".qcompiler-output.json",
        "genai_config.json",
        "generation_config.json",
        "model.onnx",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    prompt = tinylm.encode("import os")[0].tolist()
    assert (
        genai_tokens(tmp_path / "g", prompt, 8)
        == cm.with_backend("onnxruntime").generate(torch.tensor([prompt]), 8)[0, len(prompt) :].tolist()
    )


def test_an_encoder_is_refused_and_nothing_is_written(tmp_path):
    from tiny_models import example_inputs, make_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        encoder = qc.compile(make_model("bert"), example_inputs("bert"), recipe="none", progress=False)
    with pytest.raises(ExportError, match="needs a causal LM captured with its KV cache"):
        export_onnx_genai(encoder, tmp_path / "e")
    assert not (tmp_path / "e").exists()


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 8])
def test_shared_kv_buffers_and_sliding_windows(window, tmp_path):
    """A standard cache gets genai's shared buffers; a sliding-window cache keeps only the last
    window − 1 positions while genai expects each step's cache to grow, so that model's context is
    capped there (past it genai failed). Either way genai generates transformers' greedy tokens."""
    from causal_lms import causal_lm, prompt

    model = causal_lm("mistral")
    model.config.sliding_window = window
    cm = qc.compile(model, {"input_ids": prompt()}, recipe="none", progress=False)
    export_onnx_genai(cm, tmp_path / "g", accuracy_level=0, progress=lambda _: None)
    config = json.loads((tmp_path / "g" / "genai_config.json").read_text())
    assert config["search"]["past_present_share_buffer"] is (window is None)
    assert config["model"]["context_length"] == config["search"]["max_length"] == (128 if window is None else 7)
    ids = prompt(1, 5, seed=3)
    new = 16 if window is None else 2
    expected = model.generate(ids, max_new_tokens=new, do_sample=False)[0, 5:].tolist()
    assert genai_tokens(tmp_path / "g", ids[0].tolist(), new) == expected


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "opt"])
def test_other_decoders_run_as_genais_generic_llama_type(arch, tmp_path):
    """genai's own gpt2 type expects other inputs; declared as the generic decoder, GPT-2 and OPT
    generate transformers' greedy tokens."""
    from causal_lms import causal_lm, prompt

    model = causal_lm(arch)
    cm = qc.compile(model, {"input_ids": prompt()}, recipe="none", progress=False)
    export_onnx_genai(cm, tmp_path / "g", accuracy_level=0, progress=lambda _: None)
    assert json.loads((tmp_path / "g" / "genai_config.json").read_text())["model"]["type"] == "llama"
    ids = prompt(1, 5, seed=3)
    expected = model.generate(ids, max_new_tokens=16, do_sample=False)[0, 5:].tolist()
    assert genai_tokens(tmp_path / "g", ids[0].tolist(), 16) == expected


def test_a_bfloat16_checkpoint_exports_for_genai_and_generates(tmp_path):
    """A bf16 model's genai folder is written in float32 (genai's runtime has no bf16
    GroupQueryAttention bias or MatMulNBits; the export used to fail after all its work) and
    generates: no bf16 tensor in model.onnx, and its first greedy token is the bf16 graph's (a
    clear argmax on this model; later ones may part by bf16 rounding)."""
    from causal_lms import causal_lm, prompt

    model = causal_lm("llama").to(torch.bfloat16)
    cm = qc.compile(model, {"input_ids": prompt()}, recipe="rtn-w4g128", progress=False)
    export_onnx_genai(cm, tmp_path / "g", accuracy_level=0, progress=lambda _: None)
    proto = onnx.load(str(tmp_path / "g" / "model.onnx"))
    assert all(t.data_type != onnx.TensorProto.BFLOAT16 for t in proto.graph.initializer)
    ids = prompt(1, 6)
    tokens = genai_tokens(tmp_path / "g", ids[0].tolist(), 8)
    assert len(tokens) == 8 and tokens[0] == int(cm.generate(ids, 1)[0, -1])


@pytest.mark.slow
def test_a_quantized_tied_table_generates_in_genai(tmp_path):
    """QuantizeEmbeddings' table through onnxruntime-genai (GatherBlockQuantized, the head's
    MatMulNBits on the same bytes): the 32 greedy tokens cm.generate gives, and one table in the file."""
    from client_runtimes import quantized_tinylm

    recipe = [qc.passes.QuantizeEmbeddings(bits=4, group_size=32), qc.passes.GPTQ(bits=4, group_size=128)]
    tinylm, cm = quantized_tinylm(recipe, tied=True)
    export_onnx_genai(cm, tmp_path / "g", accuracy_level=0, progress=lambda _: None)
    proto = onnx.load(str(tmp_path / "g" / "model.onnx"), load_external_data=False)
    assert [n.op_type for n in proto.graph.node].count("GatherBlockQuantized") == 1
    vocab = tinylm.model.config.vocab_size
    assert not [t.name for t in proto.graph.initializer if tuple(t.dims)[:1] == (vocab,) and len(t.dims) == 2]
    prompt = tinylm.encode("class Parser:\n    def __init__(self")
    expected = cm.generate(prompt, 32)[0, prompt.shape[1] :].tolist()
    assert genai_tokens(tmp_path / "g", prompt[0].tolist(), 32) == expected
