"""A disk that fills up while an output is written: the CLI's writers (quantize --out, every export
format) end in one line naming the output, exit 1, with the previous output intact, no partial file
or folder beside it, and none of qcompiler's temporaries left in TMPDIR.

The full disk is a file-size limit (RLIMIT_FSIZE) on the child process, so any write past 100 kB
fails inside the real writers (safetensors, numpy, protobuf) as on a full disk, with EFBIG
("File too large") instead of ENOSPC — the same error paths, no mount needed."""

from __future__ import annotations

import hashlib
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import qcompiler as qc
from qcompiler.models import load

LIMIT = 100_000  # bytes: every output here is larger (the artifact ~2 MB)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    tinylm = load("tinylm")
    cm = qc.compile(tinylm.model, tinylm.example_inputs(), recipe="rtn-q4_0", progress=False)
    path = tmp_path_factory.mktemp("full") / "art"
    cm.save(path)
    return cm, path


def _limited():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


def _snapshot(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def _run_full(args: list, tmpdir: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TMPDIR=str(tmpdir))
    return subprocess.run(
        [sys.executable, "-m", "qcompiler", *map(str, args)],
        capture_output=True,
        text=True,
        preexec_fn=_limited,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        timeout=300,
    )


# the default run keeps GGUF (numpy's short write); the artifact's safetensors write fails the same way
# in tests/test_output_folders.py's injected ENOSPC
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "fmt,name",
    [
        pytest.param("artifact", "out", marks=SLOW),
        ("gguf", "m.gguf"),
        pytest.param("gptq", "g", marks=SLOW),
        pytest.param("compressed-tensors", "c", marks=SLOW),
        pytest.param("onnx", "m.onnx", marks=SLOW),
        pytest.param("onnx-genai", "genai", marks=SLOW),
    ],
)
def test_a_full_disk_keeps_the_previous_output(artifact, tmp_path, fmt, name):
    cm, art = artifact
    work = tmp_path / "work"
    work.mkdir()
    out = work / name
    if fmt == "artifact":
        cm.save(out)
        args = ["quantize", "bundled:tinylm", "--recipe", "rtn-q4_0", "--out", out]
    else:
        cm.export(fmt, out)
        args = ["export", art, "--format", fmt, "--out", out]
    before = _snapshot(work)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    done = _run_full(args, tmpdir)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1, done.stderr[-2000:]
    assert len(errors) == 1 and errors[0].endswith(f": {out}"), done.stderr[-2000:]
    assert "File too large" in errors[0] or "short write" in errors[0]
    assert "Traceback" not in done.stderr
    assert _snapshot(work) == before  # the previous output as it was; nothing beside it
    assert not [p.name for p in tmpdir.iterdir() if p.name.startswith(("qcompiler", ".qc"))]
