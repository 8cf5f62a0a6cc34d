"""GGUF export: the blocks written are the codes GPTQ chose (read back with the ``gguf`` package's own
dequantizer, an independent reference), names and metadata are llama.cpp's, bad targets are refused.
llama.cpp itself running these files: tests/test_llama_cpp_runs_our_gguf.py."""

import hashlib

import gguf
import numpy as np
import pytest
import torch
from causal_lms import calibration, causal_lm, prompt

import qcompiler as qc
from qcompiler.algorithms.packing import unpack_cols
from qcompiler.files.atomic import OutputPathError
from qcompiler.interop.checkpoint import ExportError
from qcompiler.interop.gguf_blocks import BLOCK_TYPES, pack_blocks
from qcompiler.interop.gguf_export import _rotary_rows
from qcompiler.ir.op_registry import args_of, quantized_layer_path, spec_of
from qcompiler.layouts.gptq import GPTQ_TENSORS, dequantize_gptq
from qcompiler.layouts.spqr import SPQR_DENSE_TENSORS


@pytest.mark.parametrize("kind", ["q4_0", "q8_0"])
def test_blocks_dequantize_to_the_grid_values(kind):
    """Random codes and fp16 scales packed as llama.cpp blocks read back, through gguf's reference
    dequantizer, as exactly scale · (code − 2^(bits−1))."""
    block = BLOCK_TYPES[kind]
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 2**block.bits, (6, 96), generator=g)
    scales = (torch.rand(6, 3, generator=g) * 0.1).half()
    data = pack_blocks(block, codes, scales)
    back = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[block.name])
    want = (codes - 2 ** (block.bits - 1)).float() * scales.float().repeat_interleave(32, dim=1)
    assert np.array_equal(back, want.numpy())


def _layers(cm) -> dict:
    gm = cm.graph_module
    out = {}
    for node in gm.graph.nodes:
        if spec_of(node) is not None:
            a = args_of(node)
            out[quantized_layer_path(a)] = (dict(zip(GPTQ_TENSORS, a.tensors(gm, *GPTQ_TENSORS))), int(a.bits))
    return out


@pytest.fixture(scope="module")
def llama_q4(tmp_path_factory):
    model = causal_lm("llama")
    cm = qc.compile(model, {"input_ids": prompt()}, recipe="gptq-q4_0", calibration=calibration(), backend="eager")
    path = tmp_path_factory.mktemp("gguf") / "llama-q4_0.gguf"
    cm.export_gguf(path, progress=lambda s: None)
    return model, cm, path


def test_q4_1_blocks_hold_the_asymmetric_grid_within_fp16_rounding_of_the_minimum():
    """Q4_1 = d · q + m: the codes and d = s exactly, m = −s·z rounded to fp16 — read back through
    gguf's reference dequantizer within 2^-11 of |s·z| (under 1 % of one step) of s · (q − z)."""
    block = BLOCK_TYPES["q4_1"]
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (6, 96), generator=g)
    scales = (torch.rand(6, 3, generator=g) * 0.1 + 0.01).half()
    zeros = torch.randint(0, 16, (6, 3), generator=g)
    back = torch.from_numpy(
        gguf.quants.dequantize(pack_blocks(block, codes, scales, zeros), gguf.GGMLQuantizationType.Q4_1)
    )
    s, z = scales.float().repeat_interleave(32, dim=1), zeros.float().repeat_interleave(32, dim=1)
    grid = s * (codes - z)
    assert bool(((back - grid).abs() <= (s * z) * 2**-11 + 1e-9).all())
    assert (back - grid).abs().max() > 0  # m is rounded: not bit-identical, and the test can tell


