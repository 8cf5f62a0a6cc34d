"""Token embeddings quantized in the graph (passes/embeddings.py, layouts/gptq_embedding.py): the lookup
is the plain twin's, a tied head reads the same stored tensors (counted once), the rest of the
model is untouched, and the artifact reloads bit-identically; formats that cannot hold it refuse
(ONNX holds it: tests/test_onnx_embeddings.py)."""

from __future__ import annotations

import re

import pytest
import torch
import transformers as T
from causal_lms import calibration, prompt

import qcompiler as qc
from qcompiler.algorithms.gptq import gptq_quantize, rtn_quantize
from qcompiler.algorithms.output_error import output_error
from qcompiler.compiler import normalize_calibration
from qcompiler.errors import QuantizationError
from qcompiler.ir.graph import find_linears
from qcompiler.ir.model_size import model_size
from qcompiler.ir.op_registry import spec_of
from qcompiler.layouts.gptq import pack_gptq
from qcompiler.layouts.gptq_embedding import quant_embedding, reference_embedding
from qcompiler.pipeline.input_hessian import input_hessian


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


def _head_inputs_hessian(model, batches) -> torch.Tensor:
    """``XᵀX / n`` of the transformers model's own lm_head inputs (a forward hook)."""
    xs = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: xs.append(i[0].detach().reshape(-1, i[0].shape[-1])))
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    hook.remove()
    X = torch.cat(xs)
    return X.T @ X / X.shape[0]


def test_the_input_hessian_is_the_heads_inputs():
    model = _llama(tied=True)
    cm = qc.compile(model, {"input_ids": prompt()}, recipe="none", progress=False)
    gm = cm.graph_module
    head = next(layer for layer in find_linears(gm) if layer.path == "lm_head")
    batches = normalize_calibration(calibration(), gm.meta["qcompiler"])
    H, rows = input_hessian(gm, head.node, head.input, batches)
    assert rows == 4 * 32
    torch.testing.assert_close(H, _head_inputs_hessian(model, calibration()), rtol=1e-5, atol=1e-6)


def test_a_tied_table_is_solved_by_gptq_on_the_heads_input_hessian():
    """With calibration (``method="auto"``) a tied table is GPTQ's solve on the head's input Hessian —
    the stored table is ``gptq_quantize``'s (act-order, static groups) on the graph's own H, bit for
    bit — and the head's output error on those inputs, ``tr(ΔE H ΔEᵀ)``, is at most 0.8x round-to-
    nearest's at the same bits and grid (measured: 0.72x); ``method="rtn"`` keeps the old rounding."""
    model = _llama(tied=True)
    ids, cal = prompt(2, 12, seed=3), calibration()
    E = model.model.embed_tokens.weight.detach().float().clone()
    tables = {}
    for method in ("auto", "rtn"):
        emb = qc.passes.QuantizeEmbeddings(bits=4, group_size=32, method=method)
        cm = qc.compile(model, {"input_ids": ids}, recipe=[emb], calibration=cal, progress=False)
        every = torch.arange(E.shape[0])[None]
        gm = cm.graph_module
        stored = [gm.get_buffer(f"model.embed_tokens.{n}") for n in ("qweight", "qzeros", "scales", "g_idx")]
        tables[method] = reference_embedding(*stored, 4, every)[0]
        assert cm.report.passes[0].layers["model.embed_tokens"]["method"] == ("gptq" if method == "auto" else "rtn")
    fp = qc.compile(model, {"input_ids": ids}, recipe="none", progress=False).graph_module
    head = next(layer for layer in find_linears(fp) if layer.path == "lm_head")
    H, _ = input_hessian(fp, head.node, head.input, normalize_calibration(cal, fp.meta["qcompiler"]))
    want = gptq_quantize(E, H, bits=4, group_size=32, act_order=True, static_groups=True, grid="mse")
    assert torch.equal(tables["auto"], want.dequantized)
    assert torch.equal(tables["rtn"], rtn_quantize(E, bits=4, group_size=32, grid="mse").dequantized)
    assert output_error(E, tables["auto"], H) <= 0.8 * output_error(E, tables["rtn"], H)


def test_gptq_embeddings_need_calibration_and_old_configs_replay_as_rounding():
    with pytest.raises(Exception, match="QuantizeEmbeddings needs calibration data"):
        qc.compile(_llama(tied=True), {"input_ids": prompt()}, recipe=[qc.passes.QuantizeEmbeddings(method="gptq")])
    with pytest.raises(QuantizationError, match="method='opt'; choose one of auto, gptq, rtn"):
        qc.passes.QuantizeEmbeddings(method="opt")
    assert qc.passes.QuantizeEmbeddings.migrate_config({"bits": 4}, 1) == {"method": "rtn", "bits": 4}


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
