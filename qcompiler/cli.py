"""The ``qcompiler`` command line: quantize, save, evaluate, inspect, export and report.

    qcompiler quantize bundled:tinylm --recipe gptq-w4g128 --out out/tinylm-w4
    qcompiler eval out/tinylm-w4
    qcompiler export out/tinylm-w4 --format onnx --out tinylm.onnx
    qcompiler inspect out/tinylm-w4
    qcompiler report out/tinylm-w4 --out out/report
    qcompiler recipes

Errors are one line on stderr (exit 2: bad arguments or inputs; 1: system or internal error;
130: interrupted); ``--debug`` shows the traceback.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from qcompiler.backends import available_backends
from qcompiler.compile_options import CompileOptions
from qcompiler.evaluation.quality import REPORTED_WINDOWS
from qcompiler.export_formats import ExportOptions, export_format, export_format_names, readers_of
from qcompiler.interop.gguf_export import REQUANTIZE_TYPES
from qcompiler.pipeline.heartbeat import heartbeat
from qcompiler.store.escaping import printable

_ARGV: list[str] = []  # the command line main() runs (each rank of --nproc gets it again)

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.splitlines()[0])


class _PlainConsole(Console):
    """Rich output without markup or highlighting (a ``[`` in a path is text), control characters escaped."""

    def print(self, *objects, **kwargs):
        super().print(*(printable(o) if isinstance(o, str) else o for o in objects), **kwargs)


out = _PlainConsole(markup=False, highlight=False, soft_wrap=True)
err = _PlainConsole(stderr=True, markup=False, highlight=False, soft_wrap=True)


def _choices(name: str, names: list[str]) -> type[Enum]:
    """A typer choice type from a registry's names (the registries are the one list of choices)."""
    return Enum(name, {n: n for n in names}, type=str)


ExportFormat = _choices("ExportFormat", export_format_names())
Backend = _choices("Backend", available_backends())
Packing = _choices("Packing", ["windows", "none"])
ZeroFormat = _choices("ZeroFormat", ["auto", "v1", "v2"])
RequantizeType = _choices("RequantizeType", list(REQUANTIZE_TYPES))


def _show_version(value: bool) -> None:
    if value:
        from qcompiler.version import __version__

        out.print(f"qcompiler {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    debug: bool = typer.Option(False, "--debug", help="show tracebacks (also after the command's name)"),
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_show_version, help="print the version"),
):
    """(--debug is read by main() wherever it stands, which decides how errors are shown.)"""


def _calibration(loaded, calib: str, count: int, seqlen: int, seed: int, packing: str, field: str):
    if calib == "bundled":
        return loaded.calibration(count, seed=seed)
    from qcompiler.calib.calibration_data import calibration_batches

    return calibration_batches(loaded, calib, nsamples=count, seqlen=seqlen, seed=seed, packing=packing, field=field)


def _artifact_source(target: str, needed_for: str) -> tuple[bool, str]:
    """``(is_artifact, model source)``: an artifact names the model it was made from."""
    from qcompiler.store.artifact import MANIFEST, read_manifest

    path = Path(target)
    if not (path / MANIFEST).is_file():
        return False, target
    source = read_manifest(path)["metadata"].get("source")
    if not source:
        raise ValueError(f"artifact {path} does not record its source model; {needed_for}")
    return True, source


_EVAL_JSON = "qcompiler eval"


def _is_eval_json(path: Path) -> bool:
    """Whether ``path`` is a figures file an earlier ``eval --json`` wrote (so it may be replaced)."""
    from qcompiler.files.regular_files import read_regular_file

    try:
        data = json.loads(read_regular_file(path, 1 << 20))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("written_by") == _EVAL_JSON


def _layer_table(report, title: str) -> Table:
    table = Table(title=title)
    rows = report.layer_table()
    keys = [
        k
        for k in ("bits", "bits_per_weight", "rel_error", "outlier_fraction", "kernel", "seconds")
        if any(k in r for r in rows)
    ]
    for column in ["pass", "layer", *keys]:
        table.add_column(column)
    for r in rows:
        cells = [r["pass"], r["layer"], *[_fmt(r.get(k, "")) for k in keys]]
        table.add_row(*(printable(str(c), newlines=False) for c in cells))
    return table


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


@app.command()
def quantize(
    model: str = typer.Argument(
        ..., help="bundled:tinylm|longlm|minilm, a Hugging Face model folder, or a hub id ORG/NAME[@REVISION]"
    ),
    recipe: str = typer.Option("gptq-w4g128", help="built-in recipe name or a .yaml/.toml recipe file"),
    revision: Optional[str] = typer.Option(None, help="hub ids: the branch, tag or commit to fetch"),
    bits: Optional[int] = typer.Option(None, min=1, max=16, help="set the width of every pass of RECIPE that has one"),
    group_size: Optional[int] = typer.Option(
        None, help="set the group size of every pass of RECIPE that has one (-1: one group per row)"
    ),
    ignore: Optional[list[str]] = typer.Option(
        None,
        help="keep these layers in full precision (a glob over module paths, or 're:' + a regex); repeatable; "
        "'qcompiler recipes RECIPE --model MODEL' shows what they match",
    ),
    embeddings: Optional[str] = typer.Option(
        None,
        help="also quantize the token embeddings in the graph (a tied head's table by GPTQ on its inputs): "
        "wBITSgGROUP, e.g. w4g64",
    ),
    calib: str = typer.Option(
        "bundled",
        help="'bundled' (the bundled text through the model's tokenizer), "
        "a text file, a folder of text files, .jsonl, .parquet or a saved dataset",
    ),
    samples: int = typer.Option(
        32,
        "--samples",
        "--nsamples",
        min=1,
        max=1_000_000,
        help="calibration windows / documents / sentences (the GPTQ paper: 128)",
    ),
    seqlen: int = typer.Option(
        2048, min=2, max=1 << 20, help="tokens per window, capped by the model's context (bundled: 128)"
    ),
    seed: int = typer.Option(0, help="seed of the random windows"),
    packing: Packing = typer.Option(
        "windows", help="windows: random windows of the joined text; none: one padded sample per document"
    ),
    calib_field: str = typer.Option("text", help="JSONL / Parquet / dataset field holding the text"),
    out_dir: Path = typer.Option(..., "--out", help="artifact folder to write (replaced atomically)"),
    overwrite: bool = typer.Option(False, help="replace --out when it holds another kind of qcompiler output"),
    device: str = typer.Option(
        "auto",
        help="where calibration and GPTQ/SpQR run, one block at a time: "
        "auto (cuda when available) | cpu | cuda | cuda:N",
    ),
    offload: bool = typer.Option(False, help="keep cached calibration activations on the CPU"),
    stream: bool = typer.Option(
        True,
        help="read each block's weights from the safetensors files when it is "
        "calibrated, in the checkpoint's dtype (--no-stream: load the whole model "
        "in float32 first)",
    ),
    trust_remote_code: bool = typer.Option(
        False, help="run the model folder's own Python code (auto_map); off by default: only for folders you trust"
    ),
    nproc: int = typer.Option(
        1,
        min=1,
        max=1024,
        help="ranks to start on this machine (each calibrates a share of the windows; layers are solved "
        "in parallel); under torchrun leave it at 1",
    ),
    rank_timeout: float = typer.Option(
        1800.0, min=10.0, help="seconds a rank waits for the others before the run fails (distributed runs)"
    ),
    checkpoint: Optional[Path] = typer.Option(
        None, help="folder where each finished block is recorded, so that --resume can continue a killed run"
    ),
    resume: bool = typer.Option(False, help="continue the run recorded in --checkpoint (same model, recipe, data)"),
    format: Optional[ExportFormat] = typer.Option(
        None,
        "--format",
        help="also export the saved artifact to this format, with its defaults ('qcompiler export' has its options)",
    ),
    format_out: Optional[Path] = typer.Option(
        None, help="where --format writes (default: beside --out, as OUT.onnx / OUT.gguf or a folder OUT-FORMAT)"
    ),
):
    """Quantize MODEL with RECIPE and save the result to --out (and, with --format, export it)."""
    from qcompiler.calib.host_memory import bound_kernel_cache
    from qcompiler.compiler import resolve_device
    from qcompiler.distributed.ranks import join_from_environment, leave
    from qcompiler.files.atomic import check_output_folder
    from qcompiler.pipeline.recipe_files import resolve_recipe, with_embeddings, with_overrides

    bound_kernel_cache()  # before the first matmul of this process
    if revision is not None:
        from qcompiler.models.hub import is_hub_id

        if not is_hub_id(model) or "@" in model:
            raise typer.BadParameter(f"--revision applies to a hub id ORG/NAME without @REVISION, not {model!r}")
        model = f"{model}@{revision}"
    # a bad recipe, device or output path fails before any loading
    resolved = with_overrides(resolve_recipe(recipe), bits=bits, group_size=group_size, ignore=ignore or None)
    resolved = with_embeddings(resolved, embeddings)
    compute = resolve_device(device)
    protect = [model] if Path(model).is_dir() else []
    if resume and checkpoint is None:
        raise typer.BadParameter("--resume continues the run recorded in --checkpoint DIR: give the folder")
    if checkpoint is not None:
        if checkpoint.resolve() == out_dir.resolve() or (
            protect and checkpoint.resolve().is_relative_to(Path(model).resolve())
        ):
            raise typer.BadParameter(
                f"--checkpoint {checkpoint} must be a folder of its own, not --out or inside the model"
            )
        protect.append(checkpoint)
    check_output_folder(out_dir, "artifact", overwrite=overwrite, protect=protect)
    if format_out is not None and format is None:
        raise typer.BadParameter("--format-out names where --format writes: give --format too")
    export_to = None
    if format is not None:
        fmt = export_format(format.value)
        export_to = format_out or _default_export_path(out_dir, fmt)
        _check_export_target(fmt, export_to, overwrite, [*protect, out_dir])
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        from qcompiler.distributed.launch import run_ranks

        command = [sys.executable, "-m", "qcompiler", *_without_option(_ARGV, "--nproc")]
        code = run_ranks(command, nproc, say=lambda line: err.print(f"[qcompiler] {line}"))
        raise typer.Exit(code)
    ranks = join_from_environment(compute, rank_timeout)
    try:
        job = _QuantizeJob(
            model=model,
            recipe=resolved,
            calib=calib,
            samples=samples,
            seqlen=seqlen,
            seed=seed,
            packing=packing.value,
            calib_field=calib_field,
            options=CompileOptions(
                device=compute,
                offload=offload,
                checkpoint=checkpoint,
                resume=resume,
                keep_checkpoint=True,  # until the artifact is saved
                materialize=False,  # a streamed model's results stay on disk: the save writes one tensor at a time
            ),
            stream=stream,
            trust_remote_code=trust_remote_code,
            out_dir=out_dir,
            overwrite=overwrite,
            protect=tuple(protect),
            export_format=None if format is None else format.value,
            export_to=export_to,
        )
        _quantize_on_rank(ranks, job)
    finally:
        leave()


def _without_option(argv: list[str], name: str) -> list[str]:
    """``argv`` without ``name VALUE`` / ``name=VALUE``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


@dataclass(frozen=True)
class _QuantizeJob:
    """What every rank of one ``quantize`` command does, as the command line gave it."""

    model: str
    recipe: object  # the resolved Recipe
    calib: str
    samples: int
    seqlen: int
    seed: int
    packing: str
    calib_field: str
    options: CompileOptions  # how compile runs; its device: each rank takes its own GPU of that kind
    stream: bool
    trust_remote_code: bool
    out_dir: Path
    overwrite: bool
    protect: tuple
    export_format: Optional[str] = None  # --format: exported from the saved artifact
    export_to: Optional[Path] = None


def _quantize_on_rank(ranks, job: _QuantizeJob) -> None:
    """The quantize command's work on one rank (rank 0 saves and prints)."""
    import qcompiler as qc
    from qcompiler.ir.model_size import ModelSize
    from qcompiler.models import load
    from qcompiler.pipeline.run_checkpoint import remove_progress
    from qcompiler.store.artifact import read_manifest

    log = say if ranks.is_root else (lambda _m: None)
    with heartbeat(log, f"loading {job.model}"):
        loaded = load(job.model, stream=job.stream, trust_remote_code=job.trust_remote_code)
    calibration = (
        _calibration(loaded, job.calib, job.samples, job.seqlen, job.seed, job.packing, job.calib_field)
        if any(p.needs_calibration for p in job.recipe.passes)
        else None
    )
    start = time.perf_counter()
    cm = qc.compile(
        loaded.model,
        loaded.example_inputs(),
        recipe=job.recipe,
        calibration=calibration,
        options=dataclasses.replace(job.options, device=ranks.device(job.options.device)),
    )
    seconds = time.perf_counter() - start
    if not ranks.is_root:  # every rank holds the same model; one writes it
        return
    cm.save(
        job.out_dir,
        metadata={
            "source": job.model,
            "calibration": job.calib,
            "samples": job.samples,
            "seqlen": job.seqlen,
            "seed": job.seed,
            "packing": job.packing,
        },
        overwrite=job.overwrite,
        protect=job.protect,
    )
    if job.options.checkpoint is not None:
        remove_progress(job.options.checkpoint)
    where = f" on {ranks.world} ranks" if ranks.distributed else ""  # the per-layer lines came as each finished
    out.print(
        f"{job.recipe.name}: {len(cm.report.layer_table())} layer records, {seconds:.1f}s{where}; saved to "
        f"{job.out_dir} ('qcompiler inspect' shows the per-layer table)"
    )
    stored = ModelSize.from_counts(read_manifest(job.out_dir)["graph"]["size"])  # as the files hold it
    out.print(f"model size: {stored.describe()}")
    if job.export_format is not None:  # from the saved artifact, the source of truth, as 'export' would
        _export_artifact(
            job.out_dir,
            export_format(job.export_format),
            job.export_to,
            ExportOptions(overwrite=job.overwrite, protect=(job.out_dir, *job.protect), progress=out.print),
        )


def say(message: str) -> None:
    """A progress line on stderr, as the passes print theirs (stdout keeps the results)."""
    err.print(f"[qcompiler] {message}")


def _counter(label: str, unit: str, every: float = 2.0):
    """``report(done, total)`` printing ``label: done/total unit`` at most every ``every`` seconds,
    and always at the end: a long loop is never silent, and never floods the terminal."""
    last = [time.monotonic()]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if done >= total or now - last[0] >= every:
            last[0] = now
            say(f"{label}: {done}/{total} {unit}")

    return report


def _triton_runtime() -> None:
    """Without a GPU, Triton kernels run only in the interpreter, which must be chosen before import."""
    import os

    import torch

    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "1"
        err.print("no CUDA GPU: running the Triton kernels under TRITON_INTERPRET=1 (slow; for correctness)")


@app.command(name="eval")
def evaluate(
    target: str = typer.Argument(..., help="an artifact folder, or a model (bundled:NAME / folder)"),
    backend: Backend = typer.Option("eager", help="backend to run the quantized model on"),
    windows: int = typer.Option(
        REPORTED_WINDOWS, min=1, max=100_000, help="windows (causal LMs) / sentences (encoders) to score, at most"
    ),
    text: Optional[str] = typer.Option(
        None,
        help="score this text instead of the bundled held-out text: a text file, a folder of text files, "
        ".jsonl, .parquet or a saved dataset (the calibration readers)",
    ),
    text_field: str = typer.Option("text", help="JSONL / Parquet / dataset field holding the text"),
    seqlen: int = typer.Option(256, min=2, max=1 << 20, help="tokens per window, capped by the model's context"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="also write the figures as JSON"),
):
    """Perplexity (causal LMs) or embedding cosine vs FP32 (encoders), FP32 beside quantized."""
    import qcompiler as qc
    from qcompiler.evaluation.quality import QualityJudge
    from qcompiler.files.atomic import check_output_file
    from qcompiler.models import load

    if backend.value == "triton":
        _triton_runtime()
    path = Path(target)
    is_artifact, source = _artifact_source(target, "evaluate needs the FP32 model")
    if json_out:  # before the work: never replace a file eval did not write, nor write into a model
        check_output_file(
            json_out, "eval JSON", ours=_is_eval_json, protect=[p for p in (target, source) if Path(p).is_dir()]
        )
    texts = None
    if text is not None:
        from qcompiler.calib.calibration_data import read_texts

        texts = read_texts(text, field=text_field)
    with heartbeat(say, f"loading {source}"):
        loaded = load(source)
    judge = QualityJudge(loaded, max_windows=windows, sentences=windows, text=texts, window=seqlen)
    over = judge.describe()
    say(f"scoring the FP model over {over}")
    figures = {"written_by": _EVAL_JSON, "model": source, "metric": judge.metric, "over": over}
    figures["fp32"] = judge.score(loaded.model, progress=_counter("FP model", "windows"))
    if is_artifact:  # the FP model is done: never resident beside the quantized one
        judge.release_model()
        del loaded
        gc.collect()
        with heartbeat(say, f"loading {path}"):
            cm = qc.load(path, backend=backend.value)
        say(f"scoring the quantized model ({backend.value})")
        quantized = judge.score(cm, progress=_counter("quantized", "windows"))
        figures.update(artifact=str(path), backend=backend.value, recipe=cm.recipe.name, quantized=quantized)
        figures["loss"] = judge.loss(figures["fp32"], figures["quantized"])
    line = f"{judge.metric} over {over}: FP32 {figures['fp32']:.4f}"
    if "quantized" in figures:
        line += f" -> quantized {figures['quantized']:.4f} ({backend.value}, {figures['recipe']})"
    out.print(line)
    if json_out:
        from qcompiler.files.atomic import write_text_atomically

        write_text_atomically(json_out, json.dumps(figures, indent=1))


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


@app.command()
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
    _check_export_target(fmt, dest, overwrite, [artifact])  # refuse a bad target before the work
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
    _export_artifact(artifact, fmt, dest, options)


def _check_export_target(fmt, dest: Path, overwrite: bool, protect: list) -> None:
    from qcompiler.files.atomic import check_file_location, check_output_folder

    if fmt.writes == "folder":
        check_output_folder(dest, fmt.name, overwrite=overwrite, protect=protect)
    else:  # where it lands; whether an existing file is the format's own, its writer checks
        check_file_location(dest, fmt.name, protect=protect)


def _default_export_path(out_dir: Path, fmt) -> Path:
    """Beside the artifact: ``OUT.onnx`` / ``OUT.gguf`` for a file, ``OUT-gptq/`` for a folder."""
    suffix = f".{fmt.name}" if fmt.writes == "file" else f"-{fmt.name}"
    return out_dir.with_name(out_dir.name + suffix)


def _export_artifact(artifact: Path, fmt, dest: Path, options: ExportOptions) -> None:
    import qcompiler as qc

    with heartbeat(say, f"loading {artifact}"):
        cm = qc.load(artifact)
    with heartbeat(say, f"writing {fmt.name} to {dest}"):
        fmt.write(cm, dest, options)
    out.print(f"wrote {dest}")


@app.command()
def generate(
    target: str = typer.Argument(..., help="an artifact folder, or a model (bundled:NAME / folder) in FP"),
    prompt: list[str] = typer.Option(..., "--prompt", help="text to continue; repeat for a batch"),
    max_new_tokens: int = typer.Option(
        32, "--max-new-tokens", min=0, max=1_000_000, help="tokens to generate per prompt"
    ),
    backend: Backend = typer.Option("eager", help="backend to run the model on"),
    do_sample: bool = typer.Option(False, "--sample", help="sample instead of greedy decoding"),
    temperature: float = typer.Option(1.0, help="sampling temperature"),
    top_k: int = typer.Option(0, "--top-k", min=0, help="sample among the k most likely tokens (0: all)"),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0, help="nucleus sampling mass (1.0: all)"),
    seed: Optional[int] = typer.Option(None, help="random seed for sampling"),
):
    """Continue each --prompt with the KV cache; one prompt streams its tokens as they are made."""
    import torch

    import qcompiler as qc
    from qcompiler.generation import SamplingConfig
    from qcompiler.models import load, tokenizer_for

    if max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    SamplingConfig(do_sample, temperature, top_k, top_p)  # bad values fail before any loading
    if backend.value == "triton":
        _triton_runtime()
    is_artifact, source = _artifact_source(target, "so there is no tokenizer for it")
    with heartbeat(say, f"loading {target}"):
        if is_artifact:
            tokenizer, cm = tokenizer_for(source), qc.load(target, backend=backend.value)
        else:
            loaded = load(target)
            tokenizer = loaded.tokenizer
            cm = qc.compile(loaded.model, loaded.example_inputs(), recipe="none", backend=backend.value, progress=False)
    encoded = [list(map(int, tokenizer.encode(p))) for p in prompt]
    if any(not ids for ids in encoded):
        raise ValueError("a --prompt is empty: give at least one token of text")
    width = max(map(len, encoded))
    ids = torch.tensor([[0] * (width - len(e)) + e for e in encoded])  # left padding
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    options = dict(
        do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, attention_mask=mask
    )
    if len(prompt) == 1:
        made, shown = [], ""

        def write(text: str) -> None:  # plain stdout: no wrapping or markup, flushed token by token
            sys.stdout.write(text)
            sys.stdout.flush()

        tokens = cm.stream(ids, max_new_tokens, **options)
        with heartbeat(say, f"prefill of {ids.shape[1]} prompt tokens"):  # until the first token
            first = next(tokens, None)  # bad values raise before the first token
        for token in [] if first is None else itertools.chain([first], tokens):
            if not made:
                write(prompt[0])
            made.append(int(token[0]))
            text = tokenizer.decode(made)
            write(text[len(shown) :])
            shown = text
        write(("" if made else prompt[0]) + "\n")
        return
    result = cm.generate(ids, max_new_tokens, **options)
    for p, row in zip(prompt, result[:, width:]):
        out.print(
            f"{p!r} -> {tokenizer.decode([int(t) for t in row])!r}", markup=False, highlight=False, soft_wrap=True
        )


