"""The ONNX translation of each ``qc`` op the ONNX export emits: one module-level onnxscript
function per op, registered with the ``onnx`` target by :func:`onnx_translation` (torch.onnx calls
it for the op's nodes); an op whose translation depends on MatMulNBits' ``accuracy_level`` registers
a builder of it instead. Imported by ``onnx_export.py`` (onnxscript loads only for an export).
"""

from __future__ import annotations

import functools
import itertools
from typing import Callable

import onnx
import onnxscript
from onnx.defs import OpSchema
from onnxscript import opset18 as op

from qcompiler.errors import BackendError
from qcompiler.ir.op_registry import implement

__all__ = ["onnx_translation", "MSFT_OPSET"]

MSFT_OPSET = 1
UINT8, FLOAT = onnx.TensorProto.UINT8, onnx.TensorProto.FLOAT


def onnx_translation(name: str, label: str, *, by_accuracy_level: bool = False) -> Callable:
    """Register the decorated function as ``qc.{name}``'s ONNX translation (``label`` names it in
    plans); with ``by_accuracy_level`` it is a builder ``f(accuracy_level)`` of the translation.
    The ``onnx`` target's ``load()`` gives ``translate(accuracy_level)`` -> the function."""

    def add(fn: Callable) -> Callable:
        build = functools.lru_cache(maxsize=None)(fn) if by_accuracy_level else (lambda _level: fn)
        implement("onnx", name, load=lambda: build, kind="translation", label=label)
        return fn

    return add


_P, _OPTIONAL, _A = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional, OpSchema.Attribute
_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]


def _gqa_schema() -> OpSchema:
    """The subset of ORT's GroupQueryAttention schema we use: float caches, no quantization."""
    P, opt, A, floats = _P, _OPTIONAL, _A, _FLOATS
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
    return OpSchema(
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


def _nbits_schema() -> OpSchema:
    """ORT's MatMulNBits: uint8 blocks, scales, optional zero points, g_idx and bias."""
    P, opt, A = _P, _OPTIONAL, _A
    return OpSchema(
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


def _gather_schema() -> OpSchema:
    """ORT's GatherBlockQuantized: rows of a block-quantized uint8 table, dequantized."""
    P, opt, A = _P, _OPTIONAL, _A
    return OpSchema(
        "GatherBlockQuantized",
        "com.microsoft",
        MSFT_OPSET,
        inputs=[P("data", "T1"), P("indices", "Tind"), P("scales", "T2"), P("zero_points", "T1", param_option=opt)],
        outputs=[P("output", "T2")],
        type_constraints=[
            ("T1", ["tensor(uint8)"], ""),
            ("T2", _FLOATS, ""),
            ("Tind", ["tensor(int32)", "tensor(int64)"], ""),
        ],
        attributes=[
            A("gather_axis", OpSchema.AttrType.INT, "", required=False),
            A("quantize_axis", OpSchema.AttrType.INT, "", required=False),
            A("block_size", OpSchema.AttrType.INT, "", required=False),
            A("bits", OpSchema.AttrType.INT, "", required=False),
        ],
    )


def _register_contrib_schemas() -> None:
    """Teach onnx (and so onnxscript and the checker) the contrib op signatures we emit."""
    # once per process (and not over a schema another library registered)
    for schema in (_gqa_schema(), _nbits_schema(), _gather_schema()):
        if not onnx.defs.has(schema.name, schema.domain):
            onnx.defs.register_schema(schema)


_register_contrib_schemas()
msft = onnxscript.values.Opset("com.microsoft", MSFT_OPSET)


def _static_dim(value, dim: int) -> int:
    """A dimension of an exported value that must be static (an expert count, a width)."""
    size = value.shape[dim] if value.shape is not None else None
    if not isinstance(size, int):
        raise BackendError(f"ONNX export needs a static size for dim {dim} of {value.name}, got {size!r}")
    return size


def nbits(a, B, scales, zero_points, group_corr, K, N, bits, block_size, accuracy_level):
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


@onnx_translation("matmul_nbits", "com.microsoft::MatMulNBits", by_accuracy_level=True)
def matmul_nbits_at(accuracy_level: int):
    """``matmul_nbits`` with MatMulNBits at ``accuracy_level``."""

    def matmul_nbits(x, B, scales, zero_points, perm=None, group_corr=None, bias=None, K=0, N=0, bits=4, block_size=32):
        a = x if perm is None else op.Gather(x, perm, axis=-1)
        y = nbits(a, B, scales, zero_points, group_corr, K, N, bits, block_size, accuracy_level)
        return y if bias is None else op.Add(y, bias)

    return matmul_nbits


@onnx_translation("gather_block_quantized", "com.microsoft::GatherBlockQuantized")
def gather_block_quantized(ids, data, scales, zero_points, order=None, K=0, bits=4, block_size=32):
    """Rows ``ids`` of a table in MatMulNBits' bytes ``[V, blocks, block·bits/8]``: each block's row
    one quantization block (``quantize_axis=2``), flattened to ``[*ids, blocks·block]``, a padded
    last block cut to ``K``, act-order columns put back by ``order``."""
    y = msft.GatherBlockQuantized(
        data, ids, scales, zero_points, gather_axis=0, quantize_axis=2, block_size=block_size, bits=bits
    )
    y = op.Reshape(y, op.Concat(op.Shape(ids), op.Constant(value_ints=[-1]), axis=0))
    if _static_dim(data, 1) * block_size != K:
        y = op.Slice(y, op.Constant(value_ints=[0]), op.Constant(value_ints=[K]), op.Constant(value_ints=[-1]))
    return y if order is None else op.Gather(y, order, axis=-1)


@onnx_translation("experts_matmul_nbits", "MatMulNBits per expert", by_accuracy_level=True)
def experts_matmul_nbits_at(accuracy_level: int):
    """``experts_matmul_nbits`` with MatMulNBits at ``accuracy_level``."""

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
                accuracy_level,
            )

        return by_expert(x, offsets, _static_dim(B, 0), N, one)

    return experts_matmul_nbits


@onnx_translation("experts_matmul", "MatMul per expert")
def experts_matmul(x, offsets, weight):
    return by_expert(
        x, offsets, _static_dim(weight, 0), _static_dim(weight, 2), lambda rows, e: op.MatMul(rows, pick(weight, e))
    )


@onnx_translation("gathered_outlier_linear", "Gather + MatMul")
def gathered_outlier_linear(x, cols, block_t):
    return op.MatMul(op.Gather(x, cols, axis=-1), block_t)


@onnx_translation("experts_gathered_outlier_linear", "Gather + MatMul per expert")
def experts_gathered_outlier_linear(x, offsets, cols, block_t, sizes=()):
    bounds = [0, *itertools.accumulate(sizes)]

    def one(rows, e):
        part = op.Constant(value_ints=[bounds[e]]), op.Constant(value_ints=[bounds[e + 1]])
        return gathered_outlier_linear(rows, op.Slice(cols, *part), op.Slice(block_t, *part))

    return by_expert(x, offsets, len(sizes), _static_dim(block_t, 1), one)


@onnx_translation("int8_linear", "MatMulInteger with per-token scales")
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
    wu = op.Cast(op.Add(op.Cast(op.Transpose(weight, perm=[1, 0]), to=FLOAT), op.Constant(value_float=128.0)), to=UINT8)
    acc = op.MatMulInteger(qu, wu, zero, zero)
    y = op.Mul(op.Mul(op.Cast(acc, to=FLOAT), sx), weight_scale)
    return y if bias is None else op.Add(y, bias)


@onnx_translation("kv_cache_attention", "com.microsoft::GroupQueryAttention")
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
