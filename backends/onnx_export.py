"""Export a (quantized) graph to ONNX that ONNX Runtime runs: ``torch.onnx.export(dynamo=True)`` with a
translation table for the ``qc`` ops, after re-packing them into ORT layouts (``onnx_layout``).

Op mapping (ORT contrib ops live in the ``com.microsoft`` domain, version 1):

- weight-only (GPTQ/RTN 2/3/4/8-bit, SpQR dense) → ``com.microsoft::MatMulNBits`` (3-bit widened
  to 4-bit) with uint8 zero points, act-order as a ``Gather`` of input columns; SpQR's fractional
  zeros as the nearest integer plus a per-block correction ``(block sums of x) @ C``;
- SpQR outliers → ``Gather`` of the outlier columns + ``MatMul`` with a small dense block;
- W8A8 → standard ONNX ops with per-token scales: ``ReduceMax``/``Round``/``Clip``, codes shifted
  and weights to uint8 with zero point 128, ``MatMulInteger`` (int32 accumulation, exact on every
  x86 CPU: ORT's u8 x s8 kernel saturates on AVX2-only ones), rescale — the same
  integers as ``qc.int8_linear``;
- cached attention (KV-cache graphs) → ``com.microsoft::GroupQueryAttention`` (``onnx_attention``).

The file is written atomically (temporary file, full ``onnx.checker`` check, an ORT session
created, then renamed into place): a failed export leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Optional

import onnx
import torch
from torch.fx import GraphModule

from qcompiler.backends.onnx_attention import fuse_kv_cache_attention
from qcompiler.backends.onnx_dtype import widen_half_floats, widened_inputs
from qcompiler.backends.onnx_layout import lower_for_onnx
from qcompiler.backends.onnx_translations import MSFT_OPSET
from qcompiler.errors import BackendError
from qcompiler.files.atomic import naming_output, temporary_sibling
from qcompiler.frontend import causal_lm
from qcompiler.frontend.capture import dynamic_shapes_for
from qcompiler.ir.op_registry import implementation, implementations, spec

__all__ = ["export_onnx", "ONNX_OPSET", "MSFT_OPSET", "default_accuracy_level"]

ONNX_OPSET = 18
_TWO_GB = 2 * 1024**3


def default_accuracy_level() -> int:
    """MatMulNBits ``accuracy_level`` 4: activations quantized to int8 inside ORT's kernel.

    Measured (docs/results.md): at M = 1 on a 4096x11008 layer, one thread, level 4 takes 0.157
    of fp32's time and level 0 0.519, while MiniLM's embedding cosine moves by <= 0.001
    (gptq-w4g128 0.97315 -> 0.97260). Pass ``accuracy_level=0`` for outputs that match eager to
    float rounding.
    """
    return 4


def _translation_table(accuracy_level: int) -> dict:
    """``{op overload: onnxscript function}`` for every op registered as translated (``onnx_translations.py``)."""
    return {
        spec(name).overload: impl.load()(accuracy_level)
        for name, impl in implementations("onnx", kind="translation").items()
    }


def _check_mappable(lowered: GraphModule, table: dict) -> None:
    """Every ``qc`` op left after re-packing must have a translation (the table is the list)."""
    for node in lowered.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "qc" and node.target not in table:
            from qcompiler.ir.graph import module_path

            op = str(node.target).split(".")[-2]
            refused = implementation("onnx", op)
            why = (
                refused.refusal
                if refused is not None and refused.refusal
                else f"it has no ONNX mapping (mapped: {', '.join(sorted(implementations('onnx')))})"
            )
            raise BackendError(f"node {node.name} ({module_path(node) or 'top level'}) uses op qc.{op}: {why}")


@contextlib.contextmanager
def _quiet():
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def export_onnx(
    gm: GraphModule,
    path,
    example_inputs: tuple[tuple, dict],
    *,
    recipe: str = "",
    accuracy_level: Optional[int] = None,
    fused_attention: bool = True,
    protect=(),
) -> Path:
    """Write ``gm`` as an ONNX model at ``path`` (atomically); returns the path.

    An existing file is replaced only when it is an earlier qcompiler export; never inside a
    ``protect`` folder (the artifact or model it came from) or another qcompiler output.
    ``fused_attention=False`` keeps a KV-cache graph's attention as standard ONNX ops (for runtimes
    without ORT's contrib ops: an FP or W8A8 export then uses none)."""
    path = Path(path)
    _check_target(path, protect)
    level = default_accuracy_level() if accuracy_level is None else accuracy_level
    table = _translation_table(level)
    with _quiet():  # deep-copying torch.export's pytree specs warns about LeafSpec (torch's own deprecation)
        lowered, notes = lower_for_onnx(gm)
    notes += widen_half_floats(lowered)
    _check_mappable(lowered, table)
    args, kwargs = widened_inputs(tuple(example_inputs[0])), widened_inputs(dict(example_inputs[1]))
    info = gm.meta["qcompiler"]
    kwargs = {**kwargs, **info.constant_kwargs}
    if info.cache and fused_attention:
        notes += fuse_kv_cache_attention(lowered, (args, kwargs))
    if kwargs and args:
        raise BackendError("ONNX export takes either positional or keyword example inputs, not both")
    shapes = causal_lm.dynamic_shapes(kwargs) if info.cache else dynamic_shapes_for(args, kwargs, [])
    try:
        with _quiet():
            program = torch.onnx.export(
                lowered,
                args,
                kwargs=kwargs or None,
                dynamo=True,
                opset_version=ONNX_OPSET,
                custom_translation_table=table,
                dynamic_shapes=shapes,
                verbose=False,
                optimize=True,
            )
    except Exception as exc:
        raise BackendError(f"ONNX export of {info.model_class} failed: {failure_reason(exc)}") from exc
    model = program.model_proto
    if info.cache:
        _rename_values(model, cache_io_names(causal_lm.CacheLayout.from_dict(info.cache), model))
    for node in model.graph.node:  # the exporter's per-node debug metadata (stack traces) was ~20 % of the file
        del node.metadata_props[:]
        node.doc_string = ""
    meta = {
        "qcompiler.recipe": recipe or gm.meta.get("qcompiler_recipe", ""),
        "qcompiler.onnx_opset": str(ONNX_OPSET),
        "qcompiler.com_microsoft_opset": str(MSFT_OPSET),
        "qcompiler.matmul_nbits_accuracy_level": str(level),
        "qcompiler.notes": "; ".join(notes),
    }
    for key, value in meta.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    _write_checked(model, path)
    return path