@app.command()
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
    out.print(_layer_table(report_from_manifest(manifest), "per-layer report"))


@app.command()
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


@app.command()
def report(
    artifact: Path = typer.Argument(..., help="artifact folder"),
    dest: Path = typer.Option(..., "--out", help="folder for report.md and its PNG plots"),
    overwrite: bool = typer.Option(False, help="replace --out when it holds another kind of qcompiler output"),
):
    """A markdown page with plots: per-layer error, bits per layer, SpQR outliers, SmoothQuant scales."""
    from qcompiler.evaluation.report_page import write_report

    page = write_report(artifact, dest, overwrite=overwrite)
    out.print(f"wrote {page}")


# Library warnings about qcompiler's own calls, not the user's model, kept off the terminal by the
# command-line entry points (the Python API leaves logging to its caller); a warning that could
# matter to a user (weights not found in a checkpoint, a tokenizer mismatch) is never filtered.
# (logger name, text the message starts with): the graph takes the KV cache as ``past_key_values``,
# the name every transformers 5.x release accepts; the newest ones prefer ``cache`` and say so per call.
_LOG_MESSAGES = (("transformers.utils.generic", "`past_key_values`/`cache_params` are deprecated"),)


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_library_warnings() -> None:
    """Install the filters (idempotent): each drops a message a user can do nothing about."""
    for name, prefix in _LOG_MESSAGES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages((prefix,)))
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)  # torch.export internals


