"""The model's tokenizer inside its GGUF file, as llama.cpp reads it.

llama.cpp re-implements tokenizers: a byte-level BPE ``tokenizer.json`` becomes its ``gpt2`` model
with the vocabulary, the merges and a *named* pre-tokenizer (the regex that splits text before
merging). The name is chosen from the exact regex the ``tokenizer.json`` declares — LLaMA-3's
(``llama-bpe``), Qwen2's (``qwen2``), GPT-2's built-in one (``gpt-2``) — never guessed from the model
type: an unknown regex is refused, because a wrong one tokenizes differently without any error.
A SentencePiece ``tokenizer.model`` (LLaMA-2, Mistral, Gemma) becomes llama.cpp's ``llama`` model with
its pieces, scores and token types, as llama.cpp's own converter writes them (a SentencePiece model
kept only as a byte-fallback ``tokenizer.json``, as Gemma-3 folders often are: ``gguf_spm_json``);
llama.cpp does no text normalization, so a model whose normalizer is not ``identity`` is refused. The bundled LM's byte
tokenizer becomes a byte-level vocabulary whose id is the byte. A model
without tokenizer files gets ``none`` (llama.cpp runs it on token ids). Special-token ids, the
add-BOS flag and the chat template come from the stored files through the ``gguf`` package's own
reader (``SpecialVocab``). The files are data: parsed as JSON or as SentencePiece's protobuf, nothing in
them is run.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import gguf

from qcompiler.data import ByteTokenizer
from qcompiler.interop.checkpoint import ExportError
from qcompiler.interop.gguf_spm_json import is_sentencepiece_json, write_llama_vocab, write_sentencepiece_json

__all__ = ["embed_tokenizer", "PRE_TOKENIZERS"]

# tokenizer.json Split regex -> llama.cpp's pre-tokenizer of that regex (its src/llama-vocab.cpp)
_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS = {
    _WORDS + r"\p{N}{1,3}" + _REST: "llama-bpe",  # digits in threes
    _WORDS + r"\p{N}" + _REST: "qwen2",  # digits one by one
}
# llama.cpp refuses a BPE vocabulary without merges and gguf writes no empty array: a merge that never
# applies (a letter and a digit never share a pre-tokenized word) stands in for none
_NO_MERGES = ["a 1"]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _pre_tokenizer(tj: dict) -> str:
    """llama.cpp's name for the tokenizer.json's pre-tokenizer, or an error naming what it is."""
    pre = tj.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        if pattern in PRE_TOKENIZERS:
            return PRE_TOKENIZERS[pattern]
        raise ExportError(
            f"tokenizer.json splits text with the regex {str(pattern)[:60]!r}..., which llama.cpp knows by no "
            f"name qcompiler can verify; known: LLaMA-3's and Qwen2's, and GPT-2's built-in one"
        )
    raise ExportError(f"tokenizer.json's pre-tokenizer {'+'.join(map(str, kinds))} is not one llama.cpp reads")


def _bpe(writer: gguf.GGUFWriter, tj: dict, vocab_size: int) -> str:
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or (tj.get("decoder") or {}).get("type") != "ByteLevel":
        raise ExportError(
            f"tokenizer.json is a {model.get('type')} tokenizer"
            + (" with byte fallback" if model.get("byte_fallback") else "")
            + "; GGUF export embeds byte-level BPE tokenizers (GPT-2, LLaMA-3, Qwen2 families) only"
        )
    pre = _pre_tokenizer(tj)
    tokens: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    types = {i: gguf.TokenType.NORMAL for i in tokens}
    for added in tj.get("added_tokens") or []:
        i = int(added["id"])
        tokens[i] = added["content"]
        types[i] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    if max(tokens) >= vocab_size:
        raise ExportError(f"tokenizer.json has token id {max(tokens)}, beyond the model's {vocab_size} embeddings")
    names, kinds = [], []
    for i in range(vocab_size):  # ids the tokenizer never uses (padded embedding rows): unused placeholders
        names.append(tokens.get(i, f"[PAD{i}]"))
        kinds.append(types.get(i, gguf.TokenType.UNUSED))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(names)
    writer.add_token_types(kinds)
    writer.add_token_merges(merges or _NO_MERGES)
    return f"byte-level BPE, {len(tokens)} tokens, {len(merges)} merges, pre-tokenizer {pre}"


def _is_byte_level_bpe(tj: dict) -> bool:
    model = tj.get("model") or {}
    return model.get("type") == "BPE" and not model.get("byte_fallback")


def _sentencepiece(writer: gguf.GGUFWriter, files: dict[str, bytes], vocab_size: int) -> str:
    """A SentencePiece model as llama.cpp's ``llama`` tokenizer: every piece with its score and kind,
    added tokens from tokenizer_config.json, ids beyond the model's pieces as unused placeholders."""
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(files["tokenizer.model"])
        sp = sentencepiece.SentencePieceProcessor(model_proto=files["tokenizer.model"])
    except Exception as e:  # noqa: BLE001 (protobuf and sentencepiece raise their own kinds)
        raise ExportError(f"tokenizer.model is not a SentencePiece model: {str(e)[:120]}") from None
    normalizer = proto.normalizer_spec
    if normalizer.name not in ("identity", "") or normalizer.precompiled_charsmap:
        raise ExportError(
            f"tokenizer.model normalizes text ({normalizer.name!r}), which llama.cpp does not: "
            "GGUF export embeds SentencePiece models with the identity normalizer (LLaMA-2, Mistral, Gemma)"
        )
    if sp.vocab_size() > vocab_size:
        raise ExportError(f"tokenizer.model has {sp.vocab_size()} pieces, beyond the model's {vocab_size} embeddings")
    names = [f"[PAD{i}]" for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    kinds = [gguf.TokenType.UNUSED] * vocab_size
    for i in range(sp.vocab_size()):
        names[i], scores[i] = sp.id_to_piece(i), sp.get_score(i)
        kinds[i] = (
            gguf.TokenType.UNKNOWN
            if sp.is_unknown(i)
            else gguf.TokenType.CONTROL
            if sp.is_control(i)
            else gguf.TokenType.UNUSED
            if sp.is_unused(i)
            else gguf.TokenType.BYTE
            if sp.is_byte(i)
            else gguf.TokenType.NORMAL
        )
    try:
        added = json.loads(files.get("tokenizer_config.json", b"{}")).get("added_tokens_decoder") or {}
    except (ValueError, UnicodeDecodeError) as e:
        raise ExportError(f"tokenizer_config.json is not valid JSON: {e}") from None
    for key, token in added.items():
        i = int(key)
        if i < vocab_size and isinstance(token, dict) and isinstance(token.get("content"), str):
            names[i], scores[i] = token["content"], -1000.0
            kinds[i] = gguf.TokenType.CONTROL if token.get("special") else gguf.TokenType.USER_DEFINED
    write_llama_vocab(writer, names, scores, kinds, bool(normalizer.add_dummy_prefix))
    kind = {1: "unigram", 2: "BPE"}.get(proto.trainer_spec.model_type, "other")
    return f"SentencePiece {kind}, {sp.vocab_size()} pieces"


def _bytes(writer: gguf.GGUFWriter) -> str:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(ByteTokenizer.byte_level_tokens())
    writer.add_token_types([gguf.TokenType.NORMAL] * 256)
    writer.add_token_merges(_NO_MERGES)
    writer.add_add_bos_token(False)
    return "byte-level (256 tokens)"


def embed_tokenizer(writer: gguf.GGUFWriter, files: dict[str, bytes], config: dict) -> str:
    """Write the tokenizer of ``files`` (the artifact's stored model files) into ``writer``; returns a
    one-line description. An unsupported tokenizer is an ExportError naming it."""
    vocab_size = int(config["vocab_size"])
    present = sorted(n for n in files if n in _TOKENIZER_FILES)
    tj = None
    if "tokenizer.json" in files:
        try:
            tj = json.loads(files["tokenizer.json"])
        except (ValueError, UnicodeDecodeError) as e:
            raise ExportError(f"tokenizer.json is not valid JSON: {e}") from None
    if tj is not None or "tokenizer.model" in files:
        # the tokenizer.json transformers derives from a tokenizer.model is byte-fallback BPE or Unigram:
        # the SentencePiece model itself is what llama.cpp reads then
        spm = "tokenizer.model" in files and (tj is None or not _is_byte_level_bpe(tj))
        if spm:
            described = _sentencepiece(writer, files, vocab_size)
        elif is_sentencepiece_json(tj):  # a SentencePiece model kept only as tokenizer.json (Gemma-3)
            described = write_sentencepiece_json(writer, tj, vocab_size)
        else:
            described = _bpe(writer, tj, vocab_size)
        with tempfile.TemporaryDirectory() as tmp:  # special ids, add-BOS, chat template: gguf's own reader
            names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
            for name in names:
                if name in files:
                    (Path(tmp) / name).write_bytes(files[name])
            (Path(tmp) / "config.json").write_text(json.dumps(config))
            gguf.SpecialVocab(tmp, load_merges=False, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)
        return described
    if present:
        raise ExportError(
            f"the model's tokenizer ({', '.join(present)}) is not embedded in GGUF files yet; "
            "byte-level BPE tokenizer.json files and SentencePiece tokenizer.model files are"
        )
    if vocab_size == ByteTokenizer.vocab_size:
        return _bytes(writer)
    writer.add_tokenizer_model("none")
    return "none (token ids only)"