def test_asymmetric_groups_of_32_are_written_as_q4_1(tmp_path):
    """GPTQ on qcompiler's asymmetric grid (integer zero points) in 4-bit groups of 32 is written as
    Q4_1 blocks whose weights are the graph's within the fp16 rounding of each block's minimum
    (the gptq-q4_1 recipe itself fits Q4_1's free minimum: test_gguf_grids.py)."""
    model = causal_lm("llama")
    gptq = qc.passes.GPTQ(bits=4, group_size=32, sym=False)
    cm = qc.compile(model, {"input_ids": prompt()}, recipe=[gptq], calibration=calibration(), backend="eager")
    cm.export_gguf(tmp_path / "q41.gguf", progress=lambda s: None)
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "q41.gguf")).tensors}
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for path_, (t, bits) in _layers(cm).items():
        entry = tensors[names.get_name(path_ + ".weight", try_suffixes=(".weight",))]
        assert entry.tensor_type == gguf.GGMLQuantizationType.Q4_1
        back = torch.from_numpy(gguf.quants.dequantize(entry.data, entry.tensor_type).copy())
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}.get(path_.rsplit(".", 1)[1])
        if heads:
            back = back[torch.argsort(_rotary_rows(heads * head_dim, heads))]
        w = dequantize_gptq(*(t[n] for n in GPTQ_TENSORS), bits)
        zeros = unpack_cols(t["qzeros"], 4, t["scales"].shape[1]).float()
        bound = (t["scales"].float() * zeros).t().repeat_interleave(32, dim=1) * 2**-11 + 1e-9
        assert bool(((back - w).abs() <= bound).all()), path_


