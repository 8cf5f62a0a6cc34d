"""Real text that every machine has offline: the CPython standard library's own sources.

The bundled causal LM is trained on the ``train`` split and evaluated on ``heldout``, a fixed list
of modules that training never sees. Tokens are bytes (vocabulary 256), so no tokenizer file is
needed and any text round-trips exactly; exports write one for other runtimes.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

__all__ = [
    "HELDOUT_MODULES",
    "ByteTokenizer",
    "stdlib_files",
    "stdlib_text",
    "stdlib_tokens",
    "calibration_windows",
    "stdlib_sentences",
]

# Whole modules kept out of training, used only for evaluation. Chosen to span styles
# (parsing, numerics, text, data structures, I/O) and together about 0.6 MB.
HELDOUT_MODULES = (
    "argparse.py",
    "difflib.py",
    "textwrap.py",
    "statistics.py",
    "fractions.py",
    "heapq.py",
    "calendar.py",
    "csv.py",
    "shlex.py",
    "string.py",
    "bisect.py",
    "glob.py",
    "json/encoder.py",
    "json/decoder.py",
    "email/_header_value_parser.py",
)
_EXCLUDED_DIRS = ("test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "ensurepip")


class ByteTokenizer:
    """UTF-8 bytes as tokens: ``vocab_size`` 256, exact round trip, nothing to ship."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        """Token ids (one per UTF-8 byte) of ``text``."""
        data = text.encode("utf-8")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long() if data else torch.zeros(0, dtype=torch.long)

    def decode(self, ids) -> str:
        """The text of byte token ids (invalid UTF-8 replaced)."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    @staticmethod
    def byte_level_tokens() -> list[str]:
        """Token ``i`` as byte-level BPE vocabularies spell byte ``i`` (GPT-2's byte-to-unicode map):
        the vocabulary of this tokenizer's Hugging Face and GGUF forms."""
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        alphabet = bytes_to_unicode()
        return [alphabet[b] for b in range(256)]

    def save_pretrained(self, folder) -> list[str]:
        """The same tokenizer as Hugging Face files (``tokenizer.json``: byte-level BPE with the 256
        bytes as its vocabulary and no merges, id = byte value), so that runtimes which load a
        tokenizer from the model folder (transformers, GPTQModel, vLLM, onnxruntime-genai) tokenize
        text exactly as this class does. Returns the names written."""
        import json

        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        tokens = self.byte_level_tokens()
        tok = Tokenizer(models.BPE(vocab={t: b for b, t in enumerate(tokens)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        folder = Path(folder)
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "clean_up_tokenization_spaces": False,
                    "model_max_length": 1 << 30,
                    "pad_token": tokens[0],
                },
                indent=2,
            )
            + "\n"
        )  # NUL pads, as in generate()
        return ["tokenizer.json", "tokenizer_config.json"]


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(split: str) -> list[Path]:
    """Sorted source files of one split: ``"train"`` or ``"heldout"``."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = _stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in _EXCLUDED_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        is_heldout = rel.as_posix() in HELDOUT_MODULES
        if is_heldout == (split == "heldout"):
            files.append(path)
    if not files:
        raise FileNotFoundError(f"no standard-library sources found under {root} for split {split!r}")
    return files


def stdlib_text(split: str) -> str:
    """The split's files joined in sorted order, each preceded by a header line naming it."""
    root = _stdlib_root()
    parts = []
    for path in stdlib_files(split):
        parts.append(f"# file: {path.relative_to(root).as_posix()}\n")
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
    return "".join(parts)


def stdlib_tokens(split: str) -> torch.Tensor:
    """The split as one long tensor of byte ids."""
    return ByteTokenizer().encode(stdlib_text(split))


def calibration_windows(
    count: int = 128, length: int = 256, *, seed: int = 0, split: str = "train", max_length: int | None = None
) -> torch.Tensor:
    """``count`` token windows of ``length`` bytes at reproducible random offsets: ``[count, length]``.

    ``max_length`` is the model's context; a longer window is refused rather than silently cut.
    """
    if count < 1 or length < 1:
        raise ValueError(f"calibration needs count >= 1 and length >= 1, got count={count}, length={length}")
    if max_length is not None and length > max_length:
        raise ValueError(f"calibration windows of {length} tokens exceed the model's context of {max_length}")
    return random_windows(stdlib_tokens(split), count, length, seed=seed, split=split)


def random_windows(
    tokens: torch.Tensor, count: int, length: int, *, seed: int = 0, split: str = "train"
) -> torch.Tensor:
    """``count`` windows of ``length`` tokens at reproducible random offsets (the GPTQ paper's recipe)."""
    if length >= tokens.numel():
        raise ValueError(f"window length {length} exceeds the {split} split ({tokens.numel()} tokens)")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - length, (count,), generator=gen)
    return torch.stack([tokens[s : s + length] for s in starts.tolist()])


def stdlib_sentences(split: str, count: int = 256, *, min_words: int = 6, max_words: int = 40) -> list[str]:
    """Real English sentences: the first sentence of docstrings in the split's modules, deduplicated,
    in a fixed order. Used to calibrate and judge sentence encoders."""
    import ast

    seen, out = set(), []
    for path in stdlib_files(split):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            first = " ".join(doc.strip().split("\n\n")[0].split())
            sentence = first.split(". ")[0].rstrip(".") + "."
            words = sentence.split()
            if min_words <= len(words) <= max_words and sentence not in seen and sentence[0].isupper():
                seen.add(sentence)
                out.append(sentence)
                if len(out) == count:
                    return out
    return out
