"""The tokenizer and generation files that travel with a model, from its folder into every output.

A live model reads them from the folder it was loaded from (``CaptureInfo.source_path``). An
artifact stores them beside its tensors, checksummed like every other file, and an exporter takes
them from there: a path written in a manifest is never followed (a tampered one would make an export
copy files from anywhere).
"""

from __future__ import annotations

from pathlib import Path

from torch.fx import GraphModule

from qcompiler.files.regular_files import read_regular_file

__all__ = ["TOKENIZER_FILES", "MAX_MODEL_FILE_BYTES", "model_files", "STORED_KEY"]

# What a loader needs beside the weights; the only names an artifact may store.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
)
MAX_MODEL_FILE_BYTES = 256 << 20  # a large vocabulary's tokenizer.json is tens of MB
STORED_KEY = "qcompiler_model_files"  # gm.meta key of the files a loaded artifact carried


def model_files(gm: GraphModule) -> dict[str, bytes]:
    """``{name: bytes}`` of the model's tokenizer and generation files: those a loaded artifact
    stored, else those of the folder a live model was loaded from (none for a model built in code)."""
    if STORED_KEY in gm.meta:
        return dict(gm.meta[STORED_KEY])
    source = getattr(gm.meta.get("qcompiler"), "source_path", None)
    if not source or not Path(source).is_dir():
        return {}
    found = {}
    for name in TOKENIZER_FILES:
        path = Path(source) / name
        if path.is_file() and not path.is_symlink():
            found[name] = read_regular_file(path, MAX_MODEL_FILE_BYTES)
    return found
