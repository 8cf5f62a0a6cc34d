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
import functools
import itertools
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
from qcompiler.backends.onnx_layout import lower_for_onnx
from qcompiler.errors import BackendError
from qcompiler.frontend import causal_lm
from qcompiler.frontend.capture import dynamic_shapes_for
from qcompiler.ir.op_registry import implement, implementation, implementations, spec
from qcompiler.files.atomic import temporary_sibling

__all__ = ["export_onnx", "ONNX_OPSET", "MSFT_OPSET", "default_accuracy_level"]

ONNX_OPSET = 18
MSFT_OPSET = 1
_TWO_GB = 2 * 1024**3


def default_accuracy_level() -> int:
    """MatMulNBits ``accuracy_level`` 4: activations quantized to int8 inside ORT's kernel.

    Measured (docs/results.md): at M = 1 on a 4096x11008 layer, one thread, level 4 takes 0.157
    of fp32's time and level 0 0.519, while MiniLM's embedding cosine moves by <= 0.001
    (gptq-w4g128 0.97315 -> 0.97260). Pass ``accuracy_level=0`` for outputs that match eager to
    float rounding.
    """
    return 4


def _register_contrib_schemas() -> None:
    """Teach onnx (and so onnxscript and the checker) the contrib op signatures we emit."""
    from onnx.defs import OpSchema

    P, opt = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    A = OpSchema.Attribute
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
    gqa_inputs = [
        ("query", "T"),
        ("key", "T"),
        ("value", "T"),
        ("past_key", "T"),
        ("past_value", "T"),
        ("seqlens_k", "M"),
        ("total_sequence_length", "M"),
        ("cos_cache", "T"),
        ("sin_cache", "T"),
        ("position_ids", "P"),
        ("attention_bias", "T"),
        ("head_sink", "T"),
        ("k_scale", "F"),
        ("v_scale", "F"),
        ("q_norm_weight", "T"),
        ("k_norm_weight", "T"),
        ("query_seqlens", "M"),
    ]
    required = {"query", "seqlens_k", "total_sequence_length"}
    gqa = OpSchema(  # the subset of ORT's schema we use: float caches, no quantization
        "GroupQueryAttention",
        "com.microsoft",
        MSFT_OPSET,
        inputs=[
            P(name, t, param_option=OpSchema.FormalParameterOption.Single if name in required else opt)
            for name, t in gqa_inputs
        ],
        outputs=[P("output", "T"), P("present_key", "T"), P("present_value", "T")],
        type_constraints=[
            ("T", floats, ""),
            ("M", ["tensor(int32)"], ""),
            ("P", ["tensor(int64)"], ""),
            ("F", ["tensor(float)"], ""),
        ],
        attributes=[
            A("num_heads", OpSchema.AttrType.INT, ""),
            A("kv_num_heads", OpSchema.AttrType.INT, ""),
            A("scale", OpSchema.AttrType.FLOAT, "", required=False),
        ],
    )
    nbits = OpSchema(
        "MatMulNBits",
        "com.microsoft",
        MSFT_OPSET,
        inputs=[
            P("A", "T1"),
            P("B", "T2"),
            P("scales", "T1"),
            P("zero_points", "T3", param_option=opt),
            P("g_idx", "T4", param_option=opt),
            P("bias", "T1", param_option=opt),
        ],
        outputs=[P("Y", "T1")],
        type_constraints=[
            ("T1", ["tensor(float)", "tensor(float16)"], ""),
            ("T2", ["tensor(uint8)"], ""),
            ("T3", ["tensor(uint8)", "tensor(float)", "tensor(float16)"], ""),
            ("T4", ["tensor(int32)"], ""),
        ],
        attributes=[
            A("K", OpSchema.AttrType.INT, ""),
            A("N", OpSchema.AttrType.INT, ""),
            A("bits", OpSchema.AttrType.INT, ""),
            A("block_size", OpSchema.AttrType.INT, ""),
            A("accuracy_level", OpSchema.AttrType.INT, "", required=False),
        ],
    )
    for schema in (gqa, nbits):  # once per process (and not over a schema another library registered)
        if not onnx.defs.has(schema.name, schema.domain):
            onnx.defs.register_schema(schema)


def _translation(op: str, label: str) -> None:
    """``op`` is translated to ONNX by the function of the same name in :func:`_onnx_functions`;
    its implementation's ``load()`` gives ``translate(accuracy_level)`` -> that onnxscript function."""
    implement("onnx", op, load=lambda: functools.partial(_translate, op), kind="translation", label=label)


