"""The package is a house of floors and every import points down, counting imports inside functions
too: an import up a floor is a design knot (a low room that needs a high one) even when a deferred
import keeps it from crashing, and no circle can form where every edge points down."""

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "qcompiler": "qcompiler",
    "passes": "qcompiler.passes",
    "backends": "qcompiler.backends",
    "kernels": "qcompiler.kernels",
}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, package in PACKAGES.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = [p for p in f.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            mods[".".join([package, *parts])] = f
    return mods


def _imports(name: str, path: Path, mods: dict) -> set[str]:
    """Modules of the package that ``name`` imports anywhere in its source."""
    base = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            pkg = base
            for _ in range(max(node.level - 1, 0)):
                pkg = pkg.rsplit(".", 1)[0]
            module = (f"{pkg}.{node.module}" if node.module else pkg) if node.level else (node.module or "")
            for alias in node.names:  # `from . import x` depends on submodule x, not on the package
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in mods else module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in mods and m != name}


def test_no_module_imports_itself_back():
    mods = _modules()
    graph = nx.DiGraph({name: _imports(name, path, mods) - {"qcompiler"} for name, path in mods.items()})
    assert graph.number_of_edges() > 100, "the import walk found almost no imports: the walker is broken"
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        return
    raise AssertionError("import circle: " + " -> ".join([a for a, _ in cycle] + [cycle[-1][1]]))


# The floors, lowest first: a module may import from its own floor and the floors below, never above.
# One name per room (``qcompiler/NAME/``, or a one-file room ``qcompiler/NAME.py``); "face" is the rest
# of the top: the package itself, compile/load, the CLI, generation, export formats.
FLOORS = [
    {"errors", "version", "data"},  # nothing of qcompiler below them
    {"algorithms", "distributed"},  # pure math on tensors; ranks and collectives
    {"files"},  # atomic writes, regular-file reads, spill, safetensors streaming, shards
    {"ir"},  # graphs, the op registry, layout-free ops, graph properties
    {"layouts"},  # storage layouts: their ops, packing, rewrite, row join, experts stack
    {"kernels"},  # Triton kernels and their plain-torch twins
    {"frontend"},  # capture, lazy weights, causal-LM wrapping
    {"calib"},  # calibration: the engine, data, host memory
    {"pipeline"},  # passes' base, contract, manager, block walk, recipes' registry
    {"passes"},  # the built-in passes and the built-in recipe table
    {"backends"},  # eager, Triton, ONNX Runtime
    {"store"},  # the artifact format
    {"interop"},  # exporters to other runtimes' checkpoints and files
    {"models", "evaluation"},  # bundled models, evaluation and the report page
    {"face"},
]


def _floor_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and any(parts[1] in floor for floor in FLOORS):
        return parts[1]
    return "face"


def test_every_import_points_down_the_floors():
    mods = _modules()
    rank = {room: k for k, floor in enumerate(FLOORS) for room in floor}
    rooms = {_floor_of(m) for m in mods}
    assert rooms == set(rank), f"rooms without a floor or floors without a room: {rooms ^ set(rank)}"
    upward = [
        f"{name} ({_floor_of(name)}) imports {dep} ({_floor_of(dep)})"
        for name, path in sorted(mods.items())
        for dep in sorted(_imports(name, path, mods) - {"qcompiler"})
        if rank[_floor_of(dep)] > rank[_floor_of(name)]
    ]
    assert not upward, "imports up a floor:\n" + "\n".join(upward)


