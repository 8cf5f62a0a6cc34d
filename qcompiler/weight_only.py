"""Plumbing shared by the weight-only passes (RTN, GPTQ): walk blocks, quantize, rewrite nodes.

During calibration a quantized layer's weight is replaced by its dequantized value, so later
blocks see exactly the outputs the final ``qc.quant_linear`` op produces; once every block is
done, each linear node is swapped for that op with the packed GPTQ tensors.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch
from torch.fx import GraphModule

from .calibration import CalibrationEngine
from .errors import QuantizationError
from .graph import LinearLayer, block_of, drop_attr_if_unused, find_linears, set_tensor
from .gptq import QuantResult, output_error
from .ops import GPTQWeight, pack_gptq
from .packing import packed_length
from .pass_base import PassContext

__all__ = ["quantize_block_linears", "replace_with_quant_linear"]

QuantizeFn = Callable[[LinearLayer, torch.Tensor, Optional[torch.Tensor]], QuantResult]


def _check_packable(layer: LinearLayer, W: torch.Tensor, bits: int) -> None:
    for dim, size in (("in_features", W.shape[1]), ("out_features", W.shape[0])):
        try:
            packed_length(size, bits)
        except ValueError as exc:
            raise QuantizationError(f"layer {layer.path}: {dim}={size} cannot be stored in the GPTQ "
                                    f"layout at {bits} bits ({exc})") from None


def _store_dequantized(gm: GraphModule, layer: LinearLayer, W_hat: torch.Tensor) -> None:
    set_tensor(gm, layer.weight_node.target, (W_hat.t() if layer.transposed else W_hat).contiguous())


def quantize_block_linears(gm: GraphModule, ctx: PassContext, *, bits: int, quantize: QuantizeFn,
                           true_sequential: bool, needs_hessian: bool) -> bool:
    """Quantize every linear inside a transformer block; returns True if any was quantized."""
    record = ctx.record
    results: list[tuple[LinearLayer, QuantResult]] = []

    def finish(layer: LinearLayer, W: torch.Tensor, H: Optional[torch.Tensor], start: float) -> None:
        _check_packable(layer, W, bits)
        try:
            res = quantize(layer, W, H)
        except QuantizationError as exc:
            raise QuantizationError(f"layer {layer.path}: {exc}") from None
        _store_dequantized(gm, layer, res.dequantized)
        figures = {"bits": bits, "seconds": round(time.perf_counter() - start, 4)}
        if H is not None:
            figures["rel_error"] = output_error(W, res.dequantized, H)
            figures["damp"] = res.damp
            if res.damp_steps:
                record.notes.append(f"{layer.path}: Hessian needed damping {res.damp:g} "
                                    f"(raised {res.damp_steps}x from the default)")
        record.layers[layer.path] = figures
        results.append((layer, res))

    if ctx.calibration is None:
        if needs_hessian:
            raise QuantizationError("calibration data is required")
        for layer in find_linears(gm):
            if block_of(layer.path) is not None:
                finish(layer, layer.weight(gm).detach().float(), None, time.perf_counter())
    else:
        engine = CalibrationEngine(gm, ctx.calibration, log=ctx.log)
        for seg in engine.blocks():
            for group in (seg.sibling_groups() if true_sequential else [seg.linears]):
                if not group:
                    continue
                start = time.perf_counter()
                stats = engine.collect(seg, group)
                for layer in group:
                    finish(layer, layer.weight(gm).detach().float(), stats[layer.path].hessian, start)
    for layer, res in results:
        replace_with_quant_linear(gm, layer, pack_gptq(res.codes, res.scales, res.zeros, res.g_idx, bits,
                                                       _group_size(res)))
    gm.graph.eliminate_dead_code()
    return bool(results)


def _group_size(res: QuantResult) -> int:
    n_groups = res.scales.shape[0]
    return -1 if n_groups == 1 else -(-res.g_idx.numel() // n_groups)


def replace_with_quant_linear(gm: GraphModule, layer: LinearLayer, packed: GPTQWeight) -> None:
    """Swap ``layer``'s node for ``qc.quant_linear`` reading the packed tensors (stored beside it)."""
    graph = gm.graph
    base = layer.path or layer.node.name
    names = {}
    for field in ("qweight", "qzeros", "scales", "g_idx"):
        names[field] = f"{base}.{field}"
        set_tensor(gm, names[field], getattr(packed, field))
    with graph.inserting_before(layer.node):
        attrs = {f: graph.get_attr(n) for f, n in names.items()}
        new = graph.call_function(torch.ops.qc.quant_linear.default,
                                  (layer.input, attrs["qweight"], attrs["qzeros"], attrs["scales"], attrs["g_idx"],
                                   layer.bias_node, packed.bits, packed.group_size))
    new.meta.update({k: v for k, v in layer.node.meta.items() if k in ("nn_module_stack", "val", "stack_trace")})
    layer.node.replace_all_uses_with(new)
    graph.erase_node(layer.node)
    drop_attr_if_unused(gm, layer.weight_node)
