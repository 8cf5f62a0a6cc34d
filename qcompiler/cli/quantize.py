"""``qcompiler quantize``: load, calibrate, compile and save (and export) — on one process, on
``--nproc`` ranks it starts, or on each rank of a ``torchrun``."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from qcompiler.cli import quantize_options as opt
from qcompiler.cli.common import ARGV, err, out, say
from qcompiler.cli.export import check_export_target, default_export_path, export_artifact
from qcompiler.compile_options import CompileOptions
from qcompiler.export_formats import ExportOptions, export_format
from qcompiler.pipeline.heartbeat import heartbeat


def _calibration(loaded, calib: str, count: int, seqlen: int, seed: int, packing: str, field: str):
    if calib == "bundled":
        return loaded.calibration(count, seed=seed)
    from qcompiler.calib.calibration_data import calibration_batches

    return calibration_batches(loaded, calib, nsamples=count, seqlen=seqlen, seed=seed, packing=packing, field=field)


def quantize(
    model: opt.Model,
    out_dir: opt.Out,
    recipe: opt.Recipe = "gptq-w4g128",
    revision: opt.Revision = None,
    bits: opt.Bits = None,
    group_size: opt.GroupSize = None,
    ignore: opt.Ignore = None,
    embeddings: opt.Embeddings = None,
    calib: opt.Calib = "bundled",
    samples: opt.Samples = 32,
    seqlen: opt.Seqlen = 2048,
    seed: opt.Seed = 0,
    packing: opt.PackingOption = "windows",
    calib_field: opt.CalibField = "text",
    overwrite: opt.Overwrite = False,
    device: opt.Device = "auto",
    offload: opt.Offload = False,
    stream: opt.Stream = True,
    trust_remote_code: opt.TrustRemoteCode = False,
    nproc: opt.Nproc = 1,
    rank_timeout: opt.RankTimeout = 1800.0,
    checkpoint: opt.Checkpoint = None,
    resume: opt.Resume = False,
    format: opt.Format = None,
    format_out: opt.FormatOut = None,
):
    """Quantize MODEL with RECIPE and save the result to --out (and, with --format, export it)."""
    from qcompiler.calib.host_memory import bound_kernel_cache
    from qcompiler.compiler import resolve_device
    from qcompiler.distributed.ranks import join_from_environment, leave
    from qcompiler.pipeline.recipe_files import resolve_recipe, with_embeddings, with_overrides

    bound_kernel_cache()  # before the first matmul of this process
    model = _with_revision(model, revision)
    # a bad recipe, device or output path fails before any loading
    resolved = with_overrides(resolve_recipe(recipe), bits=bits, group_size=group_size, ignore=ignore or None)
    resolved = with_embeddings(resolved, embeddings)
    compute = resolve_device(device)
    protect, export_to = _checked_outputs(model, out_dir, overwrite, checkpoint, resume, format, format_out)
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        from qcompiler.distributed.launch import run_ranks

        command = [sys.executable, "-m", "qcompiler", *_without_option(ARGV, "--nproc")]
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


def _with_revision(model: str, revision: Optional[str]) -> str:
    """``ORG/NAME@REVISION`` from ``--revision`` (a hub id only, and not given twice)."""
    if revision is None:
        return model
    from qcompiler.models.hub import is_hub_id

    if not is_hub_id(model) or "@" in model:
        raise typer.BadParameter(f"--revision applies to a hub id ORG/NAME without @REVISION, not {model!r}")
    return f"{model}@{revision}"


def _checked_outputs(model: str, out_dir: Path, overwrite: bool, checkpoint, resume: bool, format, format_out):
    """Every path the run will write, checked before any work: ``(protected paths, --format's target)``."""
    from qcompiler.files.atomic import check_output_folder

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
        export_to = format_out or default_export_path(out_dir, fmt)
        check_export_target(fmt, export_to, overwrite, [*protect, out_dir])
    return protect, export_to


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
    calibration = None
    if any(p.needs_calibration for p in job.recipe.passes):  # tokenizing a large text takes seconds
        with heartbeat(log, f"preparing {job.samples} calibration samples from {job.calib}"):
            calibration = _calibration(
                loaded, job.calib, job.samples, job.seqlen, job.seed, job.packing, job.calib_field
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
        export_artifact(
            job.out_dir,
            export_format(job.export_format),
            job.export_to,
            ExportOptions(overwrite=job.overwrite, protect=(job.out_dir, *job.protect), progress=out.print),
        )
