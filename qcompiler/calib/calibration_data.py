"""Calibration sets as users have them: a text file, a folder of text files, JSONL, Parquet, a
``datasets`` dataset saved with ``save_to_disk``, or a list of strings — tokenized with the model's
own tokenizer into the GPTQ paper's recipe (``nsamples`` random windows of ``seqlen`` tokens from
the joined documents, seeded) or, with ``packing="none"``, one padded sample per document with
the padding masked.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from qcompiler.files.regular_files import file_kind, read_regular_file

__all__ = ["read_texts", "decode_text", "calibration_batches", "sentence_lines", "TEXT_SUFFIXES", "TEXT_LIMIT"]

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".text")
# Calibration text read from files, in all: the GPTQ paper's 128 windows of 2048 tokens are ~1 MB of
# text, so a larger source is a mistake (a whole corpus, a disk image, a sparse file) that would be
# read into memory and tokenized whole before its first window is drawn.
TEXT_LIMIT = 256 << 20


def _read_bytes(path: Path, budget: list) -> bytes:
    """The bytes of the calibration file ``path`` (links followed: the user named it), refused in one
    line when it is not a regular file (a FIFO or ``/dev/zero`` would block or never end) or when it
    takes the files read so far past ``TEXT_LIMIT`` (``budget``: the bytes still allowed)."""
    if not path.is_file():  # a device (/dev/zero), a FIFO, also behind a link: never opened
        raise ValueError(f"calibration file {path} is not a regular file (it is a {file_kind(path)})")
    try:
        data = read_regular_file(path.resolve(), budget[0])
    except ValueError:  # over the bound (or no longer a regular file when opened)
        raise ValueError(
            f"calibration file {path} is over the {TEXT_LIMIT >> 20} MiB of calibration text qcompiler reads "
            f"(128 windows of 2048 tokens are ~1 MB of text); give a sample of it"
        ) from None
    except OSError as e:
        raise ValueError(f"calibration file {path} cannot be read ({e.strerror})") from None
    budget[0] -= len(data)
    return data


def decode_text(raw: bytes, where) -> str:
    """UTF-8 text, or a one-line error naming the file."""
    if b"\0" in raw:
        raise ValueError(f"calibration file {where} is not text (it contains NUL bytes)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"calibration file {where} is not UTF-8 text (byte {e.start})") from None


def _jsonl(path: Path, field: str) -> list[str]:
    texts = []
    for number, line in enumerate(decode_text(_read_bytes(path, [TEXT_LIMIT]), path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path} line {number} is not JSON ({e})") from None
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise ValueError(f"{path} line {number} has no string field {field!r} (choose it with --calib-field)")
        texts.append(record[field])
    return texts


def _parquet(path: Path, field: str) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {path} needs pyarrow: pip install 'qcompiler[data]'") from None
    table = pq.read_table(path)
    if field not in table.column_names:
        raise ValueError(
            f"{path} has no column {field!r} (columns: {', '.join(table.column_names)}; choose one with --calib-field)"
        )
    return [t for t in table.column(field).to_pylist() if isinstance(t, str)]


def _saved_dataset(path: Path, field: str) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"{path} is a saved `datasets` dataset; reading it needs: pip install 'qcompiler[data]'"
        ) from None
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        data = data["train"] if "train" in data else next(iter(data.values()))
    if field not in data.column_names:
        raise ValueError(f"dataset {path} has no column {field!r} (columns: {', '.join(data.column_names)})")
    return [t for t in data[field] if isinstance(t, str)]


def sentence_lines(texts: Sequence[str]) -> list[str]:
    """An encoder's samples from documents: one sentence per non-empty line, stripped."""
    return [line.strip() for t in texts for line in t.splitlines() if line.strip()]


