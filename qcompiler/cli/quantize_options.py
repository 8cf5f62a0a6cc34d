"""The ``quantize`` command's arguments, each declared once as an annotated type (typer reads the
help, bounds and flag names from it; the defaults stay in the command's signature)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from qcompiler.cli.common import ExportFormat, Packing

__all__ = [
    "Model",
    "Recipe",
    "Revision",
    "Bits",
    "GroupSize",
    "Ignore",
    "Embeddings",
    "Calib",
    "Samples",
    "Seqlen",
    "Seed",
    "PackingOption",
    "CalibField",
    "Out",
    "Overwrite",
    "Device",
    "Offload",
    "Stream",
    "TrustRemoteCode",
    "Nproc",
    "RankTimeout",
    "Checkpoint",
    "Resume",
    "Format",
    "FormatOut",
]

Model = Annotated[
    str,
    typer.Argument(help="bundled:tinylm|longlm|minilm, a Hugging Face model folder, or a hub id ORG/NAME[@REVISION]"),
]
Recipe = Annotated[str, typer.Option(help="built-in recipe name or a .yaml/.toml recipe file")]
Revision = Annotated[Optional[str], typer.Option(help="hub ids: the branch, tag or commit to fetch")]
Bits = Annotated[Optional[int], typer.Option(min=1, max=16, help="set the width of every pass of RECIPE that has one")]
GroupSize = Annotated[
    Optional[int], typer.Option(help="set the group size of every pass of RECIPE that has one (-1: one group per row)")
]
Ignore = Annotated[
    Optional[list[str]],
    typer.Option(
        help="keep these layers in full precision (a glob over module paths, or 're:' + a regex); repeatable; "
        "'qcompiler recipes RECIPE --model MODEL' shows what they match"
    ),
]
Embeddings = Annotated[
    Optional[str],
    typer.Option(
        help="also quantize the token embeddings in the graph (a tied head's table by GPTQ on its inputs): "
        "wBITSgGROUP, e.g. w4g64; or auto, with an auto recipe: the table joins its budget (auto:4.5 counts "
        "the table's parameters too and chooses its setting)"
    ),
]
Calib = Annotated[
    str,
    typer.Option(
        help="'bundled' (the bundled text through the model's tokenizer), "
        "a text file, a folder of text files, .jsonl, .parquet or a saved dataset"
    ),
]
Samples = Annotated[
    int,
    typer.Option(
        "--samples",
        "--nsamples",
        min=1,
        max=1_000_000,
        help="calibration windows / documents / sentences (the GPTQ paper: 128)",
    ),
]
Seqlen = Annotated[
    int, typer.Option(min=2, max=1 << 20, help="tokens per window, capped by the model's context (bundled: 128)")
]
Seed = Annotated[int, typer.Option(help="seed of the random windows")]
PackingOption = Annotated[
    Packing, typer.Option(help="windows: random windows of the joined text; none: one padded sample per document")
]
CalibField = Annotated[str, typer.Option(help="JSONL / Parquet / dataset field holding the text")]
Out = Annotated[Path, typer.Option("--out", help="artifact folder to write (replaced atomically)")]
Overwrite = Annotated[bool, typer.Option(help="replace --out when it holds another kind of qcompiler output")]
Device = Annotated[
    str,
    typer.Option(
        help="where calibration and GPTQ/SpQR run, one block at a time: "
        "auto (cuda when available) | cpu | cuda | cuda:N"
    ),
]
Offload = Annotated[bool, typer.Option(help="keep cached calibration activations on the CPU")]
Stream = Annotated[
    bool,
    typer.Option(
        help="read each block's weights from the safetensors files when it is calibrated, in the checkpoint's "
        "dtype (--no-stream: load the whole model in float32 first)"
    ),
]
TrustRemoteCode = Annotated[
    bool,
    typer.Option(help="run the model folder's own Python code (auto_map); off by default: only for folders you trust"),
]
Nproc = Annotated[
    int,
    typer.Option(
        min=1,
        max=1024,
        help="ranks to start on this machine (each calibrates a share of the windows; layers are solved "
        "in parallel); under torchrun leave it at 1",
    ),
]
RankTimeout = Annotated[
    float, typer.Option(min=10.0, help="seconds a rank waits for the others before the run fails (distributed runs)")
]
Checkpoint = Annotated[
    Optional[Path],
    typer.Option(help="folder where each finished block is recorded, so that --resume can continue a killed run"),
]
Resume = Annotated[bool, typer.Option(help="continue the run recorded in --checkpoint (same model, recipe, data)")]
Format = Annotated[
    Optional[ExportFormat],
    typer.Option(
        "--format",
        help="also export the saved artifact to this format, with its defaults ('qcompiler export' has its options)",
    ),
]
FormatOut = Annotated[
    Optional[Path],
    typer.Option(help="where --format writes (default: beside --out, as OUT.onnx / OUT.gguf or a folder OUT-FORMAT)"),
]
