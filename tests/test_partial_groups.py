"""Layers whose input width is not a multiple of the group size (SmolLM's hidden 576 with g128):
groups of 128 and a shorter last one, recorded as group 128 everywhere, exported to ONNX as
MatMulNBits (never an fp32 fallback) and to a GPTQ checkpoint that imports back identically."""

import onnx
import pytest
import torch
from tiny_models import main_output

import qcompiler as qc
from qcompiler import import_gptq
from qcompiler.interop.gptq_checkpoint import export_gptq

HIDDEN, FFN = 576, 1536  # 4.5 and 12 groups of 128


@pytest.fixture(scope="module")
def compiled():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=HIDDEN,
            intermediate_size=FFN,
            num_hidden_layers=1,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=256,
            max_position_embeddings=128,
        )
    ).eval()
    gen = torch.Generator().manual_seed(1)
    calib = [{"input_ids": torch.randint(0, 256, (4, 32), generator=gen)} for _ in range(2)]
    x = {"input_ids": torch.randint(0, 256, (2, 16), generator=gen)}
    return model, qc.compile(model, x, recipe="gptq-w4g128", calibration=calib, progress=False, device=None), x


def test_every_layer_records_the_recipes_group_size(compiled):
    _, cm, _ = compiled
    nodes = [n for n in cm.graph_module.graph.nodes if n.target is torch.ops.qc.quant_linear.default]
    assert len(nodes) == 7
    for node in nodes:
        g_idx = cm.graph_module.get_buffer(node.args[4].target)
        scales = cm.graph_module.get_buffer(node.args[3].target)
        assert node.args[7] == 128, f"{node.args[1].target}: recorded group {node.args[7]}"
        assert torch.equal(g_idx.long(), torch.arange(g_idx.numel()) // 128)
        assert scales.shape[0] == -(-g_idx.numel() // 128)  # the last, shorter group has its own scale


def test_onnx_export_uses_matmul_nbits_for_every_layer(compiled, tmp_path):
    pytest.importorskip("onnxruntime")
    _, cm, x = compiled
    ort = cm.with_backend(
        "onnxruntime", path=str(tmp_path / "run.onnx"), accuracy_level=0
    )  # fp32 compute: exact layout check
    proto = onnx.load(str(tmp_path / "run.onnx"), load_external_data=False)
    assert sum(n.op_type == "MatMulNBits" for n in proto.graph.node) == 4  # 7 linears: q/k/v and gate/up stacked
    meta = {p.key: p.value for p in proto.metadata_props}
    assert "fp32 MatMul" not in meta["qcompiler.notes"], meta["qcompiler.notes"]
    assert meta["qcompiler.recipe"] == "gptq-w4g128" and meta["qcompiler.onnx_opset"] == "18"
    assert meta["qcompiler.matmul_nbits_accuracy_level"] == "0"
    onnx.checker.check_model(str(tmp_path / "run.onnx"), full_check=True)
    assert [p.name for p in tmp_path.iterdir()] == ["run.onnx"]  # written atomically: no temporary left
    want, got = main_output(cm(**x)), main_output(ort(**x))
    assert ((got - want).norm() / want.norm()) < 1e-3


def test_gptq_checkpoint_round_trips(compiled, tmp_path):
    _, cm, x = compiled
    folder = export_gptq(cm, tmp_path / "gptq", progress=lambda _m: None)
    back = import_gptq(folder)
    assert torch.allclose(main_output(back(**x)), main_output(cm(**x)), rtol=1e-5, atol=1e-5)