def test_q4_0_file_holds_the_recipes_codes_bit_identically(llama_q4):
    """Every quantized layer's GGUF tensor dequantizes (gguf's reference) to the very weights the
    graph computes with, once the query/key rows are put back in Hugging Face's rotary order."""
    model, cm, path = llama_q4
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    layers = _layers(cm)
    assert len(layers) == 7 * cfg.num_hidden_layers
    for path_, (t, bits) in layers.items():
        entry = tensors[names.get_name(path_ + ".weight", try_suffixes=(".weight",))]
        assert entry.tensor_type == gguf.GGMLQuantizationType.Q4_0
        back = torch.from_numpy(gguf.quants.dequantize(entry.data, entry.tensor_type).copy())
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}.get(path_.rsplit(".", 1)[1])
        if heads:
            back = back[torch.argsort(_rotary_rows(heads * head_dim, heads))]
        assert torch.equal(back, dequantize_gptq(*(t[n] for n in GPTQ_TENSORS), bits))
    # FP parts: F16 matrices, F32 norms, under llama.cpp's names
    assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert tensors["output_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    fields = reader.fields
    arch = bytes(fields["general.architecture"].parts[-1]).decode()
    assert arch == "llama"
    assert int(fields["llama.attention.head_count_kv"].parts[-1][0]) == cfg.num_key_value_heads
    assert int(fields["llama.block_count"].parts[-1][0]) == cfg.num_hidden_layers
    assert bytes(fields["qcompiler.recipe"].parts[-1]).decode() == "gptq-q4_0"


def test_rotary_rows_match_llama_cpp_converter_permute():
    """The row order equals llama.cpp's converter's ``permute`` (reshape(h, 2, d/2).swapaxes(1, 2)),
    written straightforwardly on a small matrix."""
    heads, head_dim = 3, 8
    w = torch.arange(heads * head_dim * 2).view(heads * head_dim, 2)
    ref = w.reshape(heads, 2, head_dim // 2, 2).transpose(1, 2).reshape(w.shape)
    assert torch.equal(w[_rotary_rows(heads * head_dim, heads)], ref)


def test_other_grids_are_refused_unless_requantized(tmp_path):
    model = causal_lm("qwen2")
    cm = qc.compile(model, {"input_ids": prompt()}, recipe="rtn-w4g128", backend="eager")
    with pytest.raises(
        ExportError, match=r"layer model\.layers\.0\.self_attn\.q_proj is 4-bit groups of 128.*gptq-q4_0"
    ):
        cm.export_gguf(tmp_path / "a.gguf", progress=lambda s: None)
    assert not (tmp_path / "a.gguf").exists()
    said = []
    cm.export_gguf(tmp_path / "a.gguf", requantize="q4_0", progress=said.append)
    assert any("re-quantized to Q4_0 by llama.cpp's round-to-nearest" in s for s in said)
    reader = gguf.GGUFReader(str(tmp_path / "a.gguf"))
    # re-rounded by llama.cpp's RTN: within a Q4_0 step of the artifact's weights (|w| ≤ 8 d)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, 2)
    tensors = {t.name: t for t in reader.tensors}
    for path_, (t, bits) in _layers(cm).items():
        entry = tensors[names.get_name(path_ + ".weight", try_suffixes=(".weight",))]
        w = dequantize_gptq(*(t[n] for n in GPTQ_TENSORS), bits)
        back = torch.from_numpy(gguf.quants.dequantize(entry.data, entry.tensor_type).copy())
        step = w.view(w.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 8
        assert bool(((back - w).view_as(step.expand(-1, -1, 32)).abs() <= step * 1.01 + 1e-6).all())
    with pytest.raises(ExportError, match="requantize='q5_0' is not a GGUF block type"):
        cm.export_gguf(tmp_path / "b.gguf", requantize="q5_0")


def test_unsupported_architecture_is_one_line(tmp_path):
    cm = qc.compile(causal_lm("gpt2"), {"input_ids": prompt()}, recipe="rtn-q4_0", backend="eager")
    with pytest.raises(
        ExportError,
        match=r"model type 'gpt2' is not written to GGUF yet \(Conv1D weights, learned positions\); supported: llama",
    ):
        cm.export_gguf(tmp_path / "g.gguf")
    assert not list(tmp_path.iterdir())


def test_gemma2_that_llama_cpp_would_compute_differently_is_refused(tmp_path):
    """llama.cpp scales Gemma-2's queries by 1/sqrt(head_dim) (below 46 layers): a config whose
    query_pre_attn_scalar differs is refused by name, nothing written."""
    cm = qc.compile(causal_lm("gemma2"), {"input_ids": prompt()}, recipe="rtn-q4_0", backend="eager")
    with pytest.raises(
        ExportError, match=r"gemma2: query_pre_attn_scalar=256, but llama.cpp scales queries by 1/sqrt\(16\)"
    ):
        cm.export_gguf(tmp_path / "g.gguf")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "change,message",
    [
        ({"attn_logit_softcapping": 50.0}, r"gemma3: llama.cpp's gemma3 does not soft-cap attention logits"),
        (
            {"query_pre_attn_scalar": 64},
            r"gemma3: query_pre_attn_scalar=64, but llama.cpp scales queries by 1/sqrt\(16\)",
        ),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}},
            r"gemma3_text: rope scaling 'linear' is not written to GGUF yet",
        ),
    ],
)
def test_gemma3_that_llama_cpp_would_compute_differently_is_refused(change, message, tmp_path):
    """What llama.cpp's gemma3 computes otherwise (no attention soft-cap, 1/sqrt(head_dim) query scale)
    or what the writer does not carry yet (rope scaling) is refused by name before anything is written."""
    cm = qc.compile(causal_lm("gemma3_text"), {"input_ids": prompt()}, recipe="rtn-q4_0", backend="eager")
    cm.graph_module.meta["qcompiler"].model_config.update(change)  # as a config.json saying so would
    with pytest.raises(ExportError, match=message):
        cm.export_gguf(tmp_path / "g.gguf")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "kind,qtype", [("q8_0", "Q8_0"), pytest.param("q4_0", "Q4_0", marks=pytest.mark.slow), ("q6_k", "Q8_0")]
)
def test_token_embeddings_are_stored_as_the_block_type_asked_for(llama_q4, kind, qtype, tmp_path):
    """``token_embedding``: the FP embeddings become llama.cpp's blocks of that type — the bytes of
    llama.cpp's own round-to-nearest for Q8_0 / Q4_0 (the ``gguf`` package's reference quantizer);
    for Q6_K, whose 256-wide super-blocks rows of 64 cannot hold, its 32-wide fallback Q8_0 on
    qcompiler's fitted grid, within half a step (max|row block| / 127 / 2) of every weight — exactly
    ``rows × cols / 32`` blocks, every other tensor as without the setting."""
    model, cm, plain = llama_q4
    said = []
    cm.export_gguf(tmp_path / "e.gguf", token_embedding=kind, progress=said.append)
    assert f"token embeddings {qtype} (re-rounded" in said[0]
    ours = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "e.gguf")).tensors}
    before = {t.name: t for t in gguf.GGUFReader(str(plain)).tensors}
    emb = ours["token_embd.weight"]
    w = model.model.embed_tokens.weight.detach().float().numpy()
    assert emb.tensor_type.name == qtype and before["token_embd.weight"].tensor_type.name == "F16"
    if kind in ("q8_0", "q4_0"):
        want = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
        assert np.array_equal(np.asarray(emb.data).reshape(-1), want.reshape(-1))
    else:
        got = gguf.quants.dequantize(np.asarray(emb.data), emb.tensor_type).reshape(w.shape)
        half_step = np.abs(w.reshape(-1, 32)).max(1, keepdims=True) / 127 / 2 * 1.001
        assert (np.abs(got - w).reshape(-1, 32) <= half_step).all()
    assert emb.n_bytes == w.size // 32 * {"Q8_0": 34, "Q4_0": 18}[qtype]
    for name, t in before.items():
        if name != "token_embd.weight":
            assert np.array_equal(np.asarray(ours[name].data), np.asarray(t.data)), name


