"""W8A8 on the ``triton`` backend: linears that read the same activations quantize them once.

SmoothQuant folds its scales into the norm, so q/k/v (and gate/up) read one tensor; each
``qc.int8_linear`` would quantize it again (a full pass over the activations per linear). Here the
siblings' nodes — same input, same static scale and ``1/s`` — become one ``quantize_rows`` launch
whose int8 codes and scales every sibling's ``int8_gemm`` reads.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
from torch.fx import Graph, Node

from qcompiler.ir.op_registry import args_of
from qcompiler.ir.ops import int8_linear_quantized, quantize_activations

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
        if len(nodes) < 2:
            continue
        names = [layer_of(n) for n in nodes]
        with graph.inserting_before(nodes[0]):
            quantizer = guard("quantize_rows", ", ".join(names), kernels.quantize_rows, _quantizer_twin)
            quantized = graph.call_function(quantizer, (x, smooth_inv, act_scale))
        for node, name in zip(nodes, names):
            a = args_of(node)
            node.target = guard("int8_gemm", name, kernel_gemm, _gemm_twin)
            node.args, node.kwargs = (a.x, quantized, a.weight, a.weight_scale, a.bias), {}
            done[name] = f"int8_gemm (activations quantized once for {len(nodes)} linears)"
    return done
