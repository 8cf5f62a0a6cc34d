"""The tokenizer and generation files that travel with a model, from its folder into every output.

A live model reads them from the folder it was loaded from (``CaptureInfo.source_path``). An
artifact stores them beside its tensors, checksummed like every other file, and an exporter takes
them from there: a path written in a manifest is never followed (a tampered one would make an export
copy files from anywhere).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from torch.fx import GraphModule

__all__ = ["TOKENIZER_FILES", "MAX_MODEL_FILE_BYTES", "model_files", "read_regular_file", "STORED_KEY"]

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


def read_regular_file(path, limit: int, *, dir_fd: int | None = None) -> bytes:
    """The bytes of ``path``: a regular file (no symbolic link, FIFO or device) of at most ``limit``
    bytes, else OSError / ValueError naming it. Never blocks on a FIFO, never reads /dev/zero."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if info.st_size > limit:
            raise ValueError(f"{path} is {info.st_size} bytes, over the {limit}-byte bound")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} grew past the {limit}-byte bound while read")
    return data


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
