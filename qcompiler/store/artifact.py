"""``cm.save(dir)`` / ``qc.load(dir)``: a quantized model as files that load without calibration.

A folder holds ``manifest.json`` (format version, qcompiler/torch versions, recipe with every
pass's settings, per-layer report, capture info, a graph summary), ``graph.json`` (the graph as
data, see ``graph_format.py``), ``tensors.safetensors`` (every weight the graph reads) and
``example_inputs.safetensors``, and the model's tokenizer and generation files (``model_files``)
when it was loaded from a folder. Nothing is pickled, and loading treats every file as untrusted
(``graph_format.py``): each is opened without following links, must be a regular file, and the
manifest holds each file's SHA-256, checked on load; no path the manifest records is ever opened.

A save is published atomically (``atomic.publish_directory``): an interrupted save leaves the
previous artifact as it was; a folder is replaced only when it holds nothing but an earlier
qcompiler output (another kind of output: with ``overwrite=True``). A load reads every file
through one handle on the folder, so a save that replaces the artifact meanwhile cannot mix two
artifacts' files.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple, Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file

from qcompiler.errors import RecipeError
from qcompiler.files.atomic import publish_directory
from qcompiler.files.regular_files import open_regular, read_regular_file, sha256_of
from qcompiler.files.safetensors_stream import StreamedTensor, write_streamed
from qcompiler.files.sharding import DEFAULT_SHARD_BYTES, plan_shards, shard_names
from qcompiler.frontend.capture import OPTIONAL_INPUTS, CaptureInfo
from qcompiler.ir.model_size import model_size
from qcompiler.ir.op_registry import spec_of, validate_stored
from qcompiler.ir.tensors import get_tensor
from qcompiler.pipeline.pass_base import GraphProperty, PassRecord
from qcompiler.pipeline.pass_contract import properties_of, record_properties, witnesses
from qcompiler.pipeline.pass_registry import pass_name, resolve_pass
from qcompiler.pipeline.recipe_files import recipe_from_dict
from qcompiler.pipeline.recipes import Recipe
from qcompiler.pipeline.report import Report
from qcompiler.store.checkpoint_dtype import WIDEN_KEY, checkpoint_float_dtype, narrowing, widen
from qcompiler.store.graph_format import ArtifactError, graph_from_data, graph_to_data
from qcompiler.store.model_files import MAX_MODEL_FILE_BYTES, STORED_KEY, TOKENIZER_FILES, model_files
from qcompiler.version import __version__

__all__ = [
    "save",
    "read",
    "StoredModel",
    "read_manifest",
    "role_files",
    "report_from_manifest",
    "ArtifactError",
    "MANIFEST",
]

FORMAT = "qcompiler-artifact"
VERSION = 2  # 2: per-file SHA-256 in the manifest
SHARDED_VERSION = 3  # 3: the tensors in several files (written only when they are; else 2 as before)
MANIFEST = "manifest.json"
_FILES = {"graph": "graph.json", "tensors": "tensors.safetensors", "example_inputs": "example_inputs.safetensors"}
_LIST_ROLES = ("tensors", "model_files")  # roles that may hold several files
_MAX_JSON_BYTES = 1 << 30  # manifest.json and graph.json: read whole, so bounded first


def _json_safe(value):
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _graph_summary(gm, narrow: dict) -> dict:
    calls = collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    size = model_size(gm, stored_as=narrow).as_dict()  # what the files hold: narrowed tensors at their width
    return {
        "nodes": len(gm.graph.nodes),
        "qc_ops": {k: v for k, v in sorted(calls.items()) if k.startswith("qc.")},
        "tensors": sum(1 for n in gm.graph.nodes if n.op == "get_attr"),
        "size": size,  # what quantize, inspect and report show, without loading the tensors
    }


def _example_tensors(args: tuple, kwargs: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """The example inputs as named tensors and the JSON layout that puts them back (a KV cache's
    tensors one by one; constants as JSON values)."""
    examples, layout = {}, {"args": [], "kwargs": {}}
    for i, a in enumerate(args):
        examples[f"args.{i}"] = a.contiguous()
        layout["args"].append(f"args.{i}")
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            examples[f"kwargs.{k}"] = v.contiguous()
            layout["kwargs"][k] = {"tensor": f"kwargs.{k}"}
        elif isinstance(v, (tuple, list)) and v and all(isinstance(t, torch.Tensor) for t in v):  # a KV cache
            for i, t in enumerate(v):
                examples[f"kwargs.{k}.{i}"] = t.contiguous()
            layout["kwargs"][k] = {"tensors": [f"kwargs.{k}.{i}" for i in range(len(v))]}
        else:
            layout["kwargs"][k] = {"value": _json_safe(v)}
    return examples, layout


def save(
    cm,
    path,
    *,
    metadata: Optional[dict] = None,
    overwrite: bool = False,
    protect=(),
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write ``cm`` (a CompiledModel) to the folder ``path``, replacing an existing artifact atomically.

    ``metadata``: extra JSON-safe facts to keep in the manifest (the CLI records the model source).
    ``overwrite``: replace another kind of qcompiler output (never files qcompiler did not write).
    ``protect``: paths that must survive (the input model's folder; the folder the model was loaded from always is).
    ``max_shard_bytes``: past it the tensors go to ``tensors-0000k-of-0000n.safetensors`` files.
    """
    path = Path(path)
    _refuse_export_only(cm.graph_module)
    structure, tensors = graph_to_data(cm.graph_module)
    narrow = narrowing(
        tensors, structure["tensor_kinds"], checkpoint_float_dtype(getattr(cm.capture_info, "source_path", None))
    )
    if narrow:  # stored as the checkpoint had them, widened again on load
        structure[WIDEN_KEY] = sorted(narrow)
    examples, example_layout = _example_tensors(*cm.example_inputs)
    shards = plan_shards(tensors, max_shard_bytes)
    names = shard_names("tensors", len(shards))
    manifest = {
        "format": FORMAT,
        "version": VERSION if len(names) == 1 else SHARDED_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {"qcompiler": __version__, "torch": torch.__version__},
        "recipe": {
            "name": cm.recipe.name,
            "description": cm.recipe.description,
            "passes": [
                {"pass": pass_name(type(p)), "config_version": p.config_version, **_json_safe(p.config())}
                for p in cm.recipe.passes
            ],
        },
        "properties": sorted(p.value for p in properties_of(cm.graph_module)),
        "capture": _json_safe(dataclasses.asdict(cm.capture_info)),
        "report": _json_safe(cm.report.to_dict()),
        "graph": _graph_summary(cm.graph_module, narrow),
        "example_inputs": example_layout,
        "metadata": _json_safe(metadata or {}),
        "files": {**_FILES, "tensors": names[0] if len(names) == 1 else names},
    }
    extra = model_files(cm.graph_module)
    if extra:
        manifest["files"]["model_files"] = sorted(extra)
    source = getattr(cm.capture_info, "source_path", None)
    protect = (*protect, *([source] if source else []))
    with publish_directory(path, "artifact", overwrite=overwrite, protect=protect) as tmp:
        for name, data in extra.items():
            (tmp / name).write_bytes(data)
        for name, shard in zip(names, shards):
            with open(tmp / name, "wb") as f:
                write_streamed(
                    f, {k: _stored(cm.graph_module, k, tensors[k], narrow.get(k)) for k in shard}, {"format": FORMAT}
                )
        save_file(examples, str(tmp / _FILES["example_inputs"]), metadata={"format": FORMAT})
        (tmp / _FILES["graph"]).write_text(json.dumps(structure))
        manifest["sha256"] = {}
        for name in file_names(manifest):  # hashed in chunks: the tensors file is never read back whole
            with open(tmp / name, "rb") as f:
                manifest["sha256"][name] = sha256_of(f)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return path