def _os_message(e: OSError) -> str:
    where = f": {e.filename}" if e.filename else ""
    return f"{e.strerror or e}{where}" if e.strerror else str(e)


def main(argv=None) -> int:
    """Console-script entry point. Every failure is one line on stderr, no traceback unless --debug:
    exit 2 when the command line or an input it names is wrong, 1 when the system failed (disk
    full, permissions) or qcompiler hit an internal error, 130 when interrupted (Ctrl-C; outputs
    are published atomically, so nothing half-written stays behind)."""
    from typer._click import exceptions as click_errors  # typer vendors its own click

    from qcompiler.errors import QCompilerError

    quiet_library_warnings()
    args = list(sys.argv[1:] if argv is None else argv)
    _ARGV[:] = args  # what --nproc starts each rank with
    debug = "--debug" in args
    if debug:  # accepted anywhere on the line, as the guide's "add --debug" means
        args = ["--debug", *(a for a in args if a != "--debug")]
    if not [a for a in args if a != "--debug"]:
        args = ["--help"]

    rank = int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0

    def fail(message: str, code: int, *, same_on_every_rank: bool = False) -> int:
        if rank and same_on_every_rank:
            return code  # rank 0 prints the same line
        message = " ".join(line.strip() for line in str(message).splitlines() if line.strip())
        message = f"rank {rank}: {message}" if rank else message
        err.print(f"error: {message}", soft_wrap=True)
        return code

    try:
        code = app(args=args, prog_name="qcompiler", standalone_mode=False)
        if code == 130:  # typer turns Ctrl-C into an exit code in non-standalone mode
            raise KeyboardInterrupt
        if isinstance(code, int) and code:  # typer.Exit(code) is returned, not raised, here
            return code
    except (KeyboardInterrupt, typer.Abort):
        if debug:
            raise
        return fail("interrupted; no partial output was left", 130)
    except click_errors.UsageError as e:
        where = e.ctx.command_path if e.ctx is not None else "qcompiler"  # the command's own help
        return fail(f"{e.format_message()} (see '{where} --help')", 2)
    except typer.Exit as e:
        return e.exit_code
    except click_errors.ClickException as e:
        return fail(e.format_message(), 2)
    except (QCompilerError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
        if debug:
            raise
        return fail(str(e), 2, same_on_every_rank=True)
    except OSError as e:
        if debug:
            raise
        return fail(_os_message(e), 1)
    except Exception as e:  # a bug: still one line, with the way to see more
        if debug:
            raise
        return fail(f"internal error: {type(e).__name__}: {e} (run with --debug for the traceback)", 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
