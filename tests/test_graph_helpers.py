"""The graph helpers find every linear, its producing norm and its siblings, from structure alone."""

import pytest
from tiny_models import example_inputs, make_model

import qcompiler as qc
from qcompiler.ir.graph import find_linears, find_producing_norm, find_siblings, producer_groups, transformer_blocks

# (linear suffix, expected norm suffix or None, expected sibling suffixes) per architecture, block 0.
EXPECTED = {
    "llama": [
        ("self_attn.q_proj", "input_layernorm", {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}),
        ("self_attn.o_proj", None, {"self_attn.o_proj"}),
        ("mlp.up_proj", "post_attention_layernorm", {"mlp.gate_proj", "mlp.up_proj"}),
        ("mlp.down_proj", None, {"mlp.down_proj"}),
    ],
    "opt": [
        ("self_attn.k_proj", "self_attn_layer_norm", {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}),
        ("fc1", "final_layer_norm", {"fc1"}),
        ("fc2", None, {"fc2"}),
    ],
    "gpt2": [
        ("attn.c_attn", "ln_1", {"attn.c_attn"}),
        ("mlp.c_fc", "ln_2", {"mlp.c_fc"}),
        ("attn.c_proj", None, {"attn.c_proj"}),
    ],
    "bert": [
        ("intermediate.dense", "attention.output.LayerNorm", {"intermediate.dense"}),
        ("attention.output.dense", None, {"attention.output.dense"}),
        ("output.dense", None, {"output.dense"}),
    ],
}
PREFIX = {
    "llama": "model.layers.0.",
    "opt": "model.decoder.layers.0.",
    "gpt2": "transformer.h.0.",
    "bert": "encoder.layer.0.",
}
LINEARS_PER_BLOCK = {"llama": 7, "opt": 6, "gpt2": 4, "bert": 6}
EXTRA = {"llama": 1, "opt": 1, "gpt2": 1, "bert": 1}  # lm_head / pooler


@pytest.mark.parametrize("arch", list(EXPECTED))
def test_linears_norms_and_siblings(arch):
    model = make_model(arch)
    gm = qc.capture(model, example_inputs(arch))
    layers = find_linears(gm)
    assert len(layers) == 2 * LINEARS_PER_BLOCK[arch] + EXTRA[arch]
    by_path = {layer.path: layer for layer in layers}
    for layer in layers:  # weights are the module's own, in [out, in] orientation
        module = model.get_submodule(layer.path)
        w = module.weight.t() if type(module).__name__ == "Conv1D" else module.weight
        assert layer.weight(gm).shape == w.shape and (layer.weight(gm) == w).all()
    prefix = PREFIX[arch]
    for suffix, norm, siblings in EXPECTED[arch]:
        layer = by_path[prefix + suffix]
        found = find_producing_norm(layer)
        if norm is None:
            assert found is None, f"{layer.path} should have no producing norm, got {found}"
        else:
            assert found is not None and found.path == prefix + norm, layer.path
            assert found.weight_node is not None
            assert (found.bias_node is not None) == (arch != "llama")
        assert {s.path[len(prefix) :] for s in find_siblings(layers, layer)} == siblings


def test_bert_query_reads_the_embedding_layernorm_through_dropout():
    gm = qc.capture(make_model("bert"), example_inputs("bert"))
    layers = find_linears(gm)
    q = next(l for l in layers if l.path == "encoder.layer.0.attention.self.query")
    assert find_producing_norm(q).path == "embeddings.LayerNorm"
    assert {s.path.rsplit(".", 1)[1] for s in find_siblings(layers, q)} == {"query", "key", "value"}


@pytest.mark.parametrize("arch", list(EXPECTED))
def test_blocks_and_producer_groups(arch):
    gm = qc.capture(make_model(arch), example_inputs(arch))
    blocks = transformer_blocks(gm)
    assert list(blocks) == [PREFIX[arch][:-1], PREFIX[arch][:-2] + "1"]
    groups = producer_groups(gm)
    assert sum(len(grp.consumers) for grp in groups) == len(find_linears(gm))