def _stored(gm, target: str, tensor: torch.Tensor, narrow: Optional[torch.dtype] = None) -> StreamedTensor:
    """A tensor to write (``narrow``: in that dtype, losslessly); one still on disk (a streamed
    run's result) is read only when written."""
    if narrow is not None:
        return StreamedTensor(narrow, tuple(tensor.shape), lambda: tensor.to(narrow))
    if not tensor.is_meta:
        return StreamedTensor(tensor.dtype, tuple(tensor.shape), lambda: tensor)

    def read() -> torch.Tensor:
        value = get_tensor(gm, target)
        if value.is_meta:
            raise ArtifactError(f"cannot store {target}: the graph holds no data for it (a meta tensor)")
        return value

    return StreamedTensor(tensor.dtype, tuple(tensor.shape), read)


def _refuse_export_only(gm) -> None:
    """Ops that exist only on the way into one export target (``OpSpec.export_only``) are never saved."""
    for node in gm.graph.nodes:
        op_spec = spec_of(node)
        if op_spec is not None and op_spec.export_only is not None:
            raise ArtifactError(
                f"node {node.name} is qc.{op_spec.name}, which exists only inside the "
                f"{op_spec.export_only} export; save the graph before it is lowered"
            )


def _check_manifest(manifest, where) -> dict:
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or manifest.get("version") not in (1, VERSION, SHARDED_VERSION)
    ):
        got = (manifest.get("format"), manifest.get("version")) if isinstance(manifest, dict) else (None, None)
        raise ArtifactError(
            f"{where}: format {got[0]!r} version {got[1]!r} is not supported "
            f"(this qcompiler reads {FORMAT} versions 1-{SHARDED_VERSION})"
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or not set(_FILES) <= set(files) <= {*_FILES, "model_files"}:
        raise ArtifactError(f"{where}: the file table must name {sorted(_FILES)} (and optionally model_files)")
    extra = files.get("model_files", [])
    if not isinstance(extra, list) or not all(isinstance(n, str) and n in TOKENIZER_FILES for n in extra):
        raise ArtifactError(f"{where}: model_files may name only {', '.join(TOKENIZER_FILES)}")
    shards = files["tensors"]
    if isinstance(shards, list) and (manifest["version"] < SHARDED_VERSION or not shards):
        raise ArtifactError(f"{where}: a list of tensor files needs version {SHARDED_VERSION} and at least one file")
    for role in files:  # plain names inside the folder, never a path that leaves it
        for name in role_files(manifest, role):
            if (
                not isinstance(name, str)
                or name != os.path.basename(name)
                or name in ("", ".", "..")
                or "\\" in name
                or "\0" in name
            ):
                raise ArtifactError(f"{where}: file name {name!r} for {role} is not a plain name inside the artifact")
    return manifest


def role_files(manifest: dict, role: str) -> list[str]:
    """The files of one role: the tensors may be several shards, the other roles are one file."""
    names = manifest["files"][role]
    return names if role in _LIST_ROLES and isinstance(names, list) else [names]


def file_names(manifest: dict) -> list[str]:
    """Every file the manifest lists."""
    return [name for role in manifest["files"] for name in role_files(manifest, role)]


def read_manifest(path) -> dict:
    """The artifact's ``manifest.json``, checked for format, version and plain file names."""
    path = Path(path)
    file = path / MANIFEST
    if not file.exists() and not file.is_symlink():
        what = "does not exist" if not path.exists() else f"has no {MANIFEST} (not a qcompiler artifact)"
        raise ArtifactError(f"artifact folder {path} {what}")
    folder = _Folder(path)
    try:
        manifest = _parse_json(folder.read(MANIFEST, _MAX_JSON_BYTES), file)
    finally:
        folder.close()
    return _check_manifest(manifest, file)


def _parse_json(data: bytes, where: Path):
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise ArtifactError(f"{where} is not valid JSON: {err}") from None
    except RecursionError:  # [[[[...: no artifact nests that deep
        raise ArtifactError(f"{where} nests deeper than any artifact does (refused)") from None


def report_from_manifest(manifest: dict) -> Report:
    """The per-layer report a saved artifact carries (no tensors are read)."""
    try:
        return Report([PassRecord(**p) for p in manifest["report"]["passes"]])
    except (KeyError, TypeError) as exc:
        raise ArtifactError(f"the artifact's report is malformed ({exc})") from None


class _Folder:
    """Reads files of one folder through a handle on it: a concurrent replace of the folder (an
    atomic exchange) cannot make later reads come from the new folder."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            raise ArtifactError(f"artifact folder {path} does not exist") from None
        except NotADirectoryError:
            raise ArtifactError(f"{path} is a file, not an artifact folder") from None

    def open(self, name: str):
        """``name`` in the folder: a regular file, opened without following a link (a FIFO or
        /dev/zero behind a link would hang or exhaust memory)."""
        try:
            return open_regular(name, dir_fd=self.fd)
        except FileNotFoundError:
            raise ArtifactError(f"artifact {self.path} is missing {name}") from None
        except OSError as exc:
            raise ArtifactError(f"artifact {self.path}: {name} cannot be opened ({exc.strerror})") from None
        except ValueError:
            raise ArtifactError(f"artifact {self.path}: {name} is not a regular file") from None

    def read(self, name: str, limit: int) -> bytes:
        try:
            return read_regular_file(name, limit, dir_fd=self.fd)
        except FileNotFoundError:
            raise ArtifactError(f"artifact {self.path} is missing {name}") from None
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else str(exc).replace(name, "it", 1)
            raise ArtifactError(f"artifact {self.path}: {name}: {why}") from None

    def replaced(self) -> bool:
        try:
            return os.stat(self.path).st_ino != os.fstat(self.fd).st_ino
        except FileNotFoundError:
            return True

    def close(self):
        os.close(self.fd)


def _read_all(path: Path) -> tuple[dict, dict]:
    """The manifest and each file's content (bytes; tensor files as tensors), every file checked
    against its SHA-256 first. A tensor file is hashed in chunks and then read tensor by tensor
    from the same open file, so loading never holds the file's bytes and its tensors at once."""
    folder = _Folder(path)
    try:
        try:
            raw = folder.read(MANIFEST, _MAX_JSON_BYTES)
        except ArtifactError as exc:
            if "is missing" not in str(exc):
                raise
            raise ArtifactError(f"artifact folder {path} has no {MANIFEST} (not a qcompiler artifact)") from None
        manifest = _parse_json(raw, path / MANIFEST)
        files = _check_manifest(manifest, path / MANIFEST)["files"]
        sums = manifest.get("sha256")
        if manifest["version"] >= 2 and not isinstance(sums, dict):
            raise ArtifactError(f"{path / MANIFEST} has no checksums")
        contents = {}
        for role in files:
            for name in role_files(manifest, role):
                with folder.open(name) as f:
                    limit = MAX_MODEL_FILE_BYTES if role == "model_files" else _MAX_JSON_BYTES
                    if not name.endswith(".safetensors") and os.fstat(f.fileno()).st_size > limit:
                        raise ArtifactError(f"artifact {path}: {name} is over the {limit}-byte bound")
                    if manifest["version"] >= 2 and sums.get(name) != sha256_of(f):
                        raise ArtifactError(
                            f"artifact {path}: {name} does not match its SHA-256 in the manifest (damaged or modified)"
                        )
                    f.seek(0)
                    if role == "model_files":
                        contents.setdefault(role, {})[name] = f.read(limit)
                        continue
                    if not name.endswith(".safetensors"):
                        contents[role] = f.read(limit)
                        continue
                    part, merged = _tensors(f, path / name), contents.setdefault(role, {})
                    if part.keys() & merged.keys():
                        raise ArtifactError(f"artifact {path}: {name} repeats a tensor of an earlier shard")
                    merged.update(part)
        return manifest, contents
    except ArtifactError:
        if folder.replaced():  # a writer replaced the artifact while we read: read the new one
            return _read_all(path)
        raise
    finally:
        folder.close()


def _tensors(f, what) -> dict[str, torch.Tensor]:
    """The tensors of the open safetensors file ``f``: through ``/proc/self/fd`` (the very file
    that was hashed, mapped and copied one tensor at a time: clean page cache, not a second
    anonymous copy of the file) where the platform has it, else from its bytes. Copied, so the
    loaded model never depends on the file staying as it is (a mapped file truncated later
    would crash it)."""
    try:
        proc = f"/proc/self/fd/{f.fileno()}"
        if os.path.exists(proc):
            with safe_open(proc, framework="pt") as sf:
                return {k: sf.get_tensor(k).clone() for k in sf.keys()}
        return load_safetensors(f.read())
    except (SafetensorError, ValueError, RuntimeError, OSError) as exc:
        raise ArtifactError(f"{what} is not a readable safetensors file ({exc})") from None


class StoredModel(NamedTuple):
    """What an artifact folder holds; ``qc.load`` puts it on a backend."""

    graph_module: torch.fx.GraphModule
    recipe: Recipe
    report: Report
    example_inputs: tuple


def read(path) -> StoredModel:
    """The graph, recipe, report and example inputs of a folder written by :func:`save`; no
    calibration, no original model code."""
    path = Path(path)
    manifest, blobs = _read_all(path)
    structure = _parse_json(blobs["graph"], path / manifest["files"]["graph"])
    if isinstance(structure, dict):
        widen(structure, blobs["tensors"])
    gm = graph_from_data(structure, blobs["tensors"])
    try:  # a relabelled dtype, a reshaped tensor or a changed block type: named here, before anything runs
        validate_stored(gm)
    except ValueError as exc:
        raise ArtifactError(f"{path}: {exc}") from None
    gm.meta[STORED_KEY] = blobs.get("model_files", {})  # exports take these, never a manifest path
    examples = blobs["example_inputs"]
    try:
        capture = manifest["capture"]
        gm.meta["qcompiler"] = CaptureInfo(
            str(capture["model_class"]),
            int(capture["arg_count"]),
            tuple(capture["kwarg_names"]),
            dict(capture.get("constant_kwargs", {})),
            capture.get("model_config"),
            capture.get("source_path"),
            capture.get("cache"),
            {
                str(k): v
                for k, v in (capture.get("optional_inputs") or {}).items()
                if k in OPTIONAL_INPUTS and v in ("ones", "zeros")
            },
            tuple(str(name) for name in capture.get("transient", ())),
            {str(k): str(v) for k, v in (capture.get("tied") or {}).items()},
            tuple(str(name) for name in capture.get("transposed_layers", ())),
        )
        layout = manifest["example_inputs"]
        example_inputs = (
            tuple(examples[k] for k in layout["args"]),
            {
                k: examples[v["tensor"]]
                if "tensor" in v
                else tuple(examples[t] for t in v["tensors"])
                if "tensors" in v
                else v["value"]
                for k, v in layout["kwargs"].items()
            },
        )
        recipe = _stored_recipe(manifest["recipe"], path / MANIFEST)
        _restore_properties(gm, manifest, path / MANIFEST)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ArtifactError(f"{path / MANIFEST} is malformed ({type(exc).__name__}: {exc})") from None
    return StoredModel(gm, recipe, report_from_manifest(manifest), example_inputs)


def _stored_recipe(r: dict, where) -> Recipe:
    """The recipe that made the artifact, its passes rebuilt from the registry (never imported: the
    manifest is untrusted), each pass's settings checked against its config version. A pass not
    imported in this process leaves the recipe as a record without passes."""
    if r.get("reloadable") is False:  # format 1-3 artifacts made with custom passes kept no import path
        return Recipe(str(r["name"]), (), str(r.get("description", "")) + " (custom passes; settings in the manifest)")
    entries, missing = [], []
    for i, entry in enumerate(r["passes"]):
        name = entry["pass"]
        try:
            cls = resolve_pass(name, allow_import=False, where=f"{where}: recipe passes[{i}]")
        except RecipeError:
            missing.append(str(name))
            continue
        settings = {k: v for k, v in entry.items() if k not in ("pass", "config_version")}
        version = entry.get("config_version", 1)
        if version != cls.config_version:
            try:
                settings = cls.migrate_config(settings, version)
            except ArtifactError as exc:
                raise ArtifactError(f"{where}: {exc}") from None
        entries.append({"pass": name, **settings})
    if missing:
        return Recipe(
            str(r["name"]),
            (),
            str(r.get("description", ""))
            + f" (passes not imported in this process: {', '.join(missing)}; settings in the manifest)",
        )
    return recipe_from_dict(
        {"name": r["name"], "description": r["description"], "passes": entries}, source=str(where), allow_import=False
    )


def _restore_properties(gm, manifest: dict, where) -> None:
    """The graph properties the artifact's passes established (older artifacts: from their ops)."""
    names = manifest.get("properties")
    if names is None:
        names = ["captured", *(p.value for p in witnesses(gm))]
    try:
        record_properties(gm, [GraphProperty(n) for n in names])
    except ValueError:
        raise ArtifactError(f"{where}: unknown graph property in {names!r}") from None
