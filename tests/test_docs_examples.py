"""Every code block in README.md and docs/guide.md runs as written: the Python blocks of a page in
order in one namespace (as a reader pastes them), the shell blocks line by line, each page in a
fresh folder. ``text`` blocks are pictures or templates with placeholders (FOLDER, host0) and are
not run; ``pip install`` and ``pytest`` are what .ci/run itself runs first."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
PAGES = ["README.md", "docs/guide.md"]


def blocks(page: str, language: str) -> list[str]:
    return [code for lang, code in FENCE.findall((ROOT / page).read_text()) if lang == language]


def shell_commands(page: str) -> list[str]:
    """The page's shell commands, minus the install and the test run CI performs itself."""
    commands = []
    for code in blocks(page, "bash"):
        for line in code.replace("\\\n", " ").splitlines():
            for part in line.split(" && "):
                part = part.split(" #")[0].strip()
                if part and not part.startswith(("#", "pip install", "pytest")):
                    commands.append(part)
    return commands


@pytest.mark.parametrize("page", PAGES)
def test_every_block_says_its_language(page):
    langs = [lang for lang, _ in FENCE.findall((ROOT / page).read_text())]
    assert langs and all(lang in ("bash", "python", "text") for lang in langs), langs


def _run_python(page: str, where: Path, monkeypatch) -> dict:
    monkeypatch.chdir(where)
    namespace: dict = {"__name__": "__docs__"}
    for i, code in enumerate(blocks(page, "python")):
        exec(compile(code, f"{page} python block {i + 1}", "exec"), namespace)  # noqa: S102 (our own docs)
    return namespace


def test_the_readmes_python_runs_as_written(tmp_path, monkeypatch):
    namespace = _run_python("README.md", tmp_path, monkeypatch)
    assert namespace["logits"].shape[:2] == namespace["ids"].shape
    assert namespace["out"].shape[1] == namespace["ids"].shape[1] + 32
    assert namespace["fast"] is not None


@pytest.mark.slow
def test_the_guides_python_runs_as_written(tmp_path, monkeypatch):
    namespace = _run_python("docs/guide.md", tmp_path, monkeypatch)
    assert (tmp_path / "out" / "tinylm-w4" / "manifest.json").is_file() and (tmp_path / "tinylm.onnx").is_file()
    assert namespace["out"].shape[0] == 2  # the batch block ran last


# the allocator's commands measure every candidate on every layer (minutes): run before a release
RELEASE_ONLY = re.compile(r"--recipe auto(-gguf)?:")


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_the_shell_commands_run_as_written(page, tmp_path):
    """Each command in order in one folder (later ones read what earlier ones wrote)."""
    commands = [c for c in shell_commands(page) if not RELEASE_ONLY.search(c)]
    assert commands, "no command found: the block parser is broken"
    _run_shell(commands, tmp_path)


@pytest.mark.release
def test_the_allocators_shell_commands_run_as_written(tmp_path):
    commands = [c for page in PAGES for c in shell_commands(page) if RELEASE_ONLY.search(c)]
    assert commands
    _run_shell(commands, tmp_path)


def _run_shell(commands: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    for command in commands:
        assert command.split()[0] in ("qcompiler", "python"), command  # nothing else may hide in a block
        done = subprocess.run(
            command,
            shell=True,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env=env,
            timeout=1200,
        )
        assert done.returncode == 0, f"{command}\n{done.stderr[-2000:]}"


def test_the_shell_block_parser_keeps_every_command():
    commands = shell_commands("README.md")
    assert commands == ["python -m qcompiler --model tinylm --recipe gptq-w4g128"]
    assert shutil.which("qcompiler") is not None
