"""W8A8 on the ``triton`` backend: linears that read the same activations quantize them once, and
where those activations are an RMSNorm's output, in the norm itself.

SmoothQuant folds its scales into the norm, so q/k/v (and gate/up) read one tensor; each
``qc.int8_linear`` would quantize it again (a full pass over the activations per linear). Here the
siblings' nodes — same input, same static scale and ``1/s`` — become one quantizer launch whose
int8 codes and scales every sibling's ``int8_gemm`` reads. When that input is the output of the
captured RMSNorm (``w · (h·rsqrt(mean(h²) + eps)).to(dtype)``, matched op for op) and nothing else
reads it, the quantizer is ``norm_quant.rmsnorm_quantize_rows`` on the norm's input and the norm's
ops leave the graph: its output is never written.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
from torch.fx import Graph, Node

from qcompiler.ir.graph import rms_norm_parts
from qcompiler.ir.op_registry import args_of
from qcompiler.layouts.int8 import int8_linear_quantized, quantize_activations

aten = torch.ops.aten

__all__ = ["share_activation_quantizers"]


def _quantizer_twin(x, smooth_inv, act_scale):
    """``quantize_rows``' plain-torch twin (same arguments)."""
    return quantize_activations(x, act_scale, smooth_inv)


def _gemm_twin(x, quantized, weight, weight_scale, bias):
    """The plain-torch GEMM on codes and scales, flattened to rows as the quantizer kernel gives them."""
    xq, sx = quantized
    rows = (xq.reshape(-1, xq.shape[-1]), sx if sx.dim() == 1 else sx.reshape(-1, 1))
    y = int8_linear_quantized(x.reshape(-1, x.shape[-1]), rows, weight, weight_scale, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _dtype(node) -> "torch.dtype | None":
    val = node.meta.get("val") if isinstance(node, Node) else None
    return getattr(val, "dtype", None)


def _erase_unused_chain(graph: Graph, node: Node, keep: Node) -> None:
    """Erase ``node`` and then each of its inputs that nothing else reads (up to ``keep``)."""
    pending = [node]
    while pending:
        current = pending.pop()
        if current is keep or current.op != "call_function":
            continue
        for user in list(current.users):  # torch.export's dtype checks of the casts: they go with them
            if user.target == aten._assert_tensor_metadata.default and not user.users:
                graph.erase_node(user)
        if current.users:
            continue
        inputs = [a for a in current.all_input_nodes]
        graph.erase_node(current)
        pending.extend(inputs)


def _norm_quantizer_twin(h, weight, eps, norm_dtype, out_dtype, smooth_inv, act_scale):
    from qcompiler.kernels.norm_quant import rmsnorm_quantize_reference

    return rmsnorm_quantize_reference(h, weight, eps, norm_dtype, out_dtype, smooth_inv, act_scale)


def share_activation_quantizers(
    graph: Graph, guard: Callable, layer_of: Callable[[Node], str], usable: Callable[[Node], bool]
) -> dict[str, str]:
    """Rewrite groups of ``usable`` ``int8_linear`` nodes with one input into one quantizer + their
    GEMMs; ``guard(name, layer, kernel, twin)`` wraps each launch (the twin runs where the kernel
    cannot). Returns the plan label of each rewritten layer."""
    from qcompiler import kernels
    from qcompiler.kernels.int8_gemm import int8_linear_quantized as kernel_gemm

    groups = defaultdict(list)
    for node in graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.qc.int8_linear.default:
            a = args_of(node)
            if usable(node):
                groups[(a.x, a.act_scale, a.smooth_inv)].append(node)
    done = {}
    for (x, act_scale, smooth_inv), nodes in groups.items():
        norm = rms_norm_parts(x)
        fused = (
            norm is not None
            and set(x.users) == set(nodes)
            and _dtype(x) is not None
            and _dtype(x) == _dtype(norm[0])
            and _dtype(x) in (torch.float32, torch.float16, torch.bfloat16)
        )
        if len(nodes) < 2 and not fused:
            continue
        names = [layer_of(n) for n in nodes]
        with graph.inserting_before(nodes[0]):
            if fused:
                h, weight, eps, norm_dtype = norm
                quantizer = guard(
                    "rmsnorm_quantize", ", ".join(names), kernels.rmsnorm_quantize_rows, _norm_quantizer_twin
                )
                args = (h, weight, eps, norm_dtype, _dtype(x), smooth_inv, act_scale)
                quantized = graph.call_function(quantizer, args)
            else:
                quantizer = guard("quantize_rows", ", ".join(names), kernels.quantize_rows, _quantizer_twin)
                quantized = graph.call_function(quantizer, (x, smooth_inv, act_scale))
        for node, name in zip(nodes, names):
            a = args_of(node)
            node.target = guard("int8_gemm", name, kernel_gemm, _gemm_twin)
            # the GEMM reads x only for its shape and dtype: the norm's input has both
            node.args, node.kwargs = (norm[0] if fused else a.x, quantized, a.weight, a.weight_scale, a.bias), {}
            how = "in its RMSNorm" if fused else "once"
            done[name] = f"int8_gemm (activations quantized {how} for {len(nodes)} linear{'s' * (len(nodes) > 1)})"
        if fused:
            _erase_unused_chain(graph, x, keep=norm[0])
    return done
