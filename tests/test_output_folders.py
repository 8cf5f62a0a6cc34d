"""Writers never delete what qcompiler did not write, and a failure at any point keeps the old output."""

import errno
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from tiny_models import example_inputs, main_output, make_model

import qcompiler as qc
from qcompiler.cli import main
from qcompiler.files.atomic import MARKER, OutputPathError, write_text_atomically
from qcompiler.interop import export_compressed_tensors, export_gptq


@pytest.fixture(scope="module")
def cm():
    return qc.compile(make_model("llama"), example_inputs("llama"), recipe="rtn-w4g128", progress=False)


def _victim(tmp_path) -> Path:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("thesis")
    return victim


def _writers(cm):
    return {
        "save": lambda p, **kw: cm.save(p, **kw),
        "gptq": lambda p, **kw: export_gptq(cm, p, progress=lambda _: None, **kw),
        "compressed-tensors": lambda p, **kw: export_compressed_tensors(cm, p, progress=lambda _: None, **kw),
    }


@pytest.mark.parametrize("writer", ["save", "gptq", "compressed-tensors"])
def test_a_folder_of_user_files_is_never_replaced(writer, cm, tmp_path):
    write = _writers(cm)[writer]
    victim = _victim(tmp_path)
    for overwrite in (False, True):  # --overwrite is no licence to delete a user's files
        with pytest.raises(OutputPathError, match=r"refusing to replace .*victim.*precious.txt"):
            write(victim, overwrite=overwrite)
    assert (victim / "precious.txt").read_text() == "thesis"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim"]  # no temporary folder left
    write(tmp_path / "fresh")  # a new folder: written
    write(tmp_path / "fresh")  # its own earlier output: replaced
    marker = json.loads((tmp_path / "fresh" / MARKER).read_text())
    assert marker["kind"] in ("artifact", writer)
    assert set(marker["files"]) == {p.name for p in (tmp_path / "fresh").iterdir()} - {MARKER}


def test_a_file_added_to_an_earlier_output_survives(cm, tmp_path):
    cm.save(tmp_path / "art")
    (tmp_path / "art" / "notes.txt").write_text("mine")
    (tmp_path / "art" / "plots").mkdir()
    for overwrite in (False, True):
        with pytest.raises(OutputPathError, match=r"did not write \(notes.txt, plots\)"):
            cm.save(tmp_path / "art", overwrite=overwrite)
    assert (tmp_path / "art" / "notes.txt").read_text() == "mine"
    qc.load(tmp_path / "art")


def test_a_marker_without_a_file_list_owns_nothing_but_itself(cm, tmp_path):
    """A hand-made or old marker never makes a user's file ours: the folder is refused, the file stays."""
    folder = tmp_path / "art"
    folder.mkdir()
    (folder / MARKER).write_text(json.dumps({"kind": "artifact"}))
    (folder / "thesis.tex").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(OutputPathError, match=r"did not write \(thesis.tex\)"):
            cm.save(folder, overwrite=overwrite)
    assert (folder / "thesis.tex").read_text() == "mine"
    (folder / "thesis.tex").unlink()  # the marker alone: replaced
    cm.save(folder)
    assert "files" in json.loads((folder / MARKER).read_text())


@pytest.mark.parametrize("writer", ["folder", "file"])
def test_a_path_under_a_file_is_refused_before_any_work(writer, cm, tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OutputPathError, match=r"it lies under .*afile, which is a file"):
        if writer == "folder":
            cm.save(tmp_path / "afile" / "sub")
        else:
            cm.export_onnx(tmp_path / "afile" / "sub" / "m.onnx")
    assert (tmp_path / "afile").read_text() == "x"


def test_the_system_temp_folder_itself_is_never_the_target(monkeypatch):
    from qcompiler.files import atomic

    assert atomic._system_folder(Path("/var/tmp")) == "/var"  # the folder itself: a system folder
    assert atomic._system_folder(Path("/var/tmp/out")) is None  # a new folder inside it: allowed
    with pytest.raises(OutputPathError, match="system folder /var"):
        atomic.check_output_folder("/var/tmp", "artifact", overwrite=True)


def test_outputs_of_another_kind_are_not_replaced(cm, tmp_path):
    export_gptq(cm, tmp_path / "ckpt", progress=lambda _: None)
    with pytest.raises(OutputPathError, match="holds a qcompiler gptq output"):
        cm.save(tmp_path / "ckpt")
    cm.save(tmp_path / "ckpt", overwrite=True)  # another kind of qcompiler output: with consent
    assert qc.load(tmp_path / "ckpt").recipe.name == cm.recipe.name


def test_onnx_export_never_replaces_a_foreign_file(cm, tmp_path):
    thesis = tmp_path / "thesis.onnx"
    thesis.write_text("my thesis")
    with pytest.raises(OutputPathError, match="ONNX writer did not write it"):
        cm.export_onnx(thesis)
    assert thesis.read_text() == "my thesis"
    with pytest.raises(OutputPathError, match="it is a folder"):
        cm.export_onnx(_victim(tmp_path))


@pytest.mark.parametrize("where", [".", "..", "cwd", "cwd-parent", "home", "root", "source"])
def test_dangerous_targets_are_refused_even_with_overwrite(where, cm, tmp_path, monkeypatch):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    (work / "keep.txt").write_text("x")
    monkeypatch.chdir(work)
    target = {
        ".": Path("."),
        "..": Path(".."),
        "cwd": work,
        "cwd-parent": tmp_path / "a",
        "home": Path.home(),
        "root": Path("/"),
        "source": tmp_path / "model",
    }[where]
    if where == "source":
        target.mkdir()
    with pytest.raises(OutputPathError, match="refusing to write"):
        cm.save(target, overwrite=True, protect=[tmp_path / "model"])
    assert (work / "keep.txt").exists()


