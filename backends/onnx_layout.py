"""Re-packing the quantized graph into ONNX Runtime's layouts, before export.

ONNX translation functions see symbolic values, not tensor data, so layout conversion happens
here, on a copy of the graph, as ops with their own torch references (tested against the
``qc`` ops they replace):

- ``qc.quant_linear`` and SpQR's dense branch → ``qc.matmul_nbits`` (``onnx_nbits.py``). SpQR's
  fractional zeros are split into the nearest integer plus a per-block correction (ORT's float
  zero-point path is ~10x slower). Act-order columns are permuted once here and the input is
  gathered (``perm``). 3-bit codes are widened to 4 bits (ORT has no 3-bit kernel): same values,
  4/3 of the code bytes.
- ``qc.gguf_linear`` (llama.cpp's block bytes) → ``qc.matmul_nbits`` the same way: an integer zero
  point per sub-block plus a per-block correction for the rest of its free minimum; 5- and 6-bit
  codes as 8-bit.
- ``qc.quant_experts_linear`` → ``qc.experts_matmul_nbits`` (each expert's matrix re-packed the
  same way, stacked); a full-precision grouped matmul over 3-D expert weights → ``qc.experts_matmul``.
- ``qc.sparse_outlier_linear`` → ``qc.gathered_outlier_linear``: only the columns that hold
  outliers are gathered from the input and multiplied by a small dense ``[k, N]`` block.
- ``qc.spqr_experts_linear`` → ``qc.experts_matmul_nbits`` (each expert's dense branch as above)
  plus ``qc.experts_gathered_outlier_linear`` (each expert's own outlier columns and block).
- ``qc.quant_embedding`` → ``qc.gather_block_quantized`` (``onnx_embedding.py``: GatherBlockQuantized
  over the table's MatMulNBits bytes, which a tied head shares).
- ``qc.matmul_nbits`` nodes that read one input (q/k/v; gate/up) → one node over the stacked
  tensors and a split (``onnx_siblings.py``).
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import Tensor
from torch.fx import GraphModule

from qcompiler.algorithms.gguf_bytes import unpack
from qcompiler.algorithms.gguf_grids import BY_NAME, sub_block_grid
from qcompiler.algorithms.packing import unpack_rows
from qcompiler.backends import onnx_embedding, onnx_hadamard  # noqa: F401  (register their lowerings)
from qcompiler.backends.onnx_nbits import gptq_to_nbits, to_matmul_nbits_layout
from qcompiler.backends.onnx_siblings import fuse_sibling_nbits
from qcompiler.ir.experts import find_expert_linears
from qcompiler.ir.graph import contiguous_before_reshape
from qcompiler.ir.op_registry import (
    OpArgs,
    OpSpec,
    args_of,
    call_op,
    implement,
    implementation,
    quantized_layer_path,
    refuse,
    register,
    register_target,
    spec_of,
)
from qcompiler.ir.ops import per_expert
from qcompiler.ir.tensors import set_tensor
from qcompiler.layouts.gptq import GPTQ_TENSORS, dequantize_gptq
from qcompiler.layouts.spqr import SPQR_DENSE_TENSORS, expert_csr, spqr_group_stats

__all__ = ["lower_for_onnx", "gathered_outlier_linear", "experts_gathered_outlier_linear", "spqr_to_nbits"]


@torch.library.custom_op("qc::gathered_outlier_linear", mutates_args=())
def gathered_outlier_linear(x: Tensor, cols: Tensor, block_t: Tensor) -> Tensor:
    """Outlier product as ``x[..., cols] @ block_t`` with ``block_t`` [k, N] dense (zeros elsewhere)."""
    return x[..., cols.long()] @ block_t.to(x.dtype)


@gathered_outlier_linear.register_fake
def _gathered_fake(x, cols, block_t):
    return x.new_empty((*x.shape[:-1], block_t.shape[1]))


@torch.library.custom_op("qc::experts_gathered_outlier_linear", mutates_args=())
def experts_gathered_outlier_linear(
    x: Tensor, offsets: Tensor, cols: Tensor, block_t: Tensor, sizes: list[int]
) -> Tensor:
    """Per expert (rows sorted by expert), ``gathered_outlier_linear`` with its own columns and block:
    expert ``e``'s are the ``sizes[e]`` entries of ``cols`` / rows of ``block_t`` after those of ``0..e-1``."""
    bounds = [0, *itertools.accumulate(sizes)]
    return per_expert(
        x,
        offsets,
        block_t.shape[1],
        lambda rows, e: gathered_outlier_linear(
            rows, cols[bounds[e] : bounds[e + 1]], block_t[bounds[e] : bounds[e + 1]]
        ),
    )