def test_the_floor_check_sees_an_import_up_a_floor(tmp_path):
    """The walker finds a deferred import inside a function (what a knot hides behind)."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from qcompiler.pipeline.pass_base import Pass\n")
    mods = {"qcompiler.ir.probe": probe, "qcompiler.pipeline.pass_base": probe}
    found = _imports("qcompiler.ir.probe", probe, mods)
    assert found == {"qcompiler.pipeline.pass_base"}
    assert _floor_of("qcompiler.ir.probe") == "ir" and _floor_of("qcompiler.pipeline.pass_base") == "pipeline"


def test_import_paths_from_before_the_rooms_name_the_same_modules():
    import importlib

    import qcompiler

    for old, new in qcompiler.MOVED_MODULES.items():
        assert importlib.import_module(f"qcompiler.{old}") is importlib.import_module(new), old
    from qcompiler.graph import find_linears, set_tensor  # what user passes written before the move import
    from qcompiler.weight_only import quantize_block_linears

    assert callable(find_linears) and callable(set_tensor) and callable(quantize_block_linears)


def test_the_package_is_grouped_into_rooms():
    """The flat qcompiler/ folder is gone: what is left at the top is the face and the one-file rooms."""
    top = sorted(f.stem for f in (ROOT / "qcompiler").glob("*.py"))
    assert top == [
        "__init__",
        "__main__",
        "checkpoint_import",
        "compile_options",
        "compiler",
        "data",
        "errors",
        "export_formats",
        "generation",
        "version",
    ], top


def test_no_script_shadows_an_installed_module():
    """``python benchmarks/x.py`` puts benchmarks/ first on sys.path: a script named like an installed
    module (transformers imports the ``kernels`` package) would be imported in its place."""
    import importlib.machinery
    import sys

    # the installed world only: a test that ran a benchmark in this process may have put its folder on
    # sys.path (gpu_decode.py imports decode_clock beside it), which must not read as an installed module
    ours = {(ROOT / folder).resolve() for folder in ("benchmarks", "scripts")}
    installed = [p for p in sys.path if Path(p or ".").resolve() not in ours]
    for folder in ("benchmarks", "scripts"):
        for f in (ROOT / folder).glob("*.py"):
            assert f.stem not in sys.stdlib_module_names, f"{folder}/{f.name} shadows the standard library"
            found = importlib.machinery.PathFinder.find_spec(f.stem, installed)
            assert found is None, f"{folder}/{f.name} shadows the installed {f.stem!r}"


def test_the_checkout_root_on_sys_path_does_not_hide_the_installed_kernels_package():
    """``python -m qcompiler`` from a clone (the README's first line) puts the root first on sys.path,
    where the ``kernels/`` folder would stand in for the Hugging Face ``kernels`` transformers imports."""
    import importlib.metadata
    import subprocess
    import sys

    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the Hugging Face kernels package is not installed (the next test covers that case)")
    code = "import kernels, qcompiler.kernels as ours; print(kernels.__file__); print(ours.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    theirs, ours = out.stdout.split()
    # ours comes from whichever checkout the editable install maps (this one in CI)
    assert Path(ours).parts[-2:] == ("kernels", "__init__.py")
    assert not Path(theirs).is_relative_to(ROOT) and Path(theirs) != Path(ours), theirs


def test_without_the_kernels_package_the_checkout_folder_reads_as_not_installed(monkeypatch):
    """Where Hugging Face ``kernels`` is not installed (transformers < 5.25 on a GPU image), importing
    the top-level name from a checkout yields an empty namespace package, which transformers' check
    (``find_spec``, then import and read ``__version__`` / ``__file__``) reports as absent, instead of
    our Triton kernels or an ImportError inside ``import transformers`` (seen on the H200 image)."""
    import runpy
    import sys

    monkeypatch.setattr(sys, "path", [str(ROOT)])  # nothing installed elsewhere
    stand_in = runpy.run_path(str(ROOT / "kernels" / "__init__.py"), run_name="kernels")["_installed"]
    assert getattr(stand_in, "__file__", None) is None and getattr(stand_in, "__version__", None) is None
    assert not hasattr(stand_in, "layout_linear")  # never our kernels under the other package's name
    assert stand_in.__spec__.origin is None and list(stand_in.__path__) == []