def test_an_unknown_token_embedding_type_is_refused_before_anything_is_written(llama_q4, tmp_path):
    _, cm, _ = llama_q4
    with pytest.raises(ExportError, match=r"token_embedding='q9_0' is not a GGUF block type qcompiler writes"):
        cm.export_gguf(tmp_path / "e.gguf", token_embedding="q9_0")
    assert not list(tmp_path.iterdir())


def test_an_existing_file_is_replaced_only_when_it_is_our_gguf(llama_q4, tmp_path):
    _, cm, ours = llama_q4
    other = tmp_path / "notes.gguf"
    other.write_bytes(b"GGUF but not a real file")
    digest = hashlib.sha256(other.read_bytes()).hexdigest()
    with pytest.raises(OutputPathError, match="qcompiler's GGUF writer did not write it"):
        cm.export_gguf(other, progress=lambda s: None)
    assert hashlib.sha256(other.read_bytes()).hexdigest() == digest
    again = tmp_path / "again.gguf"
    again.write_bytes(ours.read_bytes())
    cm.export_gguf(again, progress=lambda s: None)  # an earlier export of ours: replaced
    assert again.read_bytes() == ours.read_bytes()  # deterministic
    assert not [p for p in tmp_path.iterdir() if p.name not in ("notes.gguf", "again.gguf")]


def test_zero_points_of_a_symmetric_q8_recipe_are_128():
    """rtn-q8_0 is symmetric 8-bit in blocks of 32: the GGUF Q8_0 grid (int8 = code − 128)."""
    cm = qc.compile(causal_lm("llama"), {"input_ids": prompt()}, recipe="rtn-q8_0", backend="eager")
    for t, bits in _layers(cm).values():
        assert bits == 8 and t["scales"].shape[0] == t["g_idx"].numel() // 32
        assert bool((unpack_cols(t["qzeros"], 8, t["scales"].shape[1]) == 128).all())


def test_symmetric_grid_is_llama_cpp_q4_0_rule():
    """The symmetric min-max grid puts each block's signed extreme exactly on the codes' longer side
    (llama.cpp's ``d = max/−8``): the extreme is reproduced to fp16 rounding of the scale, and the
    rounding error is that of gguf's reference Q4_0 quantizer (llama.cpp's own RTN) within 1 %."""
    from qcompiler.algorithms.quant_grid import fake_quantize, fit_grid

    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    w[::3] = -w[::3]  # extremes of both signs
    blocks = w.reshape(-1, 32)
    grid = fit_grid(blocks, 4, sym=True)
    ours = fake_quantize(blocks, grid, 4)
    at = blocks.abs().argmax(1, keepdim=True)
    extreme, got = blocks.gather(1, at), ours.gather(1, at)
    assert bool(((got - extreme).abs() <= extreme.abs() * 2**-10).all())
    assert bool((grid.scale * extreme < 0).all())  # the extreme is code 0: the scale has the other sign
    ref = gguf.quants.dequantize(
        gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_0), gguf.GGMLQuantizationType.Q4_0
    )
    ref_err = float(((torch.from_numpy(ref).reshape(-1, 32) - blocks) ** 2).sum())
    our_err = float(((ours - blocks) ** 2).sum())
    assert abs(our_err - ref_err) <= 0.01 * ref_err


@pytest.mark.parametrize(
    "files,message",
    [
        ({"tokenizer.model": b"spm"}, r"tokenizer.model is not a SentencePiece model"),
        ({"vocab.txt": b"[PAD]"}, r"tokenizer \(vocab.txt\) is not embedded in GGUF files yet"),
        ({"tokenizer.json": b"{"}, "tokenizer.json is not valid JSON"),
        (
            {"tokenizer.json": b'{"model": {"type": "WordPiece"}, "decoder": {"type": "WordPiece"}}'},
            "is a WordPiece tokenizer; GGUF export embeds byte-level BPE",
        ),
        (
            {
                "tokenizer.json": b'{"model": {"type": "BPE", "vocab": {}}, "decoder": {"type": "ByteLevel"},'
                b'"pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": '
                b'{"Regex": "\\\\s+|\\\\w+"}}, {"type": "ByteLevel", "use_regex": false}]}}'
            },
            "splits text with the regex .* which llama.cpp knows by no name",
        ),
    ],
)
def test_tokenizers_llama_cpp_would_read_differently_are_refused(files, message):
    from qcompiler.interop.gguf_tokenizer import embed_tokenizer

    writer = gguf.GGUFWriter(None, "llama")
    with pytest.raises(ExportError, match=message):
        embed_tokenizer(writer, files, {"vocab_size": 300})