@experts_gathered_outlier_linear.register_fake
def _experts_gathered_fake(x, offsets, cols, block_t, sizes):
    return x.new_empty((x.shape[0], block_t.shape[1]))


register(OpSpec("gathered_outlier_linear", export_only="onnx"))  # export-only (the artifact writer refuses it)
register(OpSpec("experts_gathered_outlier_linear", export_only="onnx"))


def spqr_to_nbits(
    codes: Tensor,
    scale_codes: Tensor,
    zero_codes: Tensor,
    scale_stats: Tensor,
    zero_stats: Tensor,
    perm: Tensor,
    bits: int,
    group: int,
    stat_bits: int,
    stat_group: int,
) -> tuple:
    """One SpQR dense branch in MatMulNBits' layout (``gptq_to_nbits``'s tuple, plus ``group_corr``)."""
    k, n = perm.numel(), scale_stats.shape[1] * stat_group
    s = spqr_group_stats(scale_codes, scale_stats, stat_bits, stat_group).clamp(min=1e-8).t()  # [N, groups]
    z = spqr_group_stats(zero_codes, zero_stats, stat_bits, stat_group).t()
    q = unpack_rows(codes, bits, k).t()  # [N, K] processing order
    out_bits = 4 if bits == 3 else bits
    # ORT's float zero-point path is ~10x slower than its uint8 one, so split the fractional zero:
    # s·(q − z) = s·(q − round(z)) + s·(round(z) − z), the last term a per-block constant.
    z_int = z.round().clamp(0, 2**out_bits - 1)
    tensors = to_matmul_nbits_layout(q, s, z_int, out_bits, group, False)
    tensors["group_corr"] = (s * (z_int - z)).t().contiguous()  # [groups, N]
    ident = bool((perm.long() == torch.arange(k)).all())
    return tensors, None if ident else perm.long(), k, n, out_bits, group


def _lower_gptq(gm: GraphModule, a: OpArgs, path: str, notes: list[str]):
    """GPTQ / RTN layer -> ``qc.matmul_nbits`` (or an fp32 MatMul when no block fits)."""
    return _nbits_node(gm, a, path, notes, gptq_to_nbits(*a.tensors(gm, *GPTQ_TENSORS), a.bits, a.group_size))


def _lower_spqr_dense(gm: GraphModule, a: OpArgs, path: str, notes: list[str]):
    """SpQR's dense branch -> ``qc.matmul_nbits`` with its fractional-zero correction."""
    return _nbits_node(
        gm,
        a,
        path,
        notes,
        spqr_to_nbits(*a.tensors(gm, *SPQR_DENSE_TENSORS), a.bits, a.group_size, a.stat_bits, a.stat_group_size),
    )


def gguf_to_nbits(blocks: Tensor, block_type: str, in_features: int) -> tuple:
    """llama.cpp block bytes in MatMulNBits' layout (``gptq_to_nbits``'s tuple, plus ``group_corr``): the
    codes with an integer zero point per sub-block, and what is left of the offset as a per-block
    constant, ``scale·q − offset = scale·(q − z) + (scale·z − offset)`` (zero for the symmetric types).
    5- and 6-bit codes travel as 8-bit, 3-bit as 4-bit (the widths MatMulNBits runs)."""
    codes, grid = unpack(block_type, blocks, in_features)  # [N, K]
    scale, offset = sub_block_grid(grid)  # [N, sub-blocks]
    fmt = BY_NAME[block_type]
    out_bits = {3: 4, 5: 8, 6: 8}.get(fmt.bits, fmt.bits)
    safe = torch.where(scale != 0, scale, torch.ones_like(scale))
    z = torch.where(scale != 0, (offset / safe).round().clamp(0, 2**out_bits - 1), torch.zeros_like(scale))
    tensors = to_matmul_nbits_layout(codes, scale, z, out_bits, fmt.sub_block, False)
    tensors["group_corr"] = (scale * z - offset).t().contiguous()  # [sub-blocks, N]
    return tensors, None, in_features, codes.shape[0], out_bits, fmt.sub_block


def _lower_gguf(gm: GraphModule, a: OpArgs, path: str, notes: list[str]):
    """``qc.gguf_linear`` (llama.cpp's bytes) -> ``qc.matmul_nbits`` with a per-block correction."""
    return _nbits_node(gm, a, path, notes, gguf_to_nbits(a.tensor(gm, "blocks"), a.block_type, int(a.in_features)))


