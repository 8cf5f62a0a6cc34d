"""Resuming a killed run from its recorded blocks: the tensors equal an uninterrupted run's, a run
with another model, recipe or calibration is refused naming what changed, and the progress folder
goes once the run is complete."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import qcompiler as qc
from qcompiler import models
from qcompiler.pipeline import block_walk as weight_only
from qcompiler.pipeline.run_checkpoint import ProgressError, RunCheckpoint


@pytest.fixture(scope="module")
def tinylm():
    loaded = models.load("tinylm")
    return loaded, loaded.calibration(8)


def _compile(tinylm, recipe="gptq-w4g128", **kw):
    loaded, cal = tinylm
    return qc.compile(loaded.model, loaded.example_inputs(), recipe=recipe, calibration=cal, progress=False, **kw)


def _figures(cm) -> dict:
    return {path: {k: v for k, v in f.items() if k != "seconds"} for path, f in cm.report.passes[0].layers.items()}


def _crash_after(monkeypatch, blocks: int) -> None:
    """The run dies (as from kill -9, without unwinding anything of ours) when block ``blocks + 1`` starts."""
    solve, count = weight_only._solve_block, [0]

    def dying(*args, **kwargs):
        if count[0] == blocks:
            raise SystemExit("killed")
        count[0] += 1
        return solve(*args, **kwargs)

    monkeypatch.setattr(weight_only, "_solve_block", dying)


@pytest.mark.parametrize("recipe", ["gptq-w4g128", pytest.param("spqr-w3g16", marks=pytest.mark.slow)])
def test_a_resumed_run_equals_an_uninterrupted_one(tinylm, tmp_path, monkeypatch, recipe):
    """Two of four blocks recorded, the run dies; the resumed run replays them and solves the rest:
    every tensor, the graph's report figures and notes equal an uninterrupted run's (blocks 3 and 4,
    solved afresh, show two runs give the same bits; with -m slow a second clean run checks it too)."""
    clean = _compile(tinylm, recipe)
    again = _compile(tinylm, recipe) if recipe != "gptq-w4g128" else clean
    progress = tmp_path / "progress"
    with monkeypatch.context() as m:
        _crash_after(m, 2)
        with pytest.raises(SystemExit):
            _compile(tinylm, recipe, checkpoint=progress)
    assert sorted(f.name for f in progress.iterdir()) == [
        "pass0-block0.safetensors",
        "pass0-block1.safetensors",
        "progress.json",
    ]
    resumed = _compile(tinylm, recipe, checkpoint=progress, resume=True)
    states = [cm.graph_module.state_dict() for cm in (clean, again, resumed)]
    for state in states[1:]:
        assert state.keys() == states[0].keys()
        assert all(torch.equal(state[k], states[0][k]) for k in state)
    assert str(resumed.graph_module.graph) == str(clean.graph_module.graph)
    assert _figures(resumed) == _figures(clean)
    assert resumed.report.passes[0].notes == clean.report.passes[0].notes
    assert not progress.exists()


def test_progress_of_another_run_is_refused_naming_what_changed(tinylm, tmp_path, monkeypatch):
    progress = tmp_path / "progress"
    with monkeypatch.context() as m:
        _crash_after(m, 1)
        with pytest.raises(SystemExit):
            _compile(tinylm, checkpoint=progress)
    loaded, cal = tinylm
    with pytest.raises(ProgressError, match=r"different calibration: it cannot be resumed"):
        qc.compile(
            loaded.model,
            loaded.example_inputs(),
            recipe="gptq-w4g128",
            calibration=[{"input_ids": cal[0]["input_ids"][:-1]}],
            progress=False,
            checkpoint=progress,
            resume=True,
        )
    with pytest.raises(ProgressError, match=r"different recipe: it cannot be resumed"):
        _compile(tinylm, "gptq-w3g128", checkpoint=progress, resume=True)
    with pytest.raises(ProgressError, match=r"holds the progress of an unfinished run: --resume continues it"):
        _compile(tinylm, checkpoint=progress)
    assert (progress / "pass0-block0.safetensors").exists()  # nothing of it was lost


def test_a_progress_folder_is_never_one_with_other_files_and_only_its_own_files_are_removed(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ProgressError, match="is not empty and holds no run progress"):
        RunCheckpoint(tmp_path, {"model": 1}, resume=True)
    folder = tmp_path / "p"
    RunCheckpoint(folder, {"model": 1}, resume=False)
    (folder / "keep.txt").write_text("someone else's")
    with pytest.raises(ProgressError, match=r"different model"):
        RunCheckpoint(folder, {"model": 2}, resume=True)
    RunCheckpoint(folder, {"model": 1}, resume=True).remove()
    assert sorted(f.name for f in folder.iterdir()) == ["keep.txt"]


@pytest.mark.slow
def test_kill_9_at_three_seeded_points_then_resume_gives_the_clean_runs_tensors(tmp_path):
    """The CLI killed with SIGKILL somewhere after a seeded number of blocks (or during the save);
    ``--resume`` finishes with tensors bit-identical to a clean run's."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "qcompiler", "quantize", "bundled:tinylm", "--samples", "16"]
    subprocess.run([*base, "--out", str(tmp_path / "clean")], env=env, check=True, capture_output=True)
    clean = load_file(str(tmp_path / "clean" / "tensors.safetensors"))
    rng = random.Random(0)
    for point in range(3):
        out, progress = tmp_path / f"out{point}", tmp_path / f"progress{point}"
        blocks = rng.randint(1, 4)  # 4: the run is past its last block (rewrite or save)
        proc = subprocess.Popen(
            [*base, "--checkpoint", str(progress), "--out", str(out)], env=env, stderr=subprocess.PIPE, text=True
        )
        seen = 0
        for line in proc.stderr:
            seen += " block " in line and "/4 " in line
            if seen == blocks:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if out.exists():  # the kill came after the save: nothing to resume
            continue
        assert json.loads((progress / "progress.json").read_text())["recipe"]
        subprocess.run(
            [*base, "--checkpoint", str(progress), "--resume", "--out", str(out)],
            env=env,
            check=True,
            capture_output=True,
        )
        resumed = load_file(str(out / "tensors.safetensors"))
        assert resumed.keys() == clean.keys() and all(torch.equal(resumed[k], clean[k]) for k in clean), point
        assert not progress.exists()
