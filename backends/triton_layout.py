"""Load-time repack for the ``triton`` backend: quantized nodes read the kernels' own weight layout.

When a graph is prepared for Triton, each GPTQ and SpQR node's stored tensors are repacked once
(``qcompiler.kernels.kernel_layout``: act-order rows sorted by group, codes in word-aligned bit
planes, statistics as floats) into new attributes of the backend's copy of the graph, and the node
is retargeted to the layout kernels — the GEMV at one activation row, the dequantizing GEMM above;
SpQR's ``dense + outliers`` pair becomes one call (outliers fused into the GEMV). The stored
artifact and the original graph are untouched; a weight the layout cannot hold (groups that are not
whole words, a hand-made ``g_idx``) keeps the stored-layout kernel, and the plan says why.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.fx import GraphModule, Node

from qcompiler.ir.op_registry import OpArgs, args_of, quantized_layer_path
from qcompiler.ir.ops import per_expert
from qcompiler.ir.tensors import set_tensor

__all__ = ["LAYOUT_OPS", "repack_node", "drop_unused_attributes"]

LAYOUT_OPS = ("quant_linear", "quant_experts_linear", "spqr_dense_linear", "spqr_experts_linear")


def _stat_dtype(a: OpArgs) -> torch.dtype:
    """SpQR statistics in fp32 for fp32 activations (exact), fp16 for half ones (half the traffic)."""
    val = a.x.meta.get("val") if isinstance(a.x, Node) else None
    return torch.float32 if val is None or val.dtype == torch.float32 else torch.float16


def _layout(runner: GraphModule, a: OpArgs):
    """The node's weight in the kernel layout (stacked for experts), and its outliers if it has them."""
    from qcompiler.kernels import kernel_layout as kl

    t = lambda name: a.tensor(runner, name)  # noqa: E731
    op = a.spec.name
    if op == "quant_linear":
        return kl.layout_from_gptq(t("qweight"), t("qzeros"), t("scales"), t("g_idx"), a.bits, a.group_size), None
    if op == "quant_experts_linear":
        experts = zip(t("qweight"), t("qzeros"), t("scales"), t("g_idx"))
        return kl.stack_experts([kl.layout_from_gptq(*e, a.bits, a.group_size) for e in experts]), None
    stats = (a.bits, a.group_size, a.stat_bits, a.stat_group_size)
    dense = [t(n) for n in ("codes", "scale_codes", "zero_codes", "scale_stats", "zero_stats", "perm")]
    if op == "spqr_dense_linear":
        return kl.layout_from_spqr(*dense, *stats, stat_dtype=_stat_dtype(a)), None
    layout = kl.stack_experts(
        [kl.layout_from_spqr(*(d[e] for d in dense), *stats, stat_dtype=_stat_dtype(a)) for e in range(len(dense[0]))]
    )
    return layout, kl.outliers_from_csr(t("row_ptr"), t("col_idx"), t("values"), layout.perm, _stat_dtype(a))


def _attach(runner: GraphModule, before: Node, prefix: str, tensors: dict) -> dict[str, Node]:
    """Store ``tensors`` on the runner as ``{prefix}_triton_{name}`` and read each with a ``get_attr``."""
    nodes = {}
    with runner.graph.inserting_before(before):
        for name, tensor in tensors.items():
            target = f"{prefix}_triton_{name}"
            set_tensor(runner, target, tensor)
            nodes[name] = runner.graph.get_attr(target)
    return nodes


def _calls(statics: dict, experts: bool) -> tuple[Callable, Callable]:
    """(kernel, plain-torch twin) taking ``(x, [offsets,] tensors, bias, sparse)`` as graph arguments."""
    from qcompiler.kernels import kernel_layout as kl
    from qcompiler.kernels.layout_linear import layout_experts_linear, layout_linear

    def unpack(tensors: dict, sparse: Optional[dict]):
        layout = kl.KernelLayout(**{"high": None, "perm": None, **tensors}, **statics)
        return layout, None if sparse is None else kl.Outliers(**sparse)

    if not experts:

        def linear_kernel(x, tensors, bias, sparse):
            layout, outliers = unpack(tensors, sparse)
            return layout_linear(x, layout, bias, outliers)

        def linear_twin(x, tensors, bias, sparse):
            layout, outliers = unpack(tensors, sparse)
            return kl.layout_linear_reference(x, layout, bias, outliers)

        return linear_kernel, linear_twin

    def kernel(x, offsets, tensors, bias, sparse):
        layout, outliers = unpack(tensors, sparse)
        return layout_experts_linear(x, offsets, layout, outliers)

    def twin(x, offsets, tensors, bias, sparse):
        layout, outliers = unpack(tensors, sparse)
        return per_expert(
            x,
            offsets,
            layout.out_features,
            lambda rows, e: kl.layout_linear_reference(
                rows, layout.expert(e), None, None if outliers is None else outliers.expert(e)
            ),
        )

    return kernel, twin


def repack_node(runner: GraphModule, node: Node, sparse_node: Optional[Node] = None):
    """Repack ``node``'s weight (and ``sparse_node``'s outliers, for a fused SpQR pair) into the
    kernel layout on ``runner``; returns ``(x, [offsets,] tensors, bias, sparse)`` — the new node's
    arguments — and its (kernel, twin). Raises UnsupportedKernel when the layout cannot hold it."""
    from qcompiler.kernels import kernel_layout as kl

    a = args_of(node)
    layout, outliers = _layout(runner, a)
    if sparse_node is not None:
        s = args_of(sparse_node)
        outliers = kl.outliers_from_csr(
            s.tensor(runner, "row_ptr"),
            s.tensor(runner, "col_idx"),
            s.tensor(runner, "values"),
            layout.perm,
            _stat_dtype(a),
        )
    prefix = quantized_layer_path(a)
    tensors = _attach(runner, node, prefix, layout.tensors())
    sparse = None if outliers is None else _attach(runner, node, f"{prefix}_outliers", outliers.tensors())
    experts = a.spec.name.endswith("experts_linear")
    bias = None if experts else a.bias
    args = (a.x, a.offsets, tensors, bias, sparse) if experts else (a.x, tensors, bias, sparse)
    return args, _calls(layout.statics(), experts)


def drop_unused_attributes(runner: GraphModule) -> None:
    """Remove ``get_attr`` nodes nothing reads any more (the stored tensors a repack replaced), so
    moving the runner to the GPU copies only what the kernels read. The attributes themselves are
    left: they are shared with the original graph."""
    for node in list(runner.graph.nodes):
        if node.op == "get_attr" and not node.users:
            runner.graph.erase_node(node)
