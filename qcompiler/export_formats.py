"""The export formats, by name: what ``qcompiler export --format`` offers and how each is written.

Each format is registered once with the options it reads (``ExportOptions``); the command line
builds its ``--format`` choices from this registry, and ``register_export_format`` adds one of your
own. The built-in writers are imported on first use (they pull in onnx and the interop code).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

from qcompiler.files.sharding import DEFAULT_SHARD_BYTES

__all__ = [
    "ExportFormat",
    "ExportOptions",
    "register_export_format",
    "export_format",
    "export_format_names",
    "readers_of",
]


@dataclass(frozen=True)
class ExportOptions:
    """Every setting an export may read; a format ignores the ones that are not its own."""

    overwrite: bool = False  # folders: replace an earlier qcompiler output of another kind
    protect: tuple = ()  # paths the output may never replace or lie in (the artifact it came from)
    accuracy_level: Optional[int] = None  # onnx, onnx-genai: MatMulNBits accuracy_level
    fused_attention: bool = True  # onnx, onnx-genai: ORT's GroupQueryAttention
    zero_format: str = "auto"  # gptq: auto | v1 | v2 zero points
    requantize: Optional[str] = None  # gguf: re-round layers not on a GGUF grid to this block type (REQUANTIZE_TYPES)
    token_embedding: Optional[str] = None  # gguf: store the FP token embeddings as this block type, not F16
    max_shard_bytes: int = DEFAULT_SHARD_BYTES
    progress: Callable[[str], None] = print


GENERAL_OPTIONS = ("overwrite", "protect", "progress")  # every format takes these


@dataclass(frozen=True)
class ExportFormat:
    """A named export: ``write(cm, dest, options)`` makes ``dest``, a file or a folder (``writes``)."""

    name: str
    writes: str
    write: Callable[[object, Path, ExportOptions], object]
    description: str
    target: str = ""  # the op-registry target whose implement/refuse lines say which qc ops it writes
    writer_module: str = ""  # the module that holds the writer and registers that target
    reads: Optional[tuple[str, ...]] = None  # the format's own ExportOptions fields (None: all of them)

    def unread(self, given: Iterable[str]) -> list[str]:
        """The settings in ``given`` this format does not read (they would do nothing)."""
        if self.reads is None:
            return []
        return [name for name in given if name not in GENERAL_OPTIONS and name not in self.reads]

    def check_settings(self, given: Iterable[str]) -> None:
        """Refuse settings this format does not read, naming who reads them."""
        unread = self.unread(given)
        if unread:
            readers = " / ".join(readers_of(unread[0])) or "no registered format"
            raise ValueError(f"export option {unread[0]} applies to {readers}, not {self.name}: it would do nothing")

    def load_target(self) -> Optional[str]:
        """Import the writer's module (registering its target's implementations) and name the target."""
        if self.writer_module:
            importlib.import_module(self.writer_module)
        return self.target or None


_FORMATS: dict[str, ExportFormat] = {}


def readers_of(option: str) -> list[str]:
    """The registered formats that read ExportOptions field ``option`` (by their ``reads``)."""
    return [name for name, fmt in _FORMATS.items() if fmt.reads is not None and option in fmt.reads]


def register_export_format(fmt: ExportFormat) -> ExportFormat:
    """Make ``fmt`` available to ``qcompiler export --format NAME`` (a later one of the same name replaces it)."""
    if fmt.writes not in ("file", "folder"):
        raise ValueError(f"export format {fmt.name}: writes={fmt.writes!r} must be 'file' or 'folder'")
    _FORMATS[fmt.name] = fmt
    return fmt


def export_format_names() -> list[str]:
    """The registered format names, in registration order (built-ins first)."""
    return list(_FORMATS)


def export_format(name: str) -> ExportFormat:
    """The format called ``name``, or an error listing the ones there are."""
    if name not in _FORMATS:
        raise ValueError(f"unknown export format {name!r}; available: {', '.join(_FORMATS)}")
    return _FORMATS[name]


def _onnx(cm, dest, o: ExportOptions):
    return cm.export_onnx(dest, accuracy_level=o.accuracy_level, fused_attention=o.fused_attention, protect=o.protect)


def _onnx_genai(cm, dest, o: ExportOptions):
    from qcompiler.interop import export_onnx_genai

    return export_onnx_genai(
        cm,
        dest,
        accuracy_level=o.accuracy_level,
        overwrite=o.overwrite,
        progress=o.progress,
        fused_attention=o.fused_attention,
        protect=o.protect,
    )


def _gptq(cm, dest, o: ExportOptions):
    from qcompiler.interop import export_gptq

    return export_gptq(
        cm,
        dest,
        zero_format=o.zero_format,
        progress=o.progress,
        overwrite=o.overwrite,
        protect=o.protect,
        max_shard_bytes=o.max_shard_bytes,
    )


def _compressed_tensors(cm, dest, o: ExportOptions):
    from qcompiler.interop import export_compressed_tensors

    return export_compressed_tensors(
        cm, dest, progress=o.progress, overwrite=o.overwrite, protect=o.protect, max_shard_bytes=o.max_shard_bytes
    )


def _gguf(cm, dest, o: ExportOptions):
    from qcompiler.interop.gguf_export import export_gguf

    return export_gguf(
        cm, dest, requantize=o.requantize, token_embedding=o.token_embedding, protect=o.protect, progress=o.progress
    )


for _fmt in (
    ExportFormat(
        "onnx",
        "file",
        _onnx,
        "one ONNX model file for ONNX Runtime",
        "onnx",
        "qcompiler.backends.onnx_export",
        ("accuracy_level", "fused_attention"),
    ),
    ExportFormat(
        "onnx-genai",
        "folder",
        _onnx_genai,
        "an onnxruntime-genai model folder",
        "onnx",
        "qcompiler.interop.onnx_genai",
        ("accuracy_level", "fused_attention"),
    ),
    ExportFormat(
        "gptq",
        "folder",
        _gptq,
        "a GPTQ checkpoint (transformers, GPTQModel, vLLM)",
        "gptq",
        "qcompiler.interop.gptq_checkpoint",
        ("zero_format", "max_shard_bytes"),
    ),
    ExportFormat(
        "compressed-tensors",
        "folder",
        _compressed_tensors,
        "a compressed-tensors checkpoint (transformers, vLLM)",
        "compressed-tensors",
        "qcompiler.interop.compressed_tensors",
        ("max_shard_bytes",),
    ),
    ExportFormat(
        "gguf",
        "file",
        _gguf,
        "one GGUF file for llama.cpp / Ollama (GPTQ on Q4_0 ... Q8_0 and Q2_K ... Q6_K blocks; F16 / F32 elsewhere)",
        "gguf",
        "qcompiler.interop.gguf_export",
        ("requantize", "token_embedding"),
    ),
):
    register_export_format(_fmt)