def _translate(op: str, accuracy_level: int):
    return _onnx_functions(accuracy_level)[op]


def _translation_table(accuracy_level: int) -> dict:
    """``{op overload: onnxscript function}`` for every op registered as translated."""
    return {
        spec(name).overload: impl.load()(accuracy_level)
        for name, impl in implementations("onnx", kind="translation").items()
    }


_translation("int8_linear", "MatMulInteger with per-token scales")
_translation("matmul_nbits", "com.microsoft::MatMulNBits")
_translation("experts_matmul_nbits", "MatMulNBits per expert")
_translation("experts_matmul", "MatMul per expert")
_translation("gathered_outlier_linear", "Gather + MatMul")
_translation("experts_gathered_outlier_linear", "Gather + MatMul per expert")
_translation("kv_cache_attention", "com.microsoft::GroupQueryAttention")


@functools.lru_cache(maxsize=None)
def _onnx_functions(accuracy_level: int) -> dict:
    """The onnxscript function of each translated op, by op name (built once per accuracy level)."""
    import onnxscript
    from onnxscript import opset18 as op

    _register_contrib_schemas()
    msft = onnxscript.values.Opset("com.microsoft", MSFT_OPSET)
    UINT8, FLOAT = onnx.TensorProto.UINT8, onnx.TensorProto.FLOAT

    def nbits(a, B, scales, zero_points, group_corr, K, N, bits, block_size):
        """MatMulNBits of the (already permuted) input ``a``; SpQR's fractional zero points add
        (per-block sums of ``a``) @ ``group_corr``."""
        y = msft.MatMulNBits(
            a, B, scales, zero_points, K=K, N=N, bits=bits, block_size=block_size, accuracy_level=accuracy_level
        )
        if group_corr is None:
            return y
        lead = op.Slice(op.Shape(a), op.Constant(value_ints=[0]), op.Constant(value_ints=[-1]))
        shape = op.Concat(lead, op.Constant(value_ints=[K // block_size, block_size]), axis=0)
        sums = op.ReduceSum(op.Reshape(a, shape), op.Constant(value_ints=[-1]), keepdims=0)
        return op.Add(y, op.MatMul(sums, group_corr))

    def matmul_nbits(x, B, scales, zero_points, perm=None, group_corr=None, bias=None, K=0, N=0, bits=4, block_size=32):
        a = x if perm is None else op.Gather(x, perm, axis=-1)
        y = nbits(a, B, scales, zero_points, group_corr, K, N, bits, block_size)
        return y if bias is None else op.Add(y, bias)

    def pick(t, e):
        """Expert ``e``'s slice of a stacked initializer (a Gather by a constant: ORT folds it,
        same speed as a plain initializer)."""
        return op.Gather(t, op.Constant(value_int=e), axis=0)

    def by_expert(x, offsets, n_experts, n_out, matmul):
        """Each expert's rows (sorted by expert; ``offsets`` cumulative counts) through ``matmul(rows, e)``,
        concatenated; rows past the last offset are zero (as the torch op)."""
        ends = op.Cast(offsets, to=onnx.TensorProto.INT64)
        zero, axis0 = op.Constant(value_ints=[0]), op.Constant(value_ints=[0])
        outs, start = [], zero
        for e in range(n_experts):
            end = op.Slice(ends, op.Constant(value_ints=[e]), op.Constant(value_ints=[e + 1]))
            outs.append(matmul(op.Slice(x, start, end, axis0), e))
            start = end
        rest = op.Sub(op.Slice(op.Shape(x), zero, op.Constant(value_ints=[1])), start)
        outs.append(
            op.ConstantOfShape(
                op.Concat(rest, op.Constant(value_ints=[n_out]), axis=0),
                value=onnx.helper.make_tensor("zero", FLOAT, [1], [0.0]),
            )
        )
        return op.Concat(*outs, axis=0)

    def experts_matmul_nbits(
        x, offsets, B, scales, zero_points, perm=None, K=0, N=0, bits=4, block_size=32, group_corr=None
    ):
        def one(rows, e):
            rows = rows if perm is None else op.Gather(rows, pick(perm, e), axis=-1)
            return nbits(
                rows,
                pick(B, e),
                pick(scales, e),
                pick(zero_points, e),
                None if group_corr is None else pick(group_corr, e),
                K,
                N,
                bits,
                block_size,
            )

        return by_expert(x, offsets, _static_dim(B, 0), N, one)

    def experts_matmul(x, offsets, weight):
        return by_expert(
            x, offsets, _static_dim(weight, 0), _static_dim(weight, 2), lambda rows, e: op.MatMul(rows, pick(weight, e))
        )

    def gathered_outlier_linear(x, cols, block_t):
        return op.MatMul(op.Gather(x, cols, axis=-1), block_t)

    def experts_gathered_outlier_linear(x, offsets, cols, block_t, sizes=()):
        bounds = [0, *itertools.accumulate(sizes)]

        def one(rows, e):
            part = op.Constant(value_ints=[bounds[e]]), op.Constant(value_ints=[bounds[e + 1]])
            return gathered_outlier_linear(rows, op.Slice(cols, *part), op.Slice(block_t, *part))

        return by_expert(x, offsets, len(sizes), _static_dim(block_t, 1), one)

    def int8_linear(x, weight, weight_scale, bias=None, act_scale=None, smooth_inv=None):
        # int8 codes q in [-127, 127] travel as uint8 q + 128 with zero point 128, weights too: ORT's
        # u8 x u8 MatMulInteger is exact on every x86 CPU. Its u8 x s8 kernel is not on AVX2-only
        # CPUs (pairs of u8*s8 products saturate int16 in vpmaddubsw): measured here, an AMD EPYC
        # without VNNI, 0.4-7 % output error on the tiny test models; s8 x s8 is ~10x slower.
        # The weight's shift is a Cast/Add of an initializer, which ORT folds once at load.
        xs = x if smooth_inv is None else op.Mul(x, smooth_inv)
        if act_scale is None:
            amax = op.ReduceMax(op.Abs(xs), op.Constant(value_ints=[-1]), keepdims=1)
            sx = op.Max(op.Div(amax, op.Constant(value_float=127.0)), op.Constant(value_float=1e-8))
        else:
            sx = act_scale
        q = op.Clip(op.Round(op.Div(xs, sx)), op.Constant(value_float=-127.0), op.Constant(value_float=127.0))
        qu = op.Cast(op.Add(q, op.Constant(value_float=128.0)), to=UINT8)
        zero = op.Constant(value=onnx.helper.make_tensor("zp", UINT8, [], [128]))
        wu = op.Cast(
            op.Add(op.Cast(op.Transpose(weight, perm=[1, 0]), to=FLOAT), op.Constant(value_float=128.0)), to=UINT8
        )
        acc = op.MatMulInteger(qu, wu, zero, zero)
        y = op.Mul(op.Mul(op.Cast(acc, to=FLOAT), sx), weight_scale)
        return y if bias is None else op.Add(y, bias)

    def kv_cache_attention(query, key, value, past_key, past_value, bias, scale=1.0):
        """GroupQueryAttention with every row's past the whole past (``seqlens_k = T - 1``,
        ``query_seqlens = S``), so its present is ``cat([past, new])`` as in the torch op."""
        heads, kv_heads = _static_dim(query, 1), _static_dim(past_key, 1)
        INT32 = onnx.TensorProto.INT32

        def tokens_first(x):  # [B, heads, S, D] -> [B, S, heads * D]
            return op.Reshape(op.Transpose(x, perm=[0, 2, 1, 3]), op.Constant(value_ints=[0, 0, -1]))

        batch, new = op.Shape(query, start=0, end=1), op.Shape(query, start=2, end=3)
        total = op.Add(op.Shape(past_key, start=2, end=3), new)
        seqlens_k = op.Cast(op.Expand(op.Sub(total, op.Constant(value_ints=[1])), batch), to=INT32)
        out, present_key, present_value = msft.GroupQueryAttention(
            tokens_first(query),
            tokens_first(key),
            tokens_first(value),
            past_key,
            past_value,
            seqlens_k,
            op.Cast(op.Squeeze(total), to=INT32),
            None,
            None,
            None,
            bias,
            None,
            None,
            None,
            None,
            None,
            op.Cast(op.Expand(new, batch), to=INT32),
            num_heads=heads,
            kv_num_heads=kv_heads,
            scale=scale,
        )
        out = op.Reshape(out, op.Constant(value_ints=[0, 0, heads, -1]))
        return op.Transpose(out, perm=[0, 2, 1, 3]), present_key, present_value

    functions = locals()
    return {name: functions[name] for name in implementations("onnx", kind="translation")}


def _static_dim(value, dim: int) -> int:
    """A dimension of an exported value that must be static (an expert count, a width)."""
    size = value.shape[dim] if value.shape is not None else None
    if not isinstance(size, int):
        raise BackendError(f"ONNX export needs a static size for dim {dim} of {value.name}, got {size!r}")
    return size


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
    _check_mappable(lowered, table)
    args, kwargs = example_inputs
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
