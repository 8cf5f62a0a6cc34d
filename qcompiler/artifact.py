"""``cm.save(dir)`` / ``qc.load(dir)``: a quantized model as files that load without calibration.

A folder holds ``manifest.json`` (format version, qcompiler/torch versions, recipe with every
pass's settings, per-layer report, capture info, a graph summary), ``graph.json`` (the graph as
data, see ``graph_format.py``), ``tensors.safetensors`` (every weight the graph reads) and
``example_inputs.safetensors``. Nothing is pickled. A save is atomic: it is written to a temporary
folder that replaces the target only once complete, so an interrupted save leaves the previous
artifact as it was.
"""
from __future__ import annotations

import collections
import dataclasses
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from .atomic import atomic_directory
from .capture import CaptureInfo
from .graph_format import ArtifactError, graph_from_data, graph_to_data
from .pass_base import PassRecord
from .recipe_files import pass_classes, recipe_from_dict
from .recipes import Recipe
from .report import Report

__all__ = ["save", "load", "read_manifest", "report_from_manifest", "ArtifactError", "MANIFEST"]

FORMAT = "qcompiler-artifact"
VERSION = 1
MANIFEST = "manifest.json"


def _json_safe(value):
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _graph_summary(gm) -> dict:
    calls = collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    return {"nodes": len(gm.graph.nodes), "qc_ops": {k: v for k, v in sorted(calls.items()) if k.startswith("qc.")},
            "tensors": sum(1 for n in gm.graph.nodes if n.op == "get_attr")}


def save(cm, path, *, metadata: Optional[dict] = None) -> Path:
    """Write ``cm`` (a CompiledModel) to the folder ``path``, replacing an existing artifact atomically.

    ``metadata``: extra JSON-safe facts to keep in the manifest (the CLI records the model source).
    """
    path = Path(path)
    structure, tensors = graph_to_data(cm.graph_module)
    args, kwargs = cm.example_inputs
    examples, example_layout = {}, {"args": [], "kwargs": {}}
    for i, a in enumerate(args):
        examples[f"args.{i}"] = a.contiguous()
        example_layout["args"].append(f"args.{i}")
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            examples[f"kwargs.{k}"] = v.contiguous()
            example_layout["kwargs"][k] = {"tensor": f"kwargs.{k}"}
        else:
            example_layout["kwargs"][k] = {"value": _json_safe(v)}
    builtin = set(pass_classes())
    manifest = {
        "format": FORMAT, "version": VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {"qcompiler": _version(), "torch": torch.__version__},
        "recipe": {"name": cm.recipe.name, "description": cm.recipe.description,
                   "passes": [{"pass": p.name, **_json_safe(p.config())} for p in cm.recipe.passes],
                   "reloadable": all(p.name in builtin for p in cm.recipe.passes)},
        "capture": _json_safe(dataclasses.asdict(cm.capture_info)),
        "report": _json_safe(cm.report.to_dict()),
        "graph": _graph_summary(cm.graph_module),
        "example_inputs": example_layout,
        "metadata": _json_safe(metadata or {}),
        "files": {"graph": "graph.json", "tensors": "tensors.safetensors", "example_inputs": "example_inputs.safetensors"},
    }
    with atomic_directory(path) as tmp:
        save_file(tensors, str(tmp / "tensors.safetensors"), metadata={"format": FORMAT})
        save_file(examples, str(tmp / "example_inputs.safetensors"), metadata={"format": FORMAT})
        (tmp / "graph.json").write_text(json.dumps(structure))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")  # last: its presence marks completeness
    return path


def read_manifest(path) -> dict:
    path = Path(path)
    file = path / MANIFEST
    if not file.is_file():
        what = "does not exist" if not path.exists() else f"has no {MANIFEST} (not a qcompiler artifact)"
        raise ArtifactError(f"artifact folder {path} {what}")
    try:
        manifest = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ArtifactError(f"{file} is not valid JSON: {err}") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ArtifactError(f"{file}: format {manifest.get('format')!r} version {manifest.get('version')!r} "
                            f"is not supported (this qcompiler reads {FORMAT} version {VERSION})")
    return manifest


def report_from_manifest(manifest: dict) -> Report:
    """The per-layer report a saved artifact carries (no tensors are read)."""
    return Report([PassRecord(**p) for p in manifest["report"]["passes"]])


def load(path, backend: str = "eager", *, backend_options: Optional[dict] = None):
    """A CompiledModel from a folder written by :func:`save`; no calibration, no original model code."""
    from .backends import get_backend
    from .compiler import CompiledModel

    path = Path(path)
    manifest = read_manifest(path)
    files = manifest["files"]
    for name in files.values():
        if not (path / name).is_file():
            raise ArtifactError(f"artifact {path} is missing {name}")
    gm = graph_from_data(json.loads((path / files["graph"]).read_text()), load_file(str(path / files["tensors"])))
    capture = manifest["capture"]
    gm.meta["qcompiler"] = CaptureInfo(capture["model_class"], capture["arg_count"], tuple(capture["kwarg_names"]),
                                       capture.get("constant_kwargs", {}), capture.get("model_config"))
    examples = load_file(str(path / files["example_inputs"]))
    layout = manifest["example_inputs"]
    example_inputs = (tuple(examples[k] for k in layout["args"]),
                      {k: examples[v["tensor"]] if "tensor" in v else v["value"] for k, v in layout["kwargs"].items()})
    r = manifest["recipe"]
    recipe = recipe_from_dict({k: r[k] for k in ("name", "description", "passes")}) if r.get("reloadable") \
        else Recipe(r["name"], (), r.get("description", "") + " (custom passes; settings in the manifest)")
    report = report_from_manifest(manifest)
    options = dict(backend_options or {})
    if backend == "onnxruntime":
        options.setdefault("recipe", recipe.name)
    runner = get_backend(backend)(gm, example_inputs, **options)
    if getattr(runner, "record", None) is not None:  # the backend's plan joins the report, as in compile()
        report.passes.append(runner.record)
    return CompiledModel(gm, recipe, report, backend, runner, example_inputs)


def _version() -> str:
    from . import __version__
    return __version__
