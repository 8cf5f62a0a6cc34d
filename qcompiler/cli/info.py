"""``qcompiler inspect``, ``recipes`` and ``report``: what an artifact holds, what a recipe does,
and a page of plots — every string from a file escaped before it is shown."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from qcompiler.cli.common import layer_table, out, say
from qcompiler.pipeline.heartbeat import heartbeat
from qcompiler.store.escaping import printable


def inspect(artifact: Path = typer.Argument(..., help="artifact folder")):
    """Passes applied with their settings, per-layer figures and a graph summary."""
    from qcompiler.ir.model_size import ModelSize
    from qcompiler.store.artifact import read_manifest, report_from_manifest

    manifest = read_manifest(artifact)
    recipe = manifest["recipe"]

    def show(line: str) -> None:  # every manifest string is untrusted: one line, nothing the terminal obeys
        out.print(printable(line, newlines=False))

    show(
        f"{artifact}: {manifest['capture']['model_class']} from "
        f"{manifest['metadata'].get('source', '?')}, recipe {recipe['name']} "
        f"(qcompiler {manifest['versions']['qcompiler']}, torch {manifest['versions']['torch']})"
    )
    for p in recipe["passes"]:
        settings = ", ".join(f"{k}={v}" for k, v in p.items() if k not in ("pass", "config_version"))
        show(f"  {p['pass']}({settings}) [config version {p.get('config_version', 1)}]")
    graph = manifest["graph"]
    show(
        f"graph: {graph['nodes']} nodes, {graph['tensors']} stored tensors, qc ops: "
        + ", ".join(f"{k} x{v}" for k, v in graph["qc_ops"].items())
    )
    size = ModelSize.from_counts(graph.get("size"))
    show(
        f"model size: {size.describe()}" if size else "model size: not recorded (an artifact written before sizes were)"
    )
    out.print(layer_table(report_from_manifest(manifest), "per-layer report"))


def recipes(
    recipe: Optional[str] = typer.Argument(None, help="a recipe name or .yaml/.toml file: show its passes"),
    model: Optional[str] = typer.Option(
        None, help="with RECIPE: list the layers of this model each pass quantizes and each ignore pattern keeps"
    ),
):
    """The built-in recipes; with RECIPE, its passes and every setting they resolve to."""
    import qcompiler as qc
    from qcompiler.pipeline.recipe_files import resolve_recipe

    if recipe is None:
        if model is not None:
            raise typer.BadParameter("--model needs a RECIPE to match against")
        table = Table(title="built-in recipes ('qcompiler recipes NAME' shows one's passes; files: docs/recipes.md)")
        table.add_column("name")
        table.add_column("description")
        for r in qc.list_recipes():
            table.add_row(r.name, r.description)
        out.print(table)
        return
    resolved = resolve_recipe(recipe)
    out.print(f"{resolved.name}: {resolved.description}" if resolved.description else resolved.name)
    for i, p in enumerate(resolved.passes, 1):
        out.print(f"  {i}. {p!r}")
    if model is not None:
        _show_matches(resolved, model)


def _show_matches(resolved, model: str) -> None:
    """Which linear layers of ``model`` each pass of ``resolved`` keeps by its ``ignore`` patterns
    (the model's module tree is built without reading weights)."""
    import torch

    from qcompiler.models import load
    from qcompiler.pipeline.layer_filter import matching_pattern

    with heartbeat(say, f"reading {model}'s layers (no weights)"):
        loaded = load(model, stream=True)
    linears = [n for n, m in loaded.model.named_modules() if isinstance(m, torch.nn.Linear)]
    for i, p in enumerate(resolved.passes, 1):
        patterns = tuple(getattr(p, "ignore", ()))
        kept = [n for n in linears if matching_pattern(n, patterns)]
        out.print(f"pass {i} ({type(p).__name__}): {len(linears)} linear layers, {len(kept)} kept by ignore")
        for pattern in patterns:
            hit = [n for n in linears if matching_pattern(n, (pattern,))]
            shown = ", ".join(hit[:6]) + (", ..." if len(hit) > 6 else "")
            out.print(f"  ignore {pattern!r}: " + (f"{len(hit)} layers ({shown})" if hit else "matches nothing"))


def report(
    artifact: Path = typer.Argument(..., help="artifact folder"),
    dest: Path = typer.Option(..., "--out", help="folder for report.md and its PNG plots"),
    overwrite: bool = typer.Option(False, help="replace --out when it holds another kind of qcompiler output"),
):
    """A markdown page with plots: per-layer error, bits per layer, SpQR outliers, SmoothQuant scales."""
    from qcompiler.evaluation.report_page import write_report

    page = write_report(artifact, dest, overwrite=overwrite)
    out.print(f"wrote {page}")
