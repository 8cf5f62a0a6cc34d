"""Every repository path the README and docs name exists: docs cite the project's own files."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOTS = (
    "qcompiler/",
    "passes/",
    "backends/",
    "kernels/",
    "tests/",
    "docs/",
    "benchmarks/",
    "scripts/",
    "examples/",
    ".ci/",
)
PATH = re.compile(r"(?<![\w./-])((?:%s)[\w./-]*[\w/])" % "|".join(re.escape(r) for r in ROOTS))
# Files the docs name that a run writes rather than the repo holds, and why.
OUTPUTS = {
    "benchmarks/results/quick/": "git-ignored output folder of --quick benchmark runs",
    "benchmarks/results/kernels.json": "written by benchmarks/kernel_speed.py on a GPU (scripts/gpu_check.sh)",
}
LINK = re.compile(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)")


def _docs():
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _cited(text: str):
    for match in PATH.finditer(text):
        path = match.group(1).rstrip(".")
        if "*" in path or "{" in path or "NAME" in path:
            continue
        yield path


def test_every_path_a_doc_names_exists():
    missing = []
    for doc in _docs():
        text = doc.read_text()
        for path in _cited(text):
            if not (ROOT / path).exists() and path not in OUTPUTS:
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
        for link in LINK.findall(text):
            if not link.startswith(("http", "mailto")) and not (doc.parent / link).exists():
                missing.append(f"{doc.relative_to(ROOT)}: link {link}")
    assert not missing, "docs name files that are not in the repo:\n" + "\n".join(missing)


def test_the_check_sees_paths():
    assert list(_cited("see `qcompiler/ir/ops.py`, docs/guide.md and tests/x_test.py.")) == [
        "qcompiler/ir/ops.py",
        "docs/guide.md",
        "tests/x_test.py",
    ]
    assert sum(1 for doc in _docs() for _ in _cited(doc.read_text())) > 50


def test_architecture_md_draws_every_room_and_its_files():
    """docs/architecture.md's table has a row per qcompiler/ sub-package naming each of its modules."""
    rows, folder = {}, None
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        if line.startswith("| `qcompiler/"):
            folder = line.split(" | ")[0].strip("| `").split("`")[0]
        elif not (line.startswith("|  |") and folder):
            folder = None
        if folder:
            rows.setdefault(folder, []).append(line)
    missing = []
    for package in sorted(p for p in (ROOT / "qcompiler").iterdir() if (p / "__init__.py").exists()):
        text = " ".join(rows.get(f"qcompiler/{package.name}/", []))
        if not text:
            missing.append(f"qcompiler/{package.name}/ has no row")
            continue
        if package.name in ("interop", "models"):
            continue  # described as a whole
        missing += [
            f"{f.relative_to(ROOT)}"
            for f in package.glob("*.py")
            if f.name != "__init__.py" and f"`{f.name}`" not in text
        ]
    assert not missing, "docs/architecture.md does not draw: " + ", ".join(missing)


def test_architecture_md_lists_what_each_built_in_pass_provides():
    import re

    import qcompiler as qc
    from qcompiler.pipeline.pass_base import Pass

    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Graph properties", 1)[1].split("\n## ", 1)[0]
    listed = dict(re.findall(r"^- `(\w+)`: (.+)$", section, flags=re.M))

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    built_in = {c for c in subclasses(Pass) if c.__module__.startswith("qcompiler.passes.")}
    for prop in qc.GraphProperty:
        providers = sorted(c.__name__ for c in built_in if prop in getattr(c, "provides", ()))
        if prop is qc.GraphProperty.CAPTURED:
            assert listed.get(prop.name) == "every captured graph"
        else:
            assert listed.get(prop.name) == ", ".join(providers), prop.name
