"""Re-packing the quantized graph into ONNX Runtime's layouts, before export.

ONNX translation functions see symbolic values, not tensor data, so layout conversion happens
here, on a copy of the graph, as ops with their own torch references (tested against the
``qc`` ops they replace):

- ``qc.quant_linear`` and SpQR's dense branch → ``qc.matmul_nbits``, ORT's ``MatMulNBits``
  layout: ``B`` uint8 ``[N, K/block, block·bits/8]`` (first value in the low bits), ``scales``
  ``[N·K/block]``, uint8-packed integer zero points. SpQR's fractional zeros are split into the
  nearest integer plus a per-block correction (ORT's float zero-point path is ~10x slower).
  Act-order columns are permuted once here and the input is gathered (``perm``). 3-bit codes are
  widened to 4 bits (ORT has no 3-bit kernel): same values, 4/3 of the code bytes.
- ``qc.sparse_outlier_linear`` → ``qc.gathered_outlier_linear``: only the columns that hold
  outliers are gathered from the input and multiplied by a small dense ``[k, N]`` block.
"""
from __future__ import annotations

import copy
import math
from typing import Optional

import torch
from torch import Tensor
from torch.fx import GraphModule

from qcompiler.graph import contiguous_before_reshape, set_tensor
from qcompiler.op_registry import OpArgs, OpSpec, args_of, call_op, quantized_layer_path, register
from qcompiler.ops import GPTQ_TENSORS, dequantize_gptq, spqr_group_stats
from qcompiler.algorithms.packing import pack_rows, unpack_cols, unpack_rows

__all__ = ["to_matmul_nbits_layout", "dequantize_matmul_nbits", "lower_for_onnx", "matmul_nbits",
           "gathered_outlier_linear"]


