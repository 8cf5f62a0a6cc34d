"""``qcompiler quantize ORG/NAME[@REVISION]`` resolves a hub id through huggingface_hub's cache
(offline here: a cache laid out as the hub client lays it), and an id that is neither a folder nor
cached is refused in one line naming it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from qcompiler.cli import main
from qcompiler.models import BUNDLED_LMS
from qcompiler.models.hub import is_hub_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache_with(tmp_path, repo: str, refs=("main",)):
    """A hub cache holding the bundled tinylm as ``repo`` at each of ``refs``."""
    cache = tmp_path / "hub"
    entry = cache / f"models--{repo.replace('/', '--')}"
    snapshot = entry / "snapshots" / COMMIT
    shutil.copytree(BUNDLED_LMS["tinylm"], snapshot)
    (entry / "refs").mkdir(parents=True)
    for ref in refs:
        (entry / "refs" / ref).write_text(COMMIT)
    return cache


def _run(tmp_path, cache, *args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home")}
    return subprocess.run(
        [sys.executable, "-m", "qcompiler", *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600
    )


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """This process's hub client offline, on a cache holding tinylm as someorg/tiny-lm at main and v1."""
    from huggingface_hub import constants

    cache = _cache_with(tmp_path, "someorg/tiny-lm", refs=("main", "v1"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    return cache


def test_a_cached_hub_id_quantizes_offline_and_the_artifact_names_the_id(offline_cache, tmp_path):
    assert main(["quantize", "someorg/tiny-lm@v1", "--recipe", "rtn-w4g128", "--out", "art"]) == 0
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["metadata"]["source"] == "someorg/tiny-lm@v1"
    assert main(["quantize", "someorg/tiny-lm", "--revision", "v1", "--recipe", "rtn-w4g128", "--out", "a2"]) == 0


@pytest.mark.slow
def test_hf_hub_offline_in_the_environment_is_honoured_as_a_user_sets_it(tmp_path):
    cache = _cache_with(tmp_path, "someorg/tiny-lm")
    done = _run(tmp_path, cache, "quantize", "someorg/tiny-lm", "--recipe", "rtn-w4g128", "--out", "art")
    assert done.returncode == 0, done.stderr
    done = _run(tmp_path, cache, "quantize", "someorg/other", "--out", "o")
    assert done.returncode == 2 and "model someorg/other is not a local folder" in done.stderr


@pytest.mark.parametrize(
    "args,says",
    [
        (["quantize", "someorg/not-cached", "--out", "o"], "model someorg/not-cached is not a local folder"),
        (["quantize", "someorg/tiny-lm@v9", "--out", "o"], "someorg/tiny-lm@v9"),
        (["quantize", "bundled:tinylm", "--revision", "v1", "--out", "o"], "--revision applies to a hub id"),
    ],
)
def test_an_unknown_id_or_revision_is_refused_in_one_line_naming_it(offline_cache, tmp_path, capsys, args, says):
    assert main(args) == 2
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("[qcompiler] ")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines
    assert not (tmp_path / "o").exists()


def test_a_local_folder_is_never_taken_for_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("org/name") and is_hub_id("org/name@main") and not is_hub_id("./org/name")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")  # a folder of that name wins, as in transformers
    assert not is_hub_id("a/b/c") and not is_hub_id("/abs/path") and not is_hub_id("bundled:tinylm")