def cache_io_names(layout, model: Optional[onnx.ModelProto] = None) -> dict[str, str]:
    """Graph value names -> the names LLM runtimes (onnxruntime-genai, Optimum) use:
    ``past_key_values.N.key`` / ``.value`` in, ``logits`` and ``present.N.key`` / ``.value`` out."""
    names = {}
    for i in range(layout.layers):
        names[f"past_{2 * i}"], names[f"past_{2 * i + 1}"] = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
    if model is not None:
        outputs = [o.name for o in model.graph.output]
        names[outputs[0]] = "logits"
        for i in range(layout.layers):
            names[outputs[1 + 2 * i]], names[outputs[2 + 2 * i]] = f"present.{i}.key", f"present.{i}.value"
    return names


def _rename_values(model: onnx.ModelProto, names: dict[str, str]) -> None:
    graph = model.graph
    for value in [*graph.input, *graph.output, *graph.value_info]:
        value.name = names.get(value.name, value.name)
    for node in graph.node:
        node.input[:] = [names.get(n, n) for n in node.input]
        node.output[:] = [names.get(n, n) for n in node.output]


def failure_reason(exc: BaseException) -> str:
    """The root cause's first meaningful line: torch's exporter wraps it in pages of advice whose
    last line is 'Refer to the full stack trace above'."""
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(root))
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith(("#", "-", "("))]
    summary = [line for line in lines if line.startswith("<class")]
    reason = (summary or lines or [type(root).__name__])[0]
    return f"{type(root).__name__}: {reason}" if not reason.startswith("<class") else reason


def _is_qcompiler_onnx(path: Path) -> bool:
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # not ONNX at all (onnx raises protobuf's DecodeError and others)
        return False
    return any(p.key == "qcompiler.recipe" for p in model.metadata_props)


def _check_target(path: Path, protect=()) -> None:
    """Never replace a file qcompiler did not write (the model file and its external-data file)."""
    from qcompiler.files.atomic import OutputPathError, check_output_file

    check_output_file(path, "ONNX", ours=_is_qcompiler_onnx, protect=protect)  # an existing model is ours
    data = path.with_name(path.name + ".data")
    if data.exists() and not path.exists():
        raise OutputPathError(f"refusing to replace {data}: it is not the weights file of a qcompiler ONNX export")


def _write_checked(model: onnx.ModelProto, path: Path) -> None:
    import onnxruntime as ort

    path.parent.mkdir(parents=True, exist_ok=True)
    tmpdir = temporary_sibling(path, folder=True)
    try:
        tmp = tmpdir / path.name
        # initializer bytes, not model.ByteSize(): protobuf cannot even measure a message over 2 GB
        external = sum(len(t.raw_data) for t in model.graph.initializer) > _TWO_GB
        with naming_output(path):
            onnx.save_model(
                model,
                str(tmp),
                save_as_external_data=external,
                all_tensors_to_one_file=True,
                location=path.name + ".data" if external else None,
            )
        try:
            onnx.checker.check_model(str(tmp), full_check=True)
        except onnx.checker.ValidationError as exc:
            raise BackendError(f"exported ONNX model failed the checker: {str(exc).splitlines()[0]}") from exc
        try:
            ort.InferenceSession(str(tmp), providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise BackendError(f"ONNX Runtime could not load the exported model: {str(exc).splitlines()[0]}") from exc
        for produced in tmpdir.iterdir():
            os.replace(produced, path.parent / produced.name)
    finally:
        for leftover in tmpdir.iterdir():
            leftover.unlink()
        tmpdir.rmdir()