def _pack_bytes(codes: Tensor, bits: int) -> Tensor:
    """[N, K] codes → uint8 [N, K·bits/8], little-endian bit stream along K."""
    n, k = codes.shape
    pad = (-k) % (32 // bits)
    if pad:
        codes = torch.cat([codes, torch.zeros(n, pad, dtype=codes.dtype)], dim=1)
    words = pack_rows(codes.t().contiguous().long(), bits).t().contiguous()  # [N, K·bits/32] int32
    return words.reshape(-1).view(torch.uint8).reshape(n, -1)[:, : math.ceil(k * bits / 8)]


def _unpack_bytes(data: Tensor, bits: int, k: int) -> Tensor:
    n = data.shape[0]
    pad = (-data.shape[1]) % 4
    data = torch.cat([data, torch.zeros(n, pad, dtype=torch.uint8)], dim=1) if pad else data
    words = data.contiguous().reshape(-1).view(torch.int32).reshape(n, -1).t()
    total = words.shape[0] * 32 // bits
    return unpack_rows(words, bits, total).t()[:, :k]


def to_matmul_nbits_layout(codes: Tensor, scales: Tensor, zeros: Tensor, bits: int, block_size: int,
                           float_zeros: bool) -> dict[str, Tensor]:
    """Codes [N, K] and per-block scales/zeros [N, ceil(K/block)] (columns already in processing
    order). A K that is not a multiple of the block pads the last block with zero codes, as
    MatMulNBits defines (``n_blocks_per_col = ceil(K / block_size)``)."""
    n, k = codes.shape
    blocks = -(-k // block_size)
    if blocks * block_size != k:
        codes = torch.cat([codes, codes.new_zeros(n, blocks * block_size - k)], dim=1)
    b = _pack_bytes(codes, bits).reshape(n, blocks, block_size * bits // 8)
    zp = zeros.float().reshape(-1) if float_zeros else _pack_bytes(zeros.round().to(torch.int64), bits).reshape(-1)
    return {"B": b.contiguous(), "scales": scales.float().reshape(-1).contiguous(), "zero_points": zp.contiguous()}


def dequantize_matmul_nbits(B: Tensor, scales: Tensor, zero_points: Tensor, K: int, N: int, bits: int,
                            block_size: int) -> Tensor:
    """The float32 weight [N, K] that a MatMulNBits node computes with (ORT's definition; the last
    block may be partial)."""
    blocks = -(-K // block_size)
    codes = _unpack_bytes(B.reshape(N, -1), bits, K).float()
    s = scales.float().reshape(N, blocks).repeat_interleave(block_size, dim=1)[:, :K]
    if zero_points.dtype == torch.uint8:
        z = _unpack_bytes(zero_points.reshape(N, -1), bits, blocks).float()
    else:
        z = zero_points.float().reshape(N, blocks)
    return (codes - z.repeat_interleave(block_size, dim=1)[:, :K]) * s


@torch.library.custom_op("qc::matmul_nbits", mutates_args=())
def matmul_nbits(x: Tensor, B: Tensor, scales: Tensor, zero_points: Tensor, perm: Optional[Tensor],
                 group_corr: Optional[Tensor], bias: Optional[Tensor], K: int, N: int, bits: int,
                 block_size: int) -> Tensor:
    """ORT MatMulNBits semantics (after gathering input columns by ``perm`` when given), plus
    ``(per-block sums of x) @ group_corr`` when zero points were fractional."""
    if perm is not None:
        x = x[..., perm.long()]
    w = dequantize_matmul_nbits(B, scales, zero_points, K, N, bits, block_size).to(x.dtype)
    y = x @ w.t()
    if group_corr is not None:
        y = y + x.reshape(*x.shape[:-1], K // block_size, block_size).sum(-1) @ group_corr.to(x.dtype)
    return y if bias is None else y + bias.to(x.dtype)


@matmul_nbits.register_fake
def _matmul_nbits_fake(x, B, scales, zero_points, perm, group_corr, bias, K, N, bits, block_size):
    return x.new_empty((*x.shape[:-1], N))


@torch.library.custom_op("qc::gathered_outlier_linear", mutates_args=())
def gathered_outlier_linear(x: Tensor, cols: Tensor, block_t: Tensor) -> Tensor:
    """Outlier product as ``x[..., cols] @ block_t`` with ``block_t`` [k, N] dense (zeros elsewhere)."""
    return x[..., cols.long()] @ block_t.to(x.dtype)


@gathered_outlier_linear.register_fake
def _gathered_fake(x, cols, block_t):
    return x.new_empty((*x.shape[:-1], block_t.shape[1]))


register(OpSpec("matmul_nbits"))             # export-only layouts: never counted, never saved
register(OpSpec("gathered_outlier_linear"))


def _block_size_for(group: int, k: int) -> Optional[int]:
    """The MatMulNBits block (a power of two >= 16) that tiles ``group`` (a shorter last group
    becomes the padded last block); per-channel: 128 (every block of a row has its scale).
    None if no block tiles the group."""
    if group == -1:
        return 128
    for b in (128, 64, 32, 16):
        if group % b == 0:
            return b
    return None


def _sorted_groups(g_idx: Tensor) -> Optional[Tensor]:
    """The permutation that makes groups contiguous (None if they already are)."""
    if bool((g_idx[1:] >= g_idx[:-1]).all()):
        return None
    return torch.argsort(g_idx.long(), stable=True)


def _gptq_to_nbits(gm, a: OpArgs) -> Optional[tuple]:
    qweight, qzeros, scales, g_idx = a.tensors(gm, *GPTQ_TENSORS)
    bits, group = a.bits, a.group_size
    k, n = g_idx.numel(), scales.shape[1]
    block = _block_size_for(group, k)
    if block is None:
        return None
    codes = unpack_rows(qweight, bits, k).t()                     # [N, K]
    zeros = unpack_cols(qzeros, bits, n).t()                      # [N, groups]
    perm = _sorted_groups(g_idx)
    order = perm if perm is not None else torch.arange(k)
    g = g_idx.long()[order]
    col_scale = scales.float().t()[:, g]                          # [N, K] per column, processing order
    col_zero = zeros[:, g]
    pick = torch.arange(0, k, block)
    out_bits = 4 if bits == 3 else bits
    tensors = to_matmul_nbits_layout(codes[:, order], col_scale[:, pick], col_zero[:, pick], out_bits, block, False)
    return tensors, perm, k, n, out_bits, block


def _spqr_to_nbits(gm, a: OpArgs) -> tuple:
    codes, scale_codes, zero_codes, scale_stats, zero_stats, perm = a.tensors(
        gm, "codes", "scale_codes", "zero_codes", "scale_stats", "zero_stats", "perm")
    bits, group, stat_bits, stat_group = a.bits, a.group_size, a.stat_bits, a.stat_group_size
    k, n = perm.numel(), scale_stats.shape[1] * stat_group
    s = spqr_group_stats(scale_codes, scale_stats, stat_bits, stat_group).clamp(min=1e-8).t()   # [N, groups]
    z = spqr_group_stats(zero_codes, zero_stats, stat_bits, stat_group).t()
    q = unpack_rows(codes, bits, k).t()                           # [N, K] processing order
    out_bits = 4 if bits == 3 else bits
    # ORT's float zero-point path is ~10x slower than its uint8 one, so split the fractional zero:
    # s·(q − z) = s·(q − round(z)) + s·(round(z) − z), the last term a per-block constant.
    z_int = z.round().clamp(0, 2 ** out_bits - 1)
    tensors = to_matmul_nbits_layout(q, s, z_int, out_bits, group, False)
    tensors["group_corr"] = (s * (z_int - z)).t().contiguous()   # [groups, N]
    ident = bool((perm.long() == torch.arange(k)).all())
    return tensors, None if ident else perm.long(), k, n, out_bits, group


def _lower_dense(gm: GraphModule, a: OpArgs, path: str, notes: list[str]):
    """GPTQ / SpQR dense branch -> ``qc.matmul_nbits`` (or an fp32 MatMul when no block fits)."""
    is_gptq = a.spec.name == "quant_linear"
    lowered = _gptq_to_nbits(gm, a) if is_gptq else _spqr_to_nbits(gm, a)
    graph = gm.graph
    if lowered is None:
        w = dequantize_gptq(*a.tensors(gm, *GPTQ_TENSORS), a.bits)
        set_tensor(gm, f"{path}.onnx_weight_t", w.t().contiguous())
        new = graph.call_function(torch.ops.aten.matmul.default, (a.x, graph.get_attr(f"{path}.onnx_weight_t")))
        if a.bias is not None:
            new = graph.call_function(torch.ops.aten.add.Tensor, (new, a.bias))
        notes.append(f"{path}: group size {a.group_size} has no MatMulNBits block size; exported as fp32 MatMul")
        return new
    tensors, perm, k, n, nbits, block = lowered
    if perm is not None:
        tensors["perm"] = perm
    for name, t in tensors.items():
        set_tensor(gm, f"{path}.onnx_{name}", t)
    attrs = {name: graph.get_attr(f"{path}.onnx_{name}") for name in tensors}
    return call_op(graph, "matmul_nbits", x=a.x, B=attrs["B"], scales=attrs["scales"],
                   zero_points=attrs["zero_points"], perm=attrs.get("perm"), group_corr=attrs.get("group_corr"),
                   bias=a.bias, K=k, N=n, bits=nbits, block_size=block)


def _lower_outliers(gm: GraphModule, a: OpArgs, path: str, notes: list[str]):
    """SpQR's CSR outliers -> ``qc.gathered_outlier_linear`` over the columns that hold any."""
    row_ptr, col_idx, values = a.tensors(gm, "row_ptr", "col_idx", "values")
    n_out = a.out_features
    rows = torch.repeat_interleave(torch.arange(n_out), (row_ptr[1:] - row_ptr[:-1]).long())
    cols = torch.unique(col_idx.long())
    block_t = torch.zeros(max(cols.numel(), 1), n_out)
    if cols.numel():
        where = torch.searchsorted(cols, col_idx.long())
        block_t[where, rows] = values.float()
    else:
        cols = torch.zeros(1, dtype=torch.long)
    set_tensor(gm, f"{path}.onnx_cols", cols)
    set_tensor(gm, f"{path}.onnx_block_t", block_t)
    return call_op(gm.graph, "gathered_outlier_linear", x=a.x, cols=gm.graph.get_attr(f"{path}.onnx_cols"),
                   block_t=gm.graph.get_attr(f"{path}.onnx_block_t"))


_LOWERINGS = {torch.ops.qc.quant_linear.default: _lower_dense, torch.ops.qc.spqr_dense_linear.default: _lower_dense,
              torch.ops.qc.sparse_outlier_linear.default: _lower_outliers}


def lower_for_onnx(gm: GraphModule) -> tuple[GraphModule, list[str]]:
    """A copy of ``gm`` with every quantized op in an ORT-ready layout; notes on fallbacks taken."""
    gm = copy.deepcopy(gm)
    graph, notes = gm.graph, []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _LOWERINGS:
            continue
        a = args_of(node)
        path = quantized_layer_path(a)
        with graph.inserting_before(node):
            new = _LOWERINGS[node.target](gm, a, path, notes)
        new.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "val")})
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    contiguous_before_reshape(graph)
    graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm, notes