def test_cli_refuses_user_folders_and_the_input_model_before_any_work(tmp_path, capsys, monkeypatch):
    import qcompiler.models

    loads = []
    monkeypatch.setattr(qcompiler.models, "load", lambda *a, **k: loads.append(a) or pytest.fail("model loaded"))
    victim = _victim(tmp_path)
    assert main(["quantize", "bundled:tinylm", "--out", str(victim)]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: refusing to replace") and "\n" not in line
    assert loads == []  # refused before the model was read
    model = tmp_path / "mymodel"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert main(["quantize", str(model), "--out", str(model)]) == 2
    assert "refusing to write" in capsys.readouterr().err and (model / "config.json").exists()
    assert (victim / "precious.txt").read_text() == "thesis"


def _dead_pid() -> str:
    return subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()


def test_stale_temporary_folders_of_killed_writers_are_removed(cm, tmp_path):
    stale = tmp_path / f".art.qc-{_dead_pid()}-x1.tmp"
    stale.mkdir()
    (stale / "half.bin").write_bytes(b"0" * 100)
    cm.save(tmp_path / "art")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


@pytest.mark.slow
def test_stale_temporaries_of_killed_file_writers_are_removed(cm, tmp_path):
    """A killed ONNX export (a temporary folder) or JSON write (a temporary file) is cleaned by the next one."""
    pid = _dead_pid()
    (tmp_path / f".m.onnx.qc-{pid}-ab12.tmp").mkdir()
    (tmp_path / f".m.onnx.qc-{pid}-ab12.tmp" / "m.onnx").write_bytes(b"half")
    (tmp_path / f".f.json.qc-{pid}-cd34.tmp").write_text("{")
    (tmp_path / f".m.onnx.qc-{os.getpid()}-live.tmp").mkdir()  # a running writer's: kept
    cm.export_onnx(tmp_path / "m.onnx")
    write_text_atomically(tmp_path / "f.json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".m.onnx.qc-{os.getpid()}-live.tmp", "f.json", "m.onnx"]
    cm.export_onnx(tmp_path / "m.onnx")  # its own earlier export: replaced


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_a_failing_disk_keeps_the_previous_artifact(code, cm, tmp_path, monkeypatch, capsys):
    import qcompiler.store.artifact as artifact

    cm.save(tmp_path / "art")
    before = (tmp_path / "art" / "manifest.json").read_bytes()

    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code), "tensors.safetensors")

    monkeypatch.setattr(artifact, "write_streamed", fail)  # the weights' write fails
    with pytest.raises(OSError):
        cm.save(tmp_path / "art")
    assert (tmp_path / "art" / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    qc.load(tmp_path / "art")


def test_ctrl_c_exits_130_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(qc, "compile", interrupted)
    assert main(["quantize", "bundled:tinylm", "--recipe", "rtn-w4g128", "--out", str(tmp_path / "o")]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


_SAVER = """
import sys, qcompiler as qc
cm = qc.load(sys.argv[1])
print("ready", flush=True)
while True:
    cm.save(sys.argv[1])
"""


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_kill_9_at_random_points_keeps_a_loadable_artifact(seed, cm, tmp_path):
    art = tmp_path / "art"
    cm.save(art)
    proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(art)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(random.Random(seed).uniform(0.05, 1.0))
    finally:
        proc.kill()
        proc.wait()
    inputs = example_inputs("llama", batch=1, seq=5, seed=3)
    assert main_output(qc.load(art)(**inputs)).equal(main_output(cm(**inputs)))
    cm.save(art)  # the next write cleans up after the killed one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_a_reader_never_sees_a_mix_of_two_artifacts(tmp_path):
    """Two artifacts (4-bit and 3-bit) saved in turn while another thread loads: every load's
    recipe (manifest) agrees with its graph's bit width (graph.json)."""
    a = qc.compile(make_model("llama"), example_inputs("llama"), recipe="rtn-w4g128", progress=False)
    b = qc.compile(make_model("llama"), example_inputs("llama"), recipe="rtn-w3g128", progress=False)
    art = tmp_path / "art"
    a.save(art)
    stop, mixed = threading.Event(), []

    def writer():
        while not stop.is_set():
            for cm in (b, a):
                cm.save(art)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(15):
            loaded = qc.load(art)
            graph_bits = {
                n.args[6] for n in loaded.graph_module.graph.nodes if n.target == torch.ops.qc.quant_linear.default
            }
            if graph_bits != {loaded.recipe.passes[0].bits}:
                mixed.append((loaded.recipe.name, graph_bits))
    finally:
        stop.set()
        thread.join()
    assert not mixed


def test_a_full_disk_names_the_output_in_one_line(tmp_path, monkeypatch, capsys):
    """safetensors raises ENOSPC without a file name; the CLI's line still says where (exit 1)."""
    import qcompiler.store.artifact as artifact

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(artifact, "save_file", full)
    out = tmp_path / "o"
    assert main(["quantize", "bundled:tinylm", "--recipe", "rtn-w4g128", "--samples", "2", "--out", str(out)]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: No space left on device: {out}"
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_while_the_command_still_imports_is_one_line_and_130(monkeypatch, capsys):
    """The console script's first lines (qcompiler_launch.py) catch a Ctrl-C that lands while torch
    and the package are still importing: no traceback."""
    import qcompiler_launch

    class InterruptedImport:
        def find_spec(self, name, path=None, target=None):
            if name == "qcompiler.cli":
                raise KeyboardInterrupt

    monkeypatch.delitem(sys.modules, "qcompiler.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [InterruptedImport(), *sys.meta_path])
    assert qcompiler_launch.main() == 130
    assert capsys.readouterr().err == "error: interrupted; no partial output was left\n"
