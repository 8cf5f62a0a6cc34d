"""The real llama.cpp (llama-cpp-python) runs qcompiler's GGUF files: logits within a stated tolerance
of the quantized graph's own, and the bundled LM's greedy continuation token for token.

Tolerance: llama.cpp multiplies Q4_0 / Q4_1 / Q8_0 weights with activations it rounds to 8-bit blocks
(Q8_0; Q4_K's with Q8_K, 8-bit blocks of 256), which the graph does not; measured, that moves the
logits by 0.6-0.9 % of their largest magnitude (Q4_K: 0.7 %; F16 weights: 0.04 %). Bounds: 2.5 % for block types, 0.3 % for F16. llama-cpp-python
builds llama.cpp from source (about 5 minutes): ``.ci/run`` caches its wheel and sets
``QC_REQUIRE_LLAMA_CPP=1``, which turns a missing install into a failure instead of a skip.
"""

import os

import numpy as np
import pytest
import torch
from causal_lms import calibration, causal_lm, prompt
from typer.testing import CliRunner

import qcompiler as qc
from qcompiler import models
from qcompiler.cli import app, main

if os.environ.get("QC_REQUIRE_LLAMA_CPP"):
    import llama_cpp
else:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (.ci/run installs it)")

BOUND = {
    "none": 0.003,
    "gptq-q4_0": 0.025,
    "gptq-q4_1": 0.025,
    "rtn-q8_0": 0.025,
    "gptq-q4_k": 0.025,
    "gptq-q5_k": 0.025,
    "gptq-q6_k": 0.025,
    "gptq-q3_k": 0.025,
    "gptq-q2_k": 0.025,
    "gptq-q5_1": 0.025,
    "gptq-mxfp4": 0.025,  # measured 0.8 % (rtn-mxfp4 0.5 %)
}


def _llama(path, n_ctx=256):
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, verbose=False, n_threads=2, seed=0)


def _logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)])


