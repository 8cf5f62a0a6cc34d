"""A run's progress on disk, block by block, so that a killed run continues where it stopped
(``qcompiler quantize --checkpoint DIR [--resume]``; ``qc.compile(..., checkpoint=DIR, resume=True)``).

After each block of a weight-quantizing pass (RTN, GPTQ, SpQR, ...), rank 0 writes one safetensors
file, atomically: every layer's stored tensors and dequantized weight, and in the file's metadata
what was applied in which order — report figures, rewrite, skipped layers — as JSON (no pickle).
Resuming replays those blocks (results applied; the block re-run forward for the next block's
inputs, which gives the same bits) and solves the rest, so the tensors equal an uninterrupted
run's. ``progress.json`` holds the run's fingerprint: the model's weights (its safetensors files'
SHA-256, or the captured tensors' bytes), the recipe, the calibration batches, the versions; a
resume with another fingerprint is refused naming what changed. The folder goes once the run is
complete (the CLI: once the artifact is saved). Over several ranks rank 0 alone checks and writes
the folder and tells the others which blocks are recorded; every rank reads those blocks' files to
replay them (on several machines DIR must be a shared folder). Results do not depend on the number
of ranks, so a run may resume on another number (tests/test_distributed.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.fx import GraphModule

from qcompiler.errors import QCompilerError
from qcompiler.files.atomic import atomic_file, write_text_atomically
from qcompiler.files.regular_files import read_regular_file, sha256_of
from qcompiler.ir.tensors import get_raw_tensor
from qcompiler.pipeline.solved import solved_from, solved_header, solved_tensors

__all__ = ["ProgressError", "RunCheckpoint", "remove_progress", "run_fingerprint"]

PROGRESS = "progress.json"
_BLOCK = re.compile(r"pass(\d+)-block(\d+)\.safetensors")


class ProgressError(QCompilerError, ValueError):
    """A checkpoint folder that cannot be used for this run (the message says why)."""


def _tensor_digest(digest, t: torch.Tensor) -> None:
    t = t.detach().contiguous().cpu()
    digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
    digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def run_fingerprint(gm: GraphModule, passes, calibration: list) -> dict:
    """What a resumed run must share with the run that recorded the progress."""
    import transformers

    from qcompiler.frontend.lazy_weights import lazy_source
    from qcompiler.version import __version__

    source = lazy_source(gm)
    if source is not None:  # streamed: the files the weights come from
        folder = source.checkpoint.folder
        model = {}
        for path in sorted(folder.glob("*.safetensors")):
            with open(path, "rb") as f:
                model[path.name] = sha256_of(f)
    else:
        digest = hashlib.sha256()
        for name in sorted(gm.state_dict()):
            digest.update(name.encode())
            _tensor_digest(digest, get_raw_tensor(gm, name))
        model = {"tensors": digest.hexdigest()}
    digest = hashlib.sha256()
    for args, kwargs in calibration or []:
        for key, value in [*enumerate(args), *sorted(kwargs.items())]:
            digest.update(str(key).encode())
            if isinstance(value, torch.Tensor):
                _tensor_digest(digest, value)
            else:
                digest.update(repr(value).encode())
    return {
        "model": model,
        "recipe": [[p.name, p.config()] for p in passes],
        "calibration": digest.hexdigest(),
        "versions": {"qcompiler": __version__, "torch": torch.__version__, "transformers": transformers.__version__},
    }


class RunCheckpoint:
    """The progress folder of one run (see the module docstring)."""

    def __init__(
        self,
        folder,
        fingerprint: dict,
        *,
        resume: bool,
        writer: bool = True,
        log: Callable[[str], None] = lambda _m: None,
    ):
        self.folder, self.writer, self.log = Path(folder), writer, log
        from qcompiler.distributed.ranks import current_ranks

        if not current_ranks().distributed:
            self._blocks = self._open(fingerprint, resume)
            return
        # Rank 0 alone reads and writes the folder, then tells the others what it found: ranks
        # looking on their own would race its first write (and see an unfinished run's progress).
        from qcompiler.distributed.collectives import broadcast_json

        outcome = None
        if self.writer:
            try:
                outcome = {"blocks": sorted(self._open(fingerprint, resume))}
            except ProgressError as exc:
                outcome = {"error": str(exc)}
        outcome = broadcast_json(outcome, 0)
        if "error" in outcome:
            raise ProgressError(outcome["error"])
        self._blocks = {(int(p), int(b)) for p, b in outcome["blocks"]}

    def _open(self, fingerprint: dict, resume: bool) -> set[tuple[int, int]]:
        """Check the folder against this run, record its fingerprint; the blocks already recorded."""
        recorded = self._read_progress()
        if recorded is not None and not resume:
            raise ProgressError(
                f"{self.folder} holds the progress of an unfinished run: --resume continues it "
                "(or delete the folder to start over)"
            )
        if recorded is not None:
            changed = [key for key in fingerprint if json.dumps(fingerprint[key]) != json.dumps(recorded.get(key))]
            if changed:
                raise ProgressError(
                    f"{self.folder} was recorded by a run with a different {', '.join(changed)}: "
                    "it cannot be resumed with this one (delete the folder to start over)"
                )
        elif self.folder.exists() and any(self.folder.iterdir()):
            raise ProgressError(f"{self.folder} is not empty and holds no run progress; give a new or empty folder")
        # Listed once, before any pass runs: blocks this run writes are never read back by it.
        blocks = self._listed()
        if recorded is not None:
            self.log(f"resuming from {self.folder}: {len(blocks)} finished blocks recorded")
        if self.writer:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_text_atomically(self.folder / PROGRESS, json.dumps(fingerprint, indent=1) + "\n")
        return blocks

    def _read_progress(self) -> Optional[dict]:
        path = self.folder / PROGRESS
        if not path.exists():
            return None
        try:
            data = json.loads(read_regular_file(path, 1 << 24))
        except (OSError, ValueError) as exc:
            raise ProgressError(f"{path} cannot be read as a run's progress: {exc}") from None
        if not isinstance(data, dict):
            raise ProgressError(f"{path} is not a run's progress (not a JSON object)")
        return data

    def _listed(self) -> set[tuple[int, int]]:
        if not self.folder.is_dir():
            return set()
        return {(int(m[1]), int(m[2])) for f in self.folder.iterdir() if (m := _BLOCK.fullmatch(f.name))}

    def _path(self, pass_index: int, block: int) -> Path:
        return self.folder / f"pass{pass_index}-block{block}.safetensors"

    def recorded(self, pass_index: int, block: int) -> Optional[list]:
        """The events (``block_walk._BlockQuantizer.journal``) an earlier run recorded for this block."""
        if (pass_index, block) not in self._blocks:
            return None
        path = self._path(pass_index, block)
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {})["qcompiler.events"])
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (OSError, ValueError, KeyError) as exc:
            raise ProgressError(f"{path}: not a block record qcompiler wrote ({exc})") from None
        events = []
        for i, (kind, path_, data) in enumerate(meta):
            if kind == "skip":
                events.append((kind, path_, data))
                continue
            parts = []
            for j, header in enumerate(data):
                prefix = f"{i}.{j}."
                parts.append(
                    solved_from(header, {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)})
                )
            events.append((kind, path_, parts[0] if kind == "linear" else parts))
        self.log(f"  block {block + 1}: restored from {path.name}")
        return events

    def record(self, pass_index: int, block: int, events: list) -> None:
        """Write one solved block's events (rank 0; atomically)."""
        if not self.writer:
            return
        meta, tensors = [], {}
        for i, (kind, path, data) in enumerate(events):
            if kind == "skip":
                meta.append([kind, path, data])
                continue
            headers = []
            for j, solved in enumerate([data] if kind == "linear" else data):
                header = solved_header(solved)
                if header.get("error"):
                    raise ProgressError(header["error"])
                headers.append(header)
                tensors.update({f"{i}.{j}.{name}": t.contiguous() for name, t in solved_tensors(solved).items()})
            meta.append([kind, path, headers])
        with atomic_file(self._path(pass_index, block)) as tmp:
            save_file(tensors, str(tmp), metadata={"qcompiler.events": json.dumps(meta)})

    def remove(self) -> None:
        """The run is complete: its progress goes (rank 0)."""
        if self.writer:
            remove_progress(self.folder)


def remove_progress(folder) -> None:
    """Delete the files a run's progress consists of, then the folder if nothing else is in it."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for f in folder.iterdir():
        if f.name == PROGRESS or _BLOCK.fullmatch(f.name):
            f.unlink()
    try:
        folder.rmdir()
    except OSError:
        pass  # something else is in it: not ours to delete
