"""``qc.quant_embedding`` lowered for ONNX export: ONNX Runtime's ``GatherBlockQuantized``
(com.microsoft) over the table in ``MatMulNBits``' byte layout.

The table's codes are re-packed exactly as a ``qc.quant_linear`` over the same stored tensors is
(``onnx_nbits.gptq_to_nbits``: ``B`` uint8 ``[vocabulary, blocks, block·bits/8]``, 3-bit codes
widened to 4), and ``GatherBlockQuantized`` reads that ``B`` as it is (``quantize_axis=2``: each row
of a block one quantization block), so a tied head's ``MatMulNBits`` and the lookup share one
initializer — the table is stored once in the ONNX file too, as onnxruntime-genai's own builder
shares it. Its scales and zero points are the same values shaped ``[vocabulary, blocks, 1]``
(a few MB). Act-order columns are put back in order after the lookup (a Gather on the last dim);
a group no ``MatMulNBits`` block tiles exports the dequantized table (fp32) with a note.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.fx import GraphModule, Node

from qcompiler.backends.onnx_nbits import block_zero_codes, dequantize_matmul_nbits, gptq_to_nbits
from qcompiler.ir.graph import aten
from qcompiler.ir.op_registry import OpArgs, OpSpec, call_op, implement, register
from qcompiler.ir.tensors import set_tensor
from qcompiler.layouts.gptq import GPTQ_TENSORS, dequantize_gptq

__all__ = ["gather_block_quantized", "lower_quant_embedding"]


@torch.library.custom_op("qc::gather_block_quantized", mutates_args=())
def gather_block_quantized(
    ids: Tensor,
    data: Tensor,
    scales: Tensor,
    zero_points: Tensor,
    order: Optional[Tensor],
    K: int,
    bits: int,
    block_size: int,
) -> Tensor:
    """GatherBlockQuantized's definition (``gather_axis=0``, ``quantize_axis=2``) on rows ``ids`` of
    ``data`` ``[V, blocks, block·bits/8]``, ``scales`` / ``zero_points`` ``[V, blocks, 1]``: float32
    ``[*ids, K]`` (a padded last block cut to ``K``), columns taken in ``order`` when given."""
    flat = ids.reshape(-1).long()
    n = flat.numel()
    # the gathered rows are a MatMulNBits weight of n rows, with its zero points unpacked (as floats)
    values = dequantize_matmul_nbits(
        data.index_select(0, flat),
        scales.index_select(0, flat),
        zero_points.index_select(0, flat).float(),
        K,
        n,
        bits,
        block_size,
    )
    if order is not None:
        values = values.index_select(1, order.long())
    return values.reshape(*ids.shape, K)


@gather_block_quantized.register_fake
def _gather_block_quantized_fake(ids, data, scales, zero_points, order, K, bits, block_size):
    return scales.new_empty((*ids.shape, K), dtype=torch.float32)


def lower_quant_embedding(gm: GraphModule, a: OpArgs, path: str, notes: list) -> Node:
    """The nodes computing ``qc.quant_embedding`` in ONNX Runtime's layout; returns the last one.
    ``B`` is stored under the name a tied head's ``MatMulNBits`` lowering gives it (both derive the
    name from the table's stored tensors), so the file holds it once."""
    graph = gm.graph
    stored = a.tensors(gm, *GPTQ_TENSORS)
    lowered = gptq_to_nbits(*stored, a.bits, a.group_size)
    if lowered is None:
        set_tensor(gm, f"{path}.onnx_table", dequantize_gptq(*stored, a.bits).contiguous())
        out = graph.call_function(aten.embedding.default, (graph.get_attr(f"{path}.onnx_table"), a.ids))
        notes.append(
            f"{path}: group size {a.group_size} has no GatherBlockQuantized block size; exported as an fp32 table"
        )
    else:
        tensors, perm, k, n, bits, block = lowered
        blocks = tensors["B"].shape[1]
        set_tensor(gm, f"{path}.onnx_B", tensors["B"])
        set_tensor(gm, f"{path}.onnx_gather_scales", tensors["scales"].reshape(n, blocks, 1).contiguous())
        zeros = block_zero_codes(tensors["zero_points"], n, blocks, bits).to(torch.uint8)
        set_tensor(gm, f"{path}.onnx_gather_zero_points", zeros.reshape(n, blocks, 1).contiguous())
        order = None
        if perm is not None:
            set_tensor(gm, f"{path}.onnx_gather_order", torch.argsort(perm))
            order = graph.get_attr(f"{path}.onnx_gather_order")
        out = call_op(
            graph,
            "gather_block_quantized",
            ids=a.ids,
            data=graph.get_attr(f"{path}.onnx_B"),
            scales=graph.get_attr(f"{path}.onnx_gather_scales"),
            zero_points=graph.get_attr(f"{path}.onnx_gather_zero_points"),
            order=order,
            K=k,
            bits=bits,
            block_size=block,
        )
    if a.out_dtype == torch.float32:
        return out
    return graph.call_function(aten._to_copy.default, (out,), {"dtype": a.out_dtype})


register(OpSpec("gather_block_quantized", export_only="onnx"))  # export-only layout (never saved)
implement("onnx", "quant_embedding", lower_quant_embedding, kind="lowering", label="GatherBlockQuantized")
