"""The package list, found on disk so no package can be left out of the wheel.

``qcompiler/`` holds the core; ``passes/``, ``kernels/`` and ``backends/`` sit at the top level (the
design card's layout) and import as ``qcompiler.passes`` etc. Auto-discovery cannot rename a folder,
so this walks each root for ``__init__.py`` and maps every package found to its folder explicitly
(what editable installs need); everything else lives in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {
    "qcompiler": "qcompiler",
    "qcompiler.passes": "passes",
    "qcompiler.kernels": "kernels",
    "qcompiler.backends": "backends",
}


def _packages() -> dict[str, str]:
    """``{package name: folder}`` for every folder with an ``__init__.py`` under the roots."""
    here = Path(__file__).parent
    found = {}
    for name, folder in ROOTS.items():
        for init in sorted((here / folder).rglob("__init__.py")):
            parts = init.parent.relative_to(here / folder).parts
            if "__pycache__" not in parts:
                found[".".join((name, *parts))] = "/".join((folder, *parts))
    return found


packages = _packages()
# qcompiler_launch: the console script's entry, a module of its own so Ctrl-C while torch imports ends cleanly
setup(packages=list(packages), package_dir=packages, py_modules=["qcompiler_launch"])
