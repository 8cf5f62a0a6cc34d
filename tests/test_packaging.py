"""The built wheel carries every package and the bundled weights: an editable install finds a
missing package in the checkout, so only the wheel itself can say what a user who installs a
release gets (.ci/wheel-check then installs it into an isolated venv and imports every module)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the design card's top-level folders, shipped as qcompiler's subpackages
FOLDER_TO_PACKAGE = {"qcompiler": "qcompiler", "passes": "qcompiler/passes", "kernels": "qcompiler/kernels"}
FOLDER_TO_PACKAGE["backends"] = "qcompiler/backends"


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("qcompiler-*.whl")
    return set(zipfile.ZipFile(wheel).namelist())


def test_every_package_folder_ships_in_the_wheel(wheel_names):
    on_disk = {
        FOLDER_TO_PACKAGE[init.relative_to(ROOT).parts[0]] + "/" + "/".join(init.relative_to(ROOT).parts[1:])
        for folder in FOLDER_TO_PACKAGE
        for init in (ROOT / folder).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert "qcompiler/distributed/__init__.py" in on_disk and len(on_disk) >= 14
    assert on_disk - wheel_names == set()


def test_every_module_ships_beside_its_package(wheel_names):
    modules = {
        FOLDER_TO_PACKAGE[path.relative_to(ROOT).parts[0]] + "/" + "/".join(path.relative_to(ROOT).parts[1:])
        for folder in FOLDER_TO_PACKAGE
        for path in (ROOT / folder).rglob("*.py")
        if (path.parent / "__init__.py").is_file() and "__pycache__" not in path.parts
    }
    assert modules - wheel_names == set()


def test_the_bundled_models_weights_ship_in_the_wheel(wheel_names):
    for name in ("tinylm", "longlm"):
        assert {f"qcompiler/models/{name}/model.safetensors", f"qcompiler/models/{name}/config.json"} <= wheel_names


def test_the_console_scripts_entry_module_ships(wheel_names):
    assert "qcompiler_launch.py" in wheel_names


def test_the_wheel_version_is_the_packages_own(wheel_names):
    from qcompiler.version import __version__

    assert any(n == f"qcompiler-{__version__}.dist-info/METADATA" for n in wheel_names)