@pytest.mark.parametrize(
    "arch,recipe",
    [
        ("llama", "gptq-q4_0"),
        ("llama", "gptq-q4_1"),
        pytest.param("qwen2", "gptq-q4_0", marks=pytest.mark.slow),
        pytest.param("mistral", "rtn-q8_0", marks=pytest.mark.slow),
        pytest.param("qwen3", "gptq-q4_0", marks=pytest.mark.slow),
        ("phi3", "gptq-q4_1"),  # fused qkv_proj / gate_up_proj as llama.cpp's attn_qkv / ffn_up
        pytest.param("llama", "none", marks=pytest.mark.slow),
        pytest.param("llama", "gptq-q5_1", marks=pytest.mark.slow),  # Q5_1: Q4_1's grid with a fifth bit
        ("llama", "gptq-mxfp4"),  # MXFP4 (qc.mxfp4_linear) as llama.cpp's MXFP4 blocks, code for code
        # soft-capping, 1 + w norms, post-norms, the head read from the embeddings, and a sliding window of 8
        # (alternate layers) inside the 24 tokens
        ("gemma2", "gptq-q4_0"),
        pytest.param("gemma2", "none", marks=pytest.mark.slow),
        # QK-norm, the sliding layers' own rotary base (10k vs 1M: a wrong one moves logits by 30 %),
        # a sliding window of 8 on layer 0 only, written per layer
        ("gemma3_text", "gptq-q4_0"),
        pytest.param("gemma3_text", "none", marks=pytest.mark.slow),
    ],
)
def test_llama_cpp_logits_match_the_graph(arch, recipe, tmp_path):
    model = causal_lm(arch)
    if arch == "gemma2":  # llama.cpp scales queries by 1/sqrt(head_dim): a config that does (as Gemma-2 2B/9B)
        model.config.query_pre_attn_scalar = model.config.head_dim
        model.config.sliding_window = 8
        model = type(model)(model.config).eval()
    calib = calibration() if recipe.startswith("gptq") else None
    cm = qc.compile(model, {"input_ids": prompt()}, recipe=recipe, calibration=calib, backend="eager")
    cm.export_gguf(tmp_path / "m.gguf", progress=lambda s: None)
    ids = torch.randint(3, model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    want = cm(input_ids=ids[None]).logits[0].detach().float().numpy()
    got = _logits(_llama(tmp_path / "m.gguf"), ids.tolist())
    assert np.abs(got - want).max() <= BOUND[recipe] * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


@pytest.fixture(scope="module")
def tinylm_q4(tmp_path_factory):
    m = models.load("tinylm")
    cm = qc.compile(m.model, m.example_inputs(), recipe="gptq-q4_0", calibration=m.calibration(8), backend="eager")
    art = tmp_path_factory.mktemp("art") / "w4"
    cm.save(art)
    return m, cm, art


def test_bundled_lm_through_the_cli_generates_what_qcompiler_generates(tinylm_q4, tmp_path):
    """``qcompiler export ART --format gguf``: llama.cpp tokenizes text as the byte tokenizer does, and
    picks qcompiler's 32 greedy tokens after a prompt (near-ties within the tolerance aside)."""
    m, cm, art = tinylm_q4
    out = tmp_path / "tinylm-q4_0.gguf"
    result = CliRunner().invoke(app, ["export", str(art), "--format", "gguf", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "28 Q4_0 (exact)" in result.output and "tokenizer byte-level" in result.output
    llm = _llama(out, n_ctx=512)
    text = "def parse(path):\n    # ünïcode → bytes\n    return open(path).read()\n"
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == m.encode(text).reshape(-1).tolist()
    ids = m.encode("import os\nimport sys\n\ndef main(argv):\n    ").reshape(-1)
    want = cm.generate(ids[None], max_new_tokens=32)[0, ids.numel() :]
    # Teacher-forced over qcompiler's continuation: llama.cpp's argmax is qcompiler's token at every
    # step, except where qcompiler's own top two are closer than the logits' tolerance (a near-tie
    # that llama.cpp's 8-bit activations may break the other way; then free-running outputs part).
    forced = torch.cat([ids, want])
    ours = cm(input_ids=forced[None]).logits[0, ids.numel() - 1 : -1].detach().float()
    theirs = torch.from_numpy(_logits(llm, forced.tolist())[ids.numel() - 1 : -1])
    picked = theirs.argmax(-1)
    margin = ours.gather(-1, want[:, None]) - ours.gather(-1, picked[:, None])
    tolerance = 2 * BOUND["gptq-q4_0"] * ours.abs().max()
    assert bool(((picked == want) | (margin[:, 0] <= tolerance)).all())
    assert int((picked == want).sum()) >= 30
    assert llm.detokenize(want.tolist()) == bytes(want.tolist())


@pytest.mark.parametrize(
    "recipe",
    ["gptq-q4_k", *(pytest.param(r, marks=pytest.mark.slow) for r in ("gptq-q5_k", "gptq-q6_k")), "gptq-q3_k"]
    + [pytest.param("gptq-q2_k", marks=pytest.mark.slow)],
)
def test_llama_cpp_runs_k_quants_as_the_graph_does(recipe, tmp_path):
    """gptq-q4_k / -q5_k / -q6_k / -q3_k / -q2_k (llama.cpp's own super-block bytes, stored as they are) on the bundled
    LM, whose widths are multiples of 256: llama.cpp's logits within the bound of the graph's, and its
    argmax is the graph's at every position of a code snippet except near-ties within that bound."""
    m = models.load("tinylm")
    cm = qc.compile(m.model, m.example_inputs(), recipe=recipe, calibration=m.calibration(8), backend="eager")
    cm.export_gguf(tmp_path / "q4k.gguf", progress=lambda s: None)
    ids = m.encode("import os\nimport sys\n\ndef main(argv):\n    return parse(argv[1:])\n").reshape(-1)
    want = cm(input_ids=ids[None]).logits[0].detach().float()
    got = torch.from_numpy(_logits(_llama(tmp_path / "q4k.gguf"), ids.tolist()))
    bound = BOUND[recipe] * want.abs().max()
    assert (got - want).abs().max() <= bound
    picked = got.argmax(-1)
    margin = want.max(-1).values - want.gather(-1, picked[:, None])[:, 0]
    assert bool(((picked == want.argmax(-1)) | (margin <= 2 * bound)).all())


def test_requantized_export_is_named_on_the_command_line(tinylm_q4, tmp_path, capsys):
    """An artifact on another grid exports only with --requantize, and the CLI says it re-rounded."""
    m, _, _ = tinylm_q4
    cm = qc.compile(m.model, m.example_inputs(), recipe="rtn-w4g128", backend="eager")
    art = tmp_path / "rtn"
    cm.save(art)
    assert main(["export", str(art), "--format", "gguf", "--out", str(tmp_path / "x.gguf")]) == 2
    assert "error: layer model.layers.0.self_attn.q_proj is 4-bit groups of 128" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()
    ok = CliRunner().invoke(
        app, ["export", str(art), "--format", "gguf", "--out", str(tmp_path / "x.gguf"), "--requantize", "q4_0"]
    )
    assert ok.exit_code == 0, ok.output
    assert "re-quantized to Q4_0 by llama.cpp's round-to-nearest" in ok.output
    ids = m.encode("import os\n").reshape(-1).tolist()
    assert np.isfinite(_logits(_llama(tmp_path / "x.gguf"), ids)).all()


def _save_random_llama(folder, vocab_size: int, *, bos: int, eos: int) -> None:
    """A random two-layer LLaMA (width 64) with this vocabulary and these special ids, saved to ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    LlamaForCausalLM(config).save_pretrained(folder)


def _bpe_model_folder(folder, split_regex, vocab_size=300):
    """A random LLaMA whose folder holds a byte-level BPE tokenizer.json trained here on the bundled
    text, pre-tokenized by ``split_regex`` (None: GPT-2's built-in ByteLevel regex), with two special
    tokens and four padded embedding rows beyond the vocabulary."""
    import json

    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tok_models

    from qcompiler.data import stdlib_text

    tok = Tokenizer(tok_models.BPE())
    if split_regex is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split_regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<s>", "</s>"]
    )
    tok.train_from_iterator([stdlib_text("train")[:200_000]], trainer)
    _save_random_llama(folder, tok.get_vocab_size() + 4, bos=0, eos=1)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False})
    )
    return tok


@pytest.mark.parametrize(
    "pre", ["llama-bpe", pytest.param("qwen2", marks=pytest.mark.slow), pytest.param("gpt-2", marks=pytest.mark.slow)]
)
def test_bpe_tokenizer_json_tokenizes_in_llama_cpp_as_in_transformers(pre, tmp_path):
    """A byte-level BPE tokenizer.json is embedded with llama.cpp's pre-tokenizer of its exact regex:
    llama.cpp's token ids of held-out text (code, digits, contractions, non-ASCII) are the
    tokenizers library's, and detokenizing gives the text back."""
    from qcompiler.data import stdlib_text
    from qcompiler.interop.gguf_tokenizer import PRE_TOKENIZERS

    regex = {name: r for r, name in PRE_TOKENIZERS.items()}.get(pre)
    folder = tmp_path / "model"
    folder.mkdir()
    tok = _bpe_model_folder(folder, regex)
    m = models.load(folder)
    cm = qc.compile(m.model, {"input_ids": prompt()}, recipe="rtn-q8_0", backend="eager")
    said = []
    cm.export_gguf(tmp_path / "m.gguf", progress=said.append)
    assert f"pre-tokenizer {pre}" in said[0]
    llm = _llama(tmp_path / "m.gguf")
    text = stdlib_text("heldout")[:3000] + "\nIt's 12345 dogs' café — naïve 9876543 'LL 'Re\n"
    want = tok.encode(text).ids
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == want
    assert llm.detokenize(want).decode() == text
    assert llm.token_eos() == 1


def _spm_model_proto(normalization: str = "identity") -> bytes:
    """A SentencePiece BPE model trained here with LLaMA-2's settings (byte fallback, split digits,
    identity normalization, a dummy prefix)."""
    import io

    import sentencepiece

    from qcompiler.data import stdlib_text

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(stdlib_text("train")[:300_000].splitlines()),
        model_writer=out,
        vocab_size=500,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name=normalization,
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return out.getvalue()


def test_sentencepiece_tokenizer_model_tokenizes_in_llama_cpp_as_in_sentencepiece(tmp_path):
    """A SentencePiece tokenizer.model (as LLaMA-2, Mistral and Gemma ship) is embedded as llama.cpp's
    llama tokenizer: llama.cpp's ids of held-out text (code, digits, runs of spaces, tabs, non-ASCII
    through byte fallback) are SentencePiece's own, and detokenizing gives the text back (after the
    dummy-prefix space llama.cpp keeps on a first token)."""
    import json

    import sentencepiece

    from qcompiler.data import stdlib_text

    proto = _spm_model_proto()
    sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
    folder = tmp_path / "model"
    _save_random_llama(folder, sp.vocab_size(), bos=1, eos=2)
    (folder / "tokenizer.model").write_bytes(proto)
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False})
    )
    m = models.load(folder)
    cm = qc.compile(m.model, {"input_ids": prompt()}, recipe="rtn-q8_0", backend="eager")
    said = []
    cm.export_gguf(tmp_path / "m.gguf", progress=said.append)
    assert "tokenizer SentencePiece BPE, 500 pieces" in said[0]
    llm = _llama(tmp_path / "m.gguf")
    text = stdlib_text("heldout")[:3000] + "\nIt's 12345 dogs' café — naïve 9876543  two  spaces\n\ttab"
    want = sp.encode(text)
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == want
    assert llm.detokenize(want).decode() == " " + text
    assert (llm.token_bos(), llm.token_eos()) == (1, 2)


@pytest.mark.parametrize("kind", ["GemmaTokenizer", pytest.param("LlamaTokenizer", marks=pytest.mark.slow)])
def test_a_sentencepiece_model_kept_only_as_tokenizer_json_tokenizes_in_llama_cpp_as_in_transformers(kind, tmp_path):
    """Gemma-3 folders (and many LLaMA-2 re-uploads) carry their SentencePiece model only as the
    byte-fallback BPE tokenizer.json transformers derives from it: exported from that file alone
    (Gemma's form: spaces replaced, no prefix; LLaMA's: Metaspace with a prefix on the first word),
    llama.cpp's ids of held-out text are transformers' own, and detokenizing gives the text back."""
    import json

    from transformers import AutoTokenizer

    from qcompiler.data import stdlib_text

    source = tmp_path / "spm"
    source.mkdir()
    (source / "tokenizer.model").write_bytes(_spm_model_proto())
    (source / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": kind}))
    folder = tmp_path / "model"
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)  # what a user of the folder gets
    assert not (folder / "tokenizer.model").exists() and (folder / "tokenizer.json").exists()
    _save_random_llama(folder, len(tok), bos=tok.bos_token_id, eos=tok.eos_token_id)
    m = models.load(folder)
    cm = qc.compile(m.model, {"input_ids": prompt()}, recipe="rtn-q8_0", backend="eager")
    said = []
    cm.export_gguf(tmp_path / "m.gguf", progress=said.append)
    assert "tokenizer SentencePiece BPE from tokenizer.json, 500 pieces" in said[0]
    llm = _llama(tmp_path / "m.gguf")
    text = stdlib_text("heldout")[:3000] + "\nIt's 12345 dogs' café — naïve 9876543  two  spaces\n\ttab 日本 🤖"
    want = tok.encode(text, add_special_tokens=False)
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == want
    prefix = " " if kind == "LlamaTokenizer" else ""  # llama.cpp keeps the prefix space on a first token
    assert llm.detokenize(want).decode() == prefix + text
    assert (llm.token_bos(), llm.token_eos()) == (tok.bos_token_id, tok.eos_token_id)


def test_a_sentencepiece_model_that_normalizes_text_is_refused():
    """llama.cpp does not normalize text: a tokenizer.model with NFKC normalization would tokenize
    differently there without any error, so it is refused by name."""
    import gguf

    from qcompiler.interop.checkpoint import ExportError
    from qcompiler.interop.gguf_tokenizer import embed_tokenizer

    writer = gguf.GGUFWriter(None, "llama")
    with pytest.raises(ExportError, match=r"tokenizer.model normalizes text \('nmt_nfkc'\), which llama.cpp does not"):
        embed_tokenizer(writer, {"tokenizer.model": _spm_model_proto("nmt_nfkc")}, {"vocab_size": 500})
