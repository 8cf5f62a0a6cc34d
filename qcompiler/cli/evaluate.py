"""``qcompiler eval``: perplexity (causal LMs) or embedding cosine (encoders), FP32 beside the
quantized model, one resident at a time."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Optional

import typer

from qcompiler.cli.common import Backend, artifact_source, counter, out, say, triton_runtime
from qcompiler.evaluation.quality import REPORTED_WINDOWS
from qcompiler.pipeline.heartbeat import heartbeat

_EVAL_JSON = "qcompiler eval"


def _is_eval_json(path: Path) -> bool:
    """Whether ``path`` is a figures file an earlier ``eval --json`` wrote (so it may be replaced)."""
    from qcompiler.files.regular_files import read_regular_file

    try:
        data = json.loads(read_regular_file(path, 1 << 20))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("written_by") == _EVAL_JSON


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
        triton_runtime()
    path = Path(target)
    is_artifact, source = artifact_source(target, "evaluate needs the FP32 model")
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
    figures["fp32"] = judge.score(loaded.model, progress=counter("FP model", "windows"))
    if is_artifact:  # the FP model is done: never resident beside the quantized one
        judge.release_model()
        del loaded
        gc.collect()
        with heartbeat(say, f"loading {path}"):
            cm = qc.load(path, backend=backend.value)
        say(f"scoring the quantized model ({backend.value})")
        quantized = judge.score(cm, progress=counter("quantized", "windows"))
        figures.update(artifact=str(path), backend=backend.value, recipe=cm.recipe.name, quantized=quantized)
        figures["loss"] = judge.loss(figures["fp32"], figures["quantized"])
    line = f"{judge.metric} over {over}: FP32 {figures['fp32']:.4f}"
    if "quantized" in figures:
        line += f" -> quantized {figures['quantized']:.4f} ({backend.value}, {figures['recipe']})"
    out.print(line)
    if json_out:
        from qcompiler.files.atomic import write_text_atomically

        write_text_atomically(json_out, json.dumps(figures, indent=1))