@pytest.mark.slow  # llama.cpp running Phi-3 is in the default run (test_llama_cpp_runs_our_gguf.py)
def test_phi3_keeps_its_fused_layers_and_says_llama_cpp_ignores_the_sliding_window(tmp_path):
    """Phi-3's qkv_proj / gate_up_proj are llama.cpp's attn_qkv / ffn_up as they are (llama.cpp runs
    them: tests/test_llama_cpp_runs_our_gguf.py); a sliding window is written and the export says
    llama.cpp will not apply it (measured: logits 30 % apart past an 8-token window)."""
    import transformers
    from causal_lms import config

    cfg = config("phi3")
    cfg.sliding_window = 8
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    cm = qc.compile(model, {"input_ids": prompt()}, recipe="rtn-q4_0", backend="eager")
    said = []
    cm.export_gguf(tmp_path / "phi3.gguf", progress=said.append)
    assert any("llama.cpp runs Phi-3 with full attention" in s and "first 8 tokens" in s for s in said)
    reader = gguf.GGUFReader(str(tmp_path / "phi3.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    layer = model.model.layers[0]
    rows = {name: int(tensors[name].shape[-1]) for name in ("blk.0.attn_qkv.weight", "blk.0.ffn_up.weight")}
    assert rows == {  # ggml lists the output rows last: the fused matrices whole
        "blk.0.attn_qkv.weight": layer.self_attn.qkv_proj.weight.shape[0],
        "blk.0.ffn_up.weight": layer.mlp.gate_up_proj.weight.shape[0],
    }
    assert int(reader.fields["phi3.attention.sliding_window"].parts[-1][0]) == 8


def test_spqr_exports_only_re_rounded_with_its_outliers_folded_in(tmp_path):
    """No GGUF type holds SpQR's grid: the export is refused naming the layer, and with a requantize
    type each weight is the layer's effective weight — its dense branch plus its outliers, read off
    the graph's own ops on an identity input — re-rounded (Q8_0: within 1 % relative)."""
    model = causal_lm("llama")
    cm = qc.compile(model, {"input_ids": prompt()}, recipe="spqr-w3g16", calibration=calibration(), backend="eager")
    with pytest.raises(ExportError, match=r"layer model\.layers\.0\.self_attn\.q_proj is SpQR \(3-bit groups of 16"):
        cm.export_gguf(tmp_path / "s.gguf", progress=lambda s: None)
    assert not (tmp_path / "s.gguf").exists()
    said = []
    cm.export_gguf(tmp_path / "s.gguf", requantize="q8_0", progress=said.append)
    assert "14 Q8_0 (re-rounded)" in said[0]
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "s.gguf")).tensors}
    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    gm, outliers = cm.graph_module, 0
    for node in gm.graph.nodes:
        if spec_of(node) is None or spec_of(node).name != "spqr_dense_linear":
            continue
        a = args_of(node)
        (add,) = node.users
        sparse = args_of(next(n for n in add.all_input_nodes if n is not node))
        outliers += int(sparse.tensor(gm, "values").numel())
        eye = torch.eye(a.tensor(gm, "perm").numel())
        settings = {k: int(getattr(a, k)) for k in ("bits", "group_size", "stat_bits", "stat_group_size")}
        dense_out = torch.ops.qc.spqr_dense_linear(eye, *a.tensors(gm, *SPQR_DENSE_TENSORS), None, **settings)
        sparse_out = torch.ops.qc.sparse_outlier_linear(
            eye, *sparse.tensors(gm, "row_ptr", "col_idx", "values"), add.meta["val"].shape[-1]
        )
        want = (dense_out + sparse_out).t()
        path_ = quantized_layer_path(a)
        entry = tensors[names.get_name(path_ + ".weight", try_suffixes=(".weight",))]
        back = torch.from_numpy(gguf.quants.dequantize(entry.data, entry.tensor_type).copy())
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}.get(path_.rsplit(".", 1)[1])
        if heads:
            back = back[torch.argsort(_rotary_rows(heads * head_dim, heads))]
        assert float((back - want).norm() / want.norm()) <= 0.01, path_
    assert outliers > 0  # the fold is exercised
