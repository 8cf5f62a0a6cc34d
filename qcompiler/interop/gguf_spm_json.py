"""A SentencePiece tokenizer that only survives as ``tokenizer.json`` (Gemma-3, many re-uploads of
LLaMA-2 / Mistral) written as llama.cpp's ``llama`` tokenizer.

transformers turns a SentencePiece BPE model into a ``tokenizer.json`` BPE with ``byte_fallback``,
spaces replaced by ``▁``, and merges generated from the pieces' scores (a piece's merges rank by its
score). llama.cpp's ``llama`` tokenizer merges the adjacent pair whose joined text is the piece with
the highest score, leftmost first. So each piece's score is minus the rank of the first merge that
makes it, and both merge in the same order. Pieces no merge makes (single characters, bytes) never
result from a merge and keep score 0; added tokens become control (special) or user-defined tokens,
``<0xNN>`` pieces byte tokens. Anything else (a split pre-tokenizer, a normalizer other than the
space replacement, missing byte pieces) is refused by name, since llama.cpp would tokenize it
differently without error. llama.cpp's own converter writes such a folder as ``gpt2`` with a wrong
pre-tokenizer. The file is data: parsed as JSON, nothing in it is run.
"""

from __future__ import annotations

import gguf

from qcompiler.errors import ExportError

__all__ = ["is_sentencepiece_json", "write_llama_vocab", "write_sentencepiece_json"]

_SPACE = "▁"


def is_sentencepiece_json(tj: dict) -> bool:
    """Whether ``tokenizer.json`` is a SentencePiece BPE model in transformers' form (byte fallback)."""
    model = tj.get("model") or {}
    return model.get("type") == "BPE" and bool(model.get("byte_fallback"))


def _space_prefix(tj: dict) -> bool:
    """Whether the tokenizer puts ``▁`` before the text (llama.cpp's ``add_space_prefix``), from its
    normalizer and pre-tokenizer; an ExportError for steps llama.cpp does not do."""
    normalizer = tj.get("normalizer") or {}
    steps = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
    prefix = False
    for step in (s for s in steps if s):
        kind = step.get("type")
        if kind == "Prepend" and step.get("prepend") == _SPACE:
            prefix = True
        elif kind == "Replace" and (step.get("pattern") or {}).get("String") == " " and step.get("content") == _SPACE:
            pass
        else:
            raise ExportError(f"tokenizer.json normalizes text with {kind!r}, which llama.cpp's tokenizer does not do")
    pre = tj.get("pre_tokenizer") or {}
    kind = pre.get("type")
    if kind == "Metaspace":  # the newer form of the same: replace spaces, maybe prepend, never split
        if pre.get("split", True) or pre.get("replacement") != _SPACE:
            raise ExportError("tokenizer.json's Metaspace pre-tokenizer splits words, which llama.cpp's does not")
        prefix = pre.get("prepend_scheme", "always") in ("always", "first")
    elif kind == "Split" and (pre.get("pattern") or {}).get("String") == " " and steps:
        pass  # splits at spaces the normalizer already replaced by ▁: it never splits
    elif kind is not None:
        raise ExportError(f"tokenizer.json pre-tokenizes with {kind!r}, which llama.cpp's tokenizer does not do")
    return prefix


def write_llama_vocab(writer: gguf.GGUFWriter, names: list, scores: list, kinds: list, add_prefix: bool) -> None:
    """llama.cpp's ``llama`` (SentencePiece) tokenizer keys: pieces, scores, token types, space prefix."""
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(names)
    writer.add_token_scores(scores)
    writer.add_token_types(kinds)
    writer.add_add_space_prefix(add_prefix)


def write_sentencepiece_json(writer: gguf.GGUFWriter, tj: dict, vocab_size: int) -> str:
    """Write ``tj`` (see :func:`is_sentencepiece_json`) into ``writer``; a one-line description."""
    model = tj["model"]
    add_prefix = _space_prefix(tj)
    vocab: dict[str, int] = model.get("vocab") or {}
    if not isinstance(vocab, dict) or not vocab:
        raise ExportError("tokenizer.json's BPE model has no vocabulary")
    names = [f"[PAD{i}]" for i in range(vocab_size)]
    kinds = [gguf.TokenType.UNUSED] * vocab_size
    scores = [0.0] * vocab_size
    for piece, i in vocab.items():
        if not 0 <= int(i) < vocab_size:
            raise ExportError(f"tokenizer.json has token id {i}, beyond the model's {vocab_size} embeddings")
        names[int(i)], kinds[int(i)] = piece, gguf.TokenType.NORMAL
    missing = [b for b in range(256) if f"<0x{b:02X}>" not in vocab]
    if missing:
        raise ExportError(f"tokenizer.json falls back to bytes but has no piece <0x{missing[0]:02X}>")
    for b in range(256):
        kinds[vocab[f"<0x{b:02X}>"]] = gguf.TokenType.BYTE
    for rank, merge in enumerate(model.get("merges") or []):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        i = vocab.get(left + right)
        if i is not None and scores[i] == 0.0:
            scores[i] = -float(rank + 1)  # the first merge that makes a piece ranks it
    unk = model.get("unk_token")
    if unk in vocab:
        kinds[vocab[unk]] = gguf.TokenType.UNKNOWN
    for added in tj.get("added_tokens") or []:
        i = int(added["id"])
        if i >= vocab_size:
            raise ExportError(f"tokenizer.json has added token id {i}, beyond the model's {vocab_size} embeddings")
        names[i], scores[i] = added["content"], -1000.0
        kinds[i] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    write_llama_vocab(writer, names, scores, kinds, add_prefix)
    n_merges = len(model.get("merges") or [])
    return f"SentencePiece BPE from tokenizer.json, {len(vocab)} pieces, {n_merges} merges"