def read_texts(source: Union[str, Path, Sequence[str]], *, field: str = "text") -> list[str]:
    """The documents of ``source`` (see the module doc), in a stable order; empty ones dropped."""
    if isinstance(source, (list, tuple)):
        if not all(isinstance(t, str) for t in source):
            raise ValueError("a calibration list must hold strings")
        texts = list(source)
        where = "the calibration list"
    else:
        path = Path(source)
        where = str(path)
        if not path.exists():
            raise ValueError(f"calibration source {path} does not exist")
        if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
            texts = _saved_dataset(path, field)
        elif path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
            if not files:
                raise ValueError(f"calibration folder {path} has no text files ({', '.join(TEXT_SUFFIXES)})")
            budget = [TEXT_LIMIT]
            texts = [decode_text(_read_bytes(p, budget), p) for p in files]
        elif path.suffix == ".jsonl":
            texts = _jsonl(path, field)
        elif path.suffix == ".parquet":
            texts = _parquet(path, field)
        else:
            texts = [decode_text(_read_bytes(path, [TEXT_LIMIT]), path)]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"calibration source {where} is empty")
    return texts


BATCH_TOKENS = 1024  # tokens per calibration batch by default


def calibration_batches(
    loaded,
    source,
    *,
    nsamples: int = 128,
    seqlen: int = 2048,
    seed: int = 0,
    packing: str = "windows",
    field: str = "text",
    batch_size: Optional[int] = None,
) -> list[dict]:
    """Calibration batches for ``loaded`` (a ``qc.models.LoadedModel``) from ``source``.

    ``batch_size`` (default: ``BATCH_TOKENS // seqlen`` samples, at least one) only groups the samples:
    the Hessians are the same. Each batch's activations are what calibration holds besides one
    block, so smaller batches lower the peak: 8 x 512 tokens -> 2 x 512 took a 0.44 B LLaMA's peak
    RSS down ~120 MB (one run each: 125 vs 128 s; docs/results.md has the side-by-side cost)."""
    if nsamples < 1 or seqlen < 1:
        raise ValueError(f"calibration needs nsamples >= 1 and seqlen >= 1, got {nsamples} and {seqlen}")
    if batch_size is None:
        batch_size = max(1, BATCH_TOKENS // min(seqlen, loaded.max_length))
    elif batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if packing not in ("windows", "none"):
        raise ValueError(f"packing must be 'windows' or 'none', got {packing!r}")
    texts = read_texts(source, field=field)
    if loaded.kind != "causal-lm":  # encoders: one sentence per line
        return loaded._sentence_batches(sentence_lines(texts)[:nsamples], min(seqlen, loaded.max_length), batch_size)
    seqlen = min(seqlen, loaded.max_length)  # the GPTQ paper's 2048 capped by the model's context
    docs = [ids for ids in map(loaded.tokenize, texts) if ids.numel()]
    if packing == "none":
        return _documents(docs, nsamples, seqlen, seed, batch_size)
    stream = torch.cat(docs) if docs else torch.zeros(0, dtype=torch.long)
    if stream.numel() <= seqlen:
        raise ValueError(
            f"the calibration text has {stream.numel()} tokens, fewer than one window of {seqlen}; "
            f"give more text or a smaller --seqlen"
        )
    if nsamples * seqlen > stream.numel():
        warnings.warn(
            f"qcompiler: the calibration text has {stream.numel()} tokens, fewer than nsamples x seqlen = "
            f"{nsamples} x {seqlen}; the {nsamples} windows overlap",
            stacklevel=2,
        )
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - seqlen + 1, (nsamples,), generator=gen)
    windows = torch.stack([stream[s : s + seqlen] for s in starts.tolist()])
    return [{"input_ids": w} for w in windows.split(batch_size)]


def _documents(docs: list[torch.Tensor], nsamples: int, seqlen: int, seed: int, batch_size: int) -> list[dict]:
    """One sample per document (seeded order), cut at ``seqlen``, right-padded with the padding masked."""
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()[:nsamples]
    if len(order) < nsamples:
        warnings.warn(
            f"qcompiler: the calibration source has {len(order)} documents, fewer than nsamples={nsamples}; "
            f"using {len(order)}",
            stacklevel=3,
        )
    picked = [docs[i][:seqlen] for i in order]
    batches = []
    for b in range(0, len(picked), batch_size):
        group = picked[b : b + batch_size]
        width = max(d.numel() for d in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, d in enumerate(group):
            ids[row, : d.numel()], mask[row, : d.numel()] = d, 1
        batches.append({"input_ids": ids, "attention_mask": mask})
    return batches
