"""``qcompiler report``: one markdown page with PNG plots that show which layers hurt.

Plots (each only when the artifact has the data): relative output error per layer, stored bits
per weight per layer, SpQR's outlier positions as a heat map (layers × input-column bins, from the
stored CSR column indices), and SmoothQuant's per-channel activation maxima before and after
smoothing (``max|x_j|`` and ``max|x_j| / s_j``) for a few producer groups.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from qcompiler.files.atomic import publish_directory
from qcompiler.store.artifact import read_manifest, role_files
from qcompiler.store.escaping import markdown_code, markdown_text, printable

__all__ = ["write_report"]

md, code = markdown_text, markdown_code  # every string from the manifest goes through one of them


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _per_layer(manifest: dict, key: str) -> dict[str, float]:
    values = {}
    for p in manifest["report"]["passes"]:
        for layer, figures in p["layers"].items():
            if isinstance(figures.get(key), (int, float)) and not isinstance(figures.get(key), bool):
                values[layer] = float(figures[key])
    return values


def _label(name: str) -> str:
    """A manifest name as plot text: control characters escaped, ``$`` literal (never mathtext)."""
    return printable(str(name), newlines=False).replace("$", r"\$")


def _bar(values: dict[str, float], title: str, ylabel: str, path: Path, log: bool = False) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 0.22 * len(values)), 3.6))
    ax.bar(range(len(values)), list(values.values()), color="#3b6ea5")
    ax.set_xticks(
        range(len(values)),
        [_label(k.replace("model.", "").replace("encoder.", "")) for k in values],
        rotation=90,
        fontsize=6,
    )
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _outlier_heatmap(artifact: Path, manifest: dict, path: Path, bins: int = 64) -> bool:
    graph = json.loads((artifact / manifest["files"]["graph"]).read_text())
    col_targets = [n["target"] for n in graph["nodes"] if n["op"] == "get_attr" and n["target"].endswith(".col_idx")]
    if not col_targets:
        return False
    stored = lambda target: graph["aliases"].get(target, target)  # noqa: E731  (tied tensors are stored once)
    rows = []
    with contextlib.ExitStack() as stack:  # only what is plotted is read
        files = [
            stack.enter_context(safe_open(str(artifact / name), framework="pt"))
            for name in role_files(manifest, "tensors")
        ]
        holder = {key: f for f in files for key in f.keys()}
        for t in col_targets:
            perm, col = stored(t.replace(".col_idx", ".perm")), stored(t)
            width = holder[perm].get_slice(perm).get_shape()[0]
            cols = holder[col].get_tensor(col).float()
            rows.append(torch.histc((cols + 0.5) / width, bins=bins, min=0, max=1))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, max(3, 0.16 * len(rows))))
    image = ax.imshow(torch.stack(rows).numpy(), aspect="auto", cmap="magma", interpolation="nearest")
    ax.set_yticks(range(len(rows)), [t.rsplit(".", 1)[0].replace("model.", "") for t in col_targets], fontsize=6)
    ax.set_xlabel(f"input column (fraction of in_features, {bins} bins)")
    ax.set_title("SpQR outliers per layer and input column")
    fig.colorbar(image, ax=ax, label="outliers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _smoothing_plot(manifest: dict, path: Path, groups: int = 3) -> bool:
    entries = [
        (layer, f)
        for p in manifest["report"]["passes"]
        if p["name"] == "SmoothQuant"
        for layer, f in p["layers"].items()
        if "channel_absmax" in f
    ]
    if not entries:
        return False
    picks = [entries[i] for i in sorted({0, len(entries) // 2, len(entries) - 1})][:groups]
    plt = _plt()
    fig, axes = plt.subplots(len(picks), 1, figsize=(8, 2.6 * len(picks)), squeeze=False)
    for ax, (layer, f) in zip(axes[:, 0], picks):
        before = torch.tensor(f["channel_absmax"])
        after = before / torch.tensor(f["channel_scale"])
        ax.plot(before.numpy(), lw=0.7, label="before: max|x_j|")
        ax.plot(after.numpy(), lw=0.7, label="after: max|x_j| / s_j")
        ax.set_yscale("log")
        ax.set_title(f"{_label(layer)} (alpha {float(f['alpha']):.2f})", fontsize=8)
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("channel")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(artifact, out_dir, *, overwrite: bool = False) -> Path:
    """Write ``report.md`` and its PNGs as the folder ``out_dir`` (published atomically, only over an
    earlier report unless ``overwrite``); returns the page's path."""
    artifact, final = Path(artifact), Path(out_dir)
    manifest = read_manifest(artifact)
    with publish_directory(final, "report", overwrite=overwrite, protect=[artifact]) as out_dir:
        _write_page(artifact, manifest, out_dir)
    return final / "report.md"


