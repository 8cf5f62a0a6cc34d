"""compile(recipe=[]) must reproduce the original model exactly, also at unseen shapes."""

import pytest
import torch
from tiny_models import ARCHS, example_inputs, main_output, make_model

import qcompiler as qc
from qcompiler.ir.graph import find_linears, module_path


@pytest.mark.parametrize("arch", ARCHS)
def test_identity_on_hf_architectures_at_other_shapes(arch):
    model = make_model(arch)
    cm = qc.compile(model, example_inputs(arch), recipe=[], backend="eager", progress=False)
    for batch, seq in [(2, 8), (3, 13), (1, 5)]:
        inputs = example_inputs(arch, batch, seq, seed=batch * 100 + seq)
        ref = main_output(model(**inputs))
        got = main_output(cm(**{k: v for k, v in inputs.items() if k != "use_cache"}))
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() <= 1e-5


def test_identity_on_pretrained_minilm(minilm):
    cm = qc.compile(minilm.model, minilm.example_inputs(2, 16), recipe=[], progress=False)
    enc = minilm.tokenizer(
        ["The quick brown fox jumps over the lazy dog.", "Quantization keeps accuracy."],
        padding=True,
        return_tensors="pt",
    )
    ref = minilm.model(**enc).last_hidden_state
    got = cm(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
    assert (got - ref).abs().max().item() <= 1e-5


def test_plain_module_positional_inputs():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
    cm = qc.compile(model, (torch.randn(3, 8),), progress=False)
    x = torch.randn(7, 8)
    assert torch.allclose(cm(x), model(x), atol=1e-6)
    assert "recipe='none'" in repr(cm) and "Sequential" in repr(cm)


def test_every_node_keeps_its_module_path():
    """Every module with parameters of its own is named by some node, and each linear's node, its
    weight and the layer the passes see agree on the path (what ignore patterns, reports and
    exporters key on)."""
    model = make_model("llama")
    gm = qc.capture(model, example_inputs("llama"))
    paths = {module_path(n) for n in gm.graph.nodes if n.op == "call_function"}
    owners = {name for name, m in model.named_modules() if name and next(m.parameters(recurse=False), None) is not None}
    assert len(owners) > 20 and owners <= paths, sorted(owners - paths)
    linears = find_linears(gm)
    assert len(linears) == 15  # 7 per block and the head
    for layer in linears:
        assert module_path(layer.node) == layer.path == module_path(layer.weight_node), layer.path


def test_sliced_example_inputs_still_accept_contiguous_calls():
    model = make_model("llama")
    big = torch.randint(0, 96, (8, 32))
    cm = qc.compile(model, {"input_ids": big[:2, :8], "use_cache": False}, progress=False)  # a strided view
    ids = torch.randint(0, 96, (3, 12))
    assert torch.allclose(cm(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)


def test_inputs_past_a_captured_shape_limit_are_one_line(minilm):
    """BERT's learned positions stop at 512: torch.export's guard becomes a one-line ValueError naming
    the limit, not an AssertionError from generated code."""
    cm = qc.compile(minilm.model, minilm.example_inputs(2, 16), recipe=[], progress=False)
    ids = torch.randint(1000, 2000, (1, 600))
    with pytest.raises(
        ValueError, match=r"break a shape limit of the captured BertModel: input_ids.size\(\)\[1\] <= 512"
    ):
        cm(input_ids=ids, attention_mask=torch.ones_like(ids))
