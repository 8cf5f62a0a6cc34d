"""Token embeddings quantized in the graph (passes/embeddings.py, layouts/gptq_embedding.py): the lookup
is the plain twin's, a tied head reads the same stored tensors (counted once), the rest of the
model is untouched, and the artifact reloads bit-identically; formats that cannot hold it refuse."""

from __future__ import annotations

import re

import pytest
import torch
import transformers as T
from causal_lms import calibration, prompt

import qcompiler as qc
from qcompiler.algorithms.gptq import rtn_quantize
from qcompiler.errors import QuantizationError
from qcompiler.ir.model_size import model_size
from qcompiler.ir.op_registry import spec_of
from qcompiler.layouts.gptq import pack_gptq
from qcompiler.layouts.gptq_embedding import quant_embedding, reference_embedding


def _llama(tied: bool, vocab: int = 256) -> torch.nn.Module:
    config = T.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return T.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("bits,group", [(2, 32), (3, 32), (4, 16), (8, 64), (8, -1)])
def test_the_lookup_is_the_dequantized_tables_rows(bits, group):
    """Only the asked tokens' codes are unpacked; the rows equal the whole table dequantized and then
    indexed, bit for bit (repeated ids, any id shape), in the table's dtype."""
    gen = torch.Generator().manual_seed(bits)
    table = torch.randn(96, 64, generator=gen)
    res = rtn_quantize(table, bits=bits, group_size=group)
    packed = pack_gptq(res.codes, res.scales, res.zeros, res.g_idx, bits, group)
    ids = torch.tensor([[0, 5, 5, 95], [17, 3, 0, 64]])
    tensors = (packed.qweight, packed.qzeros, packed.scales, packed.g_idx)
    got = quant_embedding(ids, *tensors, bits, group, torch.float32)
    assert torch.equal(got, reference_embedding(*tensors, bits, ids))
    assert torch.equal(got, res.dequantized[ids])
    assert quant_embedding(ids, *tensors, bits, group, torch.bfloat16).dtype == torch.bfloat16


def test_a_tied_head_reads_the_same_tensors_and_the_table_is_counted_once(tmp_path):
    """The lookup becomes qc.quant_embedding and the tied lm_head qc.quant_linear over the same stored
    attributes; the FP table is gone; the graph equals the FP model with its table replaced by what
    the codes stand for (float32 reassociation, 1e-5); the size counts the table once at exactly
    8 + (16 + 8)/32 bits per weight; the artifact reloads bit-identically."""
    model = _llama(tied=True)
    ids = prompt(2, 12, seed=3)
    cm = qc.compile(
        model, {"input_ids": ids}, recipe=[qc.passes.QuantizeEmbeddings(bits=8, group_size=32)], progress=False
    )
    gm = cm.graph_module
    ops = {n.name: n for n in gm.graph.nodes if spec_of(n) is not None}
    kinds = sorted(spec_of(n).name for n in ops.values())
    assert kinds == ["quant_embedding", "quant_linear"]
    lookup, head = (next(n for n in ops.values() if spec_of(n).name == k) for k in ("quant_embedding", "quant_linear"))
    assert [a.target for a in lookup.args[1:5]] == [a.target for a in head.args[1:5]]
    assert "model.embed_tokens.weight" not in dict(gm.named_parameters()) | dict(gm.named_buffers())

    size = model_size(gm)
    assert size.quantized_parameters == 256 * 64
    assert size.quantized_bits == 256 * 64 * 8 + (64 // 32) * 256 * (16 + 8)
    fp_parameters = sum(p.numel() for p in model.parameters())  # the tied table counted once, as torch does
    assert size.parameters == fp_parameters

    res = rtn_quantize(model.model.embed_tokens.weight.detach().float(), bits=8, group_size=32, grid="mse")
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(res.dequantized)
        want = model(input_ids=ids).logits
        got = cm(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    cm.save(tmp_path / "a")
    with torch.no_grad():
        assert torch.equal(qc.load(tmp_path / "a")(input_ids=ids).logits, got)


def test_an_untied_head_stays_and_a_weight_pass_composes_in_either_order():
    """Without tying only the lookup changes; with GPTQ before or after it the graph holds both kinds
    of node and the same embedding codes (RTN needs no calibration; GPTQ's walk runs through the
    quantized lookup)."""
    model = _llama(tied=False)
    ids = prompt(2, 12, seed=3)
    emb = qc.passes.QuantizeEmbeddings(bits=4, group_size=32)
    gptq = qc.passes.GPTQ(bits=4, group_size=32)
    tables = []
    for recipe in ([emb, gptq], [gptq, emb]):
        cm = qc.compile(model, {"input_ids": ids}, recipe=recipe, calibration=calibration(), progress=False)
        names = [spec_of(n).name for n in cm.graph_module.graph.nodes if spec_of(n) is not None]
        assert names.count("quant_embedding") == 1 and names.count("quant_linear") == 14  # 7 per block, head FP
        tables.append(cm.graph_module.get_buffer("model.embed_tokens.qweight"))
    assert torch.equal(tables[0], tables[1])


def test_formats_that_cannot_hold_a_quantized_table_refuse_it_by_name(tmp_path):
    cm = qc.compile(_llama(tied=True), {"input_ids": prompt()}, recipe=[qc.passes.QuantizeEmbeddings()], progress=False)
    for fmt, words in (
        ("gptq", "holds quantized linears only"),
        ("compressed-tensors", "not written to compressed-tensors"),
        ("gguf", "--token-embedding"),
        ("onnx", "not lowered to ONNX"),
    ):
        with pytest.raises(Exception, match=re.escape(words)):
            cm.export(fmt, tmp_path / f"x.{fmt}")


def test_bad_settings_and_tables_it_cannot_hold_are_named():
    with pytest.raises(QuantizationError, match="bits=5 is not supported"):
        qc.passes.QuantizeEmbeddings(bits=5)
    with pytest.raises(QuantizationError, match="grid='q4_k'; choose minmax or mse"):
        qc.passes.QuantizeEmbeddings(bits=4, group_size=32, grid="q4_k")
    model = _llama(tied=True, vocab=100)  # 3-bit codes pack 32 rows in 3 words: 100 rows cannot be stored
    with pytest.raises(Exception, match="model.embed_tokens kept in full precision") as caught:
        qc.compile(model, {"input_ids": prompt() % 100}, recipe=[qc.passes.QuantizeEmbeddings(bits=3)], progress=False)
    assert "cannot be packed at 3 bits" in str(caught.value)