def _write_page(artifact: Path, manifest: dict, out_dir: Path) -> None:
    recipe = manifest["recipe"]
    lines = [
        f"# qcompiler report: {md(artifact.name)}",
        "",
        f"Model {md(manifest['capture']['model_class'])} from {md(manifest['metadata'].get('source', '?'))}, "
        f"recipe **{md(recipe['name'])}** ({md(recipe.get('description', ''))}).",
        "",
    ]
    for p in manifest["report"]["passes"]:
        lines.append(
            f"- {md(p['name'])}: {float(p['seconds']):.1f} s, {len(p['layers'])} layers"
            + "".join(f"\n  - note: {md(n)}" for n in p["notes"])
        )
    lines.append("")
    errors = _per_layer(manifest, "rel_error")
    if errors:
        _bar(
            errors,
            "relative output error per layer (lower is better)",
            "||ΔY|| / ||Y||",
            out_dir / "error.png",
            log=True,
        )
        worst = sorted(errors.items(), key=lambda kv: -kv[1])[:5]
        lines += [
            "## Per-layer error",
            "",
            "![error](error.png)",
            "",
            "Worst layers: " + ", ".join(f"{code(k)} {v:.3g}" for k, v in worst) + ".",
            "",
        ]
    bits = _per_layer(manifest, "bits_per_weight") or _per_layer(manifest, "bits")
    if bits:
        _bar(bits, "stored bits per weight", "bits", out_dir / "bits.png")
        lines += ["## Bits per layer", "", "![bits](bits.png)", ""]
    chosen = {layer: f for p in manifest["report"]["passes"] for layer, f in p["layers"].items() if "candidate" in f}
    if chosen:
        counts: dict[str, int] = {}
        for f in chosen.values():
            counts[f["candidate"]] = counts.get(f["candidate"], 0) + 1
        lines += [
            "## Allocation",
            "",
            "Candidates chosen: " + ", ".join(f"{code(c)} ×{k}" for c, k in sorted(counts.items())) + ".",
            "",
            "| layer | candidate | bits per weight | measured output damage alone |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {code(layer)} | {md(f['candidate'])} | {float(f.get('bits_per_weight', float('nan'))):.3f} | "
            + (f"{f['sensitivity']:.3g} |" if "sensitivity" in f else "- |")
            for layer, f in chosen.items()
        ]
        lines.append("")
    if _outlier_heatmap(artifact, manifest, out_dir / "outliers.png"):
        lines += [
            "## SpQR outliers",
            "",
            "![outliers](outliers.png)",
            "",
            "Vertical stripes are input channels whose weights are outliers in many output rows.",
            "",
        ]
    if _smoothing_plot(manifest, out_dir / "smoothing.png"):
        lines += [
            "## SmoothQuant scales",
            "",
            "![smoothing](smoothing.png)",
            "",
            "Smoothing divides each activation channel by s_j; the flatter 'after' curve is what int8 sees.",
            "",
        ]
    (out_dir / "report.md").write_text("\n".join(lines))