def _nbits_node(gm: GraphModule, a: OpArgs, path: str, notes: list[str], lowered):
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
    return call_op(
        graph,
        "matmul_nbits",
        x=a.x,
        B=attrs["B"],
        scales=attrs["scales"],
        zero_points=attrs["zero_points"],
        perm=attrs.get("perm"),
        group_corr=attrs.get("group_corr"),
        bias=a.bias,
        K=k,
        N=n,
        bits=nbits,
        block_size=block,
    )


def _gathered_block(row_ptr: Tensor, col_idx: Tensor, values: Tensor, n_out: int) -> tuple[Tensor, Tensor]:
    """A CSR matrix as (the columns that hold any entry, their dense ``[k, N]`` block); one zero
    column when there is none (ONNX has no empty MatMul)."""
    rows = torch.repeat_interleave(torch.arange(n_out), (row_ptr[1:] - row_ptr[:-1]).long())
    cols = torch.unique(col_idx.long())
    block_t = torch.zeros(max(cols.numel(), 1), n_out)
    if cols.numel():
        where = torch.searchsorted(cols, col_idx.long())
        block_t[where, rows] = values.float()
    else:
        cols = torch.zeros(1, dtype=torch.long)
    return cols, block_t


def _lower_outliers(gm: GraphModule, a: OpArgs, path: str, notes: list[str]):
    """SpQR's CSR outliers -> ``qc.gathered_outlier_linear`` over the columns that hold any."""
    cols, block_t = _gathered_block(*a.tensors(gm, "row_ptr", "col_idx", "values"), a.out_features)
    set_tensor(gm, f"{path}.onnx_cols", cols)
    set_tensor(gm, f"{path}.onnx_block_t", block_t)
    return call_op(
        gm.graph,
        "gathered_outlier_linear",
        x=a.x,
        cols=gm.graph.get_attr(f"{path}.onnx_cols"),
        block_t=gm.graph.get_attr(f"{path}.onnx_block_t"),
    )


def _stacked_nbits(gm: GraphModule, path: str, lowered: list[tuple]) -> dict:
    """Per-expert MatMulNBits tensors stacked on a leading expert dim and stored beside ``path``:
    the ``experts_matmul_nbits`` arguments (``perm`` only when some expert has one)."""
    _, _, k, n, nbits, block = lowered[0]
    tensors = {name: torch.stack([lw[0][name] for lw in lowered]) for name in lowered[0][0]}
    if any(lw[1] is not None for lw in lowered):
        tensors["perm"] = torch.stack([lw[1] if lw[1] is not None else torch.arange(k) for lw in lowered])
    for name, t in tensors.items():
        set_tensor(gm, f"{path}.onnx_{name}", t.contiguous())
    return dict(
        {name: gm.graph.get_attr(f"{path}.onnx_{name}") for name in tensors}, K=k, N=n, bits=nbits, block_size=block
    )


def _lower_spqr_experts(gm: GraphModule, a: OpArgs, path: str, notes: list[str]):
    """SpQR experts -> each expert's dense branch as MatMulNBits (``qc.experts_matmul_nbits``) plus its
    outliers as a gathered block (``qc.experts_gathered_outlier_linear``)."""
    stacked = a.tensors(gm, *SPQR_DENSE_TENSORS)
    experts = range(stacked[0].shape[0])
    lowered = [
        spqr_to_nbits(*(t[e] for t in stacked), a.bits, a.group_size, a.stat_bits, a.stat_group_size) for e in experts
    ]
    dense = call_op(gm.graph, "experts_matmul_nbits", x=a.x, offsets=a.offsets, **_stacked_nbits(gm, path, lowered))
    n_out = a.tensor(gm, "scale_stats").shape[-2] * a.stat_group_size
    csr = a.tensors(gm, "row_ptr", "col_idx", "values")
    blocks = [_gathered_block(*expert_csr(*csr, e), n_out) for e in experts]
    set_tensor(gm, f"{path}.onnx_cols", torch.cat([cols for cols, _ in blocks]))
    set_tensor(gm, f"{path}.onnx_block_t", torch.cat([block for _, block in blocks]))
    sparse = call_op(
        gm.graph,
        "experts_gathered_outlier_linear",
        x=a.x,
        offsets=a.offsets,
        cols=gm.graph.get_attr(f"{path}.onnx_cols"),
        block_t=gm.graph.get_attr(f"{path}.onnx_block_t"),
        sizes=[cols.numel() for cols, _ in blocks],
    )
    return gm.graph.call_function(torch.ops.aten.add.Tensor, (dense, sparse))


