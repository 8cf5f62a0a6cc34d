"""``qcompiler export``: a saved artifact to ONNX, onnx-genai, GPTQ, compressed-tensors or GGUF;
each flag refused where the chosen format would not read it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from qcompiler.cli.common import ExportFormat, RequantizeType, ZeroFormat, out, say
from qcompiler.export_formats import ExportOptions, export_format, export_format_names, readers_of
from qcompiler.pipeline.heartbeat import heartbeat

_SHARD_GB = 5.0  # export's --max-shard-gb default

# the ExportOptions field each export flag sets (which formats read it: ExportFormat.reads)
_OPTION_FIELDS = {
    "--zero-format": "zero_format",
    "--max-shard-gb": "max_shard_bytes",
    "--accuracy-level": "accuracy_level",
    "--plain-attention": "fused_attention",
    "--requantize": "requantize",
    "--token-embedding": "token_embedding",
}


def export(
    artifact: Path = typer.Argument(..., help="artifact folder written by 'quantize'"),
    format: ExportFormat = typer.Option(
        ..., "--format", help="; ".join(f"{name}: {export_format(name).description}" for name in export_format_names())
    ),
    dest: Path = typer.Option(..., "--out", help="file (onnx, gguf) or folder (onnx-genai, gptq, compressed-tensors)"),
    zero_format: ZeroFormat = typer.Option("auto", help="gptq only: zero points as v1 (AutoGPTQ) or v2 (GPTQModel)"),
    max_shard_gb: float = typer.Option(
        _SHARD_GB, min=0.001, max=1e6, help="gptq, compressed-tensors: safetensors shard size (GiB)"
    ),
    accuracy_level: Optional[int] = typer.Option(
        None,
        min=0,
        max=4,
        help="onnx, onnx-genai: MatMulNBits accuracy_level (default 4: int8 activations, fastest on CPU; 0: exact)",
    ),
    plain_attention: bool = typer.Option(
        False, help="onnx, onnx-genai: attention as standard ONNX ops instead of ORT's GroupQueryAttention"
    ),
    requantize: Optional[RequantizeType] = typer.Option(
        None,
        help="gguf: re-round layers not on a GGUF grid to this block type (q8_0/q4_0/q4_1 by llama.cpp's RTN; "
        "the K types by qcompiler's fitted grid)",
    ),
    token_embedding: Optional[RequantizeType] = typer.Option(
        None, help="gguf: store the FP token embeddings (Gemma: also the head) as this block type instead of F16"
    ),
    overwrite: bool = typer.Option(False, help="replace --out when it holds another kind of qcompiler output"),
):
    """Export a saved artifact to ONNX, an onnxruntime-genai folder, a GPTQ or compressed-tensors checkpoint or GGUF."""
    fmt = export_format(format.value)
    given = {
        "--zero-format": zero_format.value != "auto",
        "--max-shard-gb": max_shard_gb != _SHARD_GB,
        "--accuracy-level": accuracy_level is not None,
        "--plain-attention": plain_attention,
        "--requantize": requantize is not None,
        "--token-embedding": token_embedding is not None,
    }
    for option in (o for o, on in given.items() if on and fmt.unread([_OPTION_FIELDS[o]])):
        readers = " / ".join(readers_of(_OPTION_FIELDS[option]))
        raise typer.BadParameter(f"{option} applies to --format {readers}, not {fmt.name}: it would do nothing")
    check_export_target(fmt, dest, overwrite, [artifact])  # refuse a bad target before the work
    options = ExportOptions(
        overwrite=overwrite,
        protect=(artifact,),
        accuracy_level=accuracy_level,
        fused_attention=not plain_attention,
        zero_format=zero_format.value,
        requantize=None if requantize is None else requantize.value,
        token_embedding=None if token_embedding is None else token_embedding.value,
        max_shard_bytes=int(max_shard_gb * 1024**3),
        progress=out.print,
    )
    export_artifact(artifact, fmt, dest, options)


def check_export_target(fmt, dest: Path, overwrite: bool, protect: list) -> None:
    """Refuse a bad ``--out`` for ``fmt`` before any work (a folder format: the output-folder rules)."""
    from qcompiler.files.atomic import check_file_location, check_output_folder

    if fmt.writes == "folder":
        check_output_folder(dest, fmt.name, overwrite=overwrite, protect=protect)
    else:  # where it lands; whether an existing file is the format's own, its writer checks
        check_file_location(dest, fmt.name, protect=protect)


def default_export_path(out_dir: Path, fmt) -> Path:
    """Beside the artifact: ``OUT.onnx`` / ``OUT.gguf`` for a file, ``OUT-gptq/`` for a folder."""
    suffix = f".{fmt.name}" if fmt.writes == "file" else f"-{fmt.name}"
    return out_dir.with_name(out_dir.name + suffix)


def export_artifact(artifact: Path, fmt, dest: Path, options: ExportOptions) -> None:
    """Load the saved artifact (the source of truth) and write it in ``fmt``, with progress."""
    import qcompiler as qc

    with heartbeat(say, f"loading {artifact}"):
        cm = qc.load(artifact)
    with heartbeat(say, f"writing {fmt.name} to {dest}"):
        fmt.write(cm, dest, options)
    out.print(f"wrote {dest}")