def _lower_experts(gm: GraphModule, a: OpArgs, path: str, notes: list[str]):
    """GPTQ-layout experts -> ``qc.experts_matmul_nbits`` (or ``qc.experts_matmul`` on the
    dequantized weights when no MatMulNBits block fits)."""
    stacked = a.tensors(gm, *GPTQ_TENSORS)
    experts = [gptq_to_nbits(*(t[e] for t in stacked), a.bits, a.group_size) for e in range(stacked[0].shape[0])]
    graph = gm.graph
    if any(lowered is None for lowered in experts):
        w = torch.stack([dequantize_gptq(*(t[e] for t in stacked), a.bits).t() for e in range(stacked[0].shape[0])])
        set_tensor(gm, f"{path}.onnx_weight", w.contiguous())  # [E, in, out]
        notes.append(f"{path}: group size {a.group_size} has no MatMulNBits block size; exported as fp32 MatMul")
        return call_op(graph, "experts_matmul", x=a.x, offsets=a.offsets, weight=graph.get_attr(f"{path}.onnx_weight"))
    return call_op(graph, "experts_matmul_nbits", x=a.x, offsets=a.offsets, **_stacked_nbits(gm, path, experts))


def _swap(graph, old, make) -> None:
    """Replace node ``old`` by the node ``make()`` builds in front of it (keeping its metadata)."""
    with graph.inserting_before(old):
        new = make()
    new.meta.update({k: v for k, v in old.meta.items() if k in ("nn_module_stack", "val")})
    old.replace_all_uses_with(new)
    graph.erase_node(old)


register_target(
    "onnx",
    "ONNX export (the onnxruntime backend, onnx and onnx-genai exports): each op is lowered "
    "to ONNX Runtime's layouts here or translated to ONNX ops in onnx_export.py",
)
implement("onnx", "quant_linear", _lower_gptq, kind="lowering", label="MatMulNBits")
implement("onnx", "spqr_dense_linear", _lower_spqr_dense, kind="lowering", label="MatMulNBits + block correction")
implement("onnx", "sparse_outlier_linear", _lower_outliers, kind="lowering", label="Gather + MatMul")
implement("onnx", "quant_experts_linear", _lower_experts, kind="lowering", label="MatMulNBits per expert")
implement("onnx", "gguf_linear", _lower_gguf, kind="lowering", label="MatMulNBits + block correction")
for _op, _what in (("fp8_linear", "FP8"), ("nvfp4_linear", "NVFP4"), ("mxfp4_linear", "MXFP4")):
    refuse(
        "onnx",
        _op,
        f"ONNX Runtime has no {_what} weight-only matmul to lower it to; export it with --format "
        "compressed-tensors (transformers, vLLM) or save it with cm.save",
    )
refuse(
    "onnx",
    "fp8_kv_quant",
    "the FP8 KV cache (FP8KVCache) is not exported to ONNX yet; export it with --format compressed-tensors "
    "(vLLM, transformers), or quantize without FP8KVCache for ONNX Runtime",
)
implement(
    "onnx", "spqr_experts_linear", _lower_spqr_experts, kind="lowering", label="MatMulNBits + Gather/MatMul per expert"
)


def _lowering(node):
    """The registered ONNX lowering of ``node``'s op, or None (the op is translated as it is)."""
    op_spec = spec_of(node)
    impl = implementation("onnx", op_spec.name) if op_spec is not None else None
    return impl.load() if impl is not None and impl.kind == "lowering" else None


def lower_for_onnx(gm: GraphModule) -> tuple[GraphModule, list[str]]:
    """A copy of ``gm`` with every quantized op in an ORT-ready layout; notes on fallbacks taken."""
    gm = copy.deepcopy(gm)
    graph, notes = gm.graph, []
    for node in list(graph.nodes):
        lower = _lowering(node)
        if lower is None:
            continue
        a = args_of(node)
        _swap(graph, node, lambda: lower(gm, a, quantized_layer_path(a), notes))
    for expert in find_expert_linears(gm):  # full-precision grouped matmuls: ONNX has no grouped matmul
        _swap(
            graph,
            expert.node,
            lambda: call_op(graph, "experts_matmul", x=expert.input, offsets=expert.offsets, weight=expert.weight_user),
        )
    fuse_sibling_nbits(gm)
    contiguous_before_reshape(graph)
    graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm, notes
