"""``auto:B``'s GPTQ candidates of one layer — and of its siblings, the layers reading the same input —
solved together (``qcompiler/algorithms/gptq_many.py``).

Scored on a sample of a layer's rows (``AutoBits.score_rows``), one GPTQ solve is mostly the sweep's
per-column loop, not arithmetic: the nine default GPTQ candidates stacked into one sweep cost little
more than one of them, and q/k/v's (or gate/up's) candidates stacked into one sweep less than their
sweeps apart. The results are the ones ``GPTQ.quantize_layer`` gives, code for code.
"""

from __future__ import annotations

from typing import Optional

import torch

from qcompiler.algorithms.gptq_many import GridSpec, batchable, gptq_quantize_parts
from qcompiler.errors import QuantizationError
from qcompiler.ir.graph import LinearLayer
from qcompiler.layouts import LayerQuant
from qcompiler.layouts.grid_result import from_quant_result
from qcompiler.passes.gptq import GPTQ
from qcompiler.pipeline.shared_factors import shared_hessian_factor

__all__ = ["solve_gptq_candidates"]

MAX_STACKED = 2**24  # weights stacked in one sweep (three float32 buffers of this size: 192 MB)


def solve_gptq_candidates(
    quantizers: dict, members: list[tuple[LinearLayer, torch.Tensor]], H: Optional[torch.Tensor]
) -> dict[str, dict[str, Optional[LayerQuant]]]:
    """``{path: {name: GPTQ(...).quantize_layer(layer, W, H)}}`` for every ``(layer, W)`` of
    ``members`` (layers that read one input, so one ``H``: q/k/v, gate/up) and every quantizer that can
    share a sweep (GPTQ on integer grids with static groups; grouped by damping, act-order and block
    size), None for one whose layout cannot hold the layer; the others are left to the caller, and
    so is every candidate of a layer larger than half ``MAX_STACKED`` (whose results, all held at
    once until scored, would be several copies of a big weight). Members too large to stack together
    are solved apart."""
    if H is None:
        return {}
    total = sum(W.numel() for _layer, W in members)
    if len(members) > 1 and MAX_STACKED // max(total, 1) < 2:
        return {path: row for member in members for path, row in solve_gptq_candidates(quantizers, [member], H).items()}
    groups: dict[tuple, list[str]] = {}
    for name, q in quantizers.items():
        if isinstance(q, GPTQ) and q.static_groups and batchable(_spec(q)):
            groups.setdefault((q.damp, q.act_order, q.block_size), []).append(name)
    solved: dict[str, dict[str, Optional[LayerQuant]]] = {}
    per_sweep = MAX_STACKED // max(total, 1)
    if per_sweep < 2:  # a layer this large gains nothing from stacking: each candidate alone, one at a time
        return solved
    for (damp, act_order, block_size), names in groups.items():
        if len(names) * len(members) < 2:
            continue
        factor = shared_hessian_factor(H, damp, act_order)
        for start in range(0, len(names), per_sweep):
            batch = names[start : start + per_sweep]
            parts = [(W, _spec(quantizers[n])) for _layer, W in members for n in batch]
            results = iter(gptq_quantize_parts(parts, factor, block_size))
            for layer, W in members:
                for name in batch:
                    q, res = quantizers[name], next(results)
                    try:
                        layer_quant = from_quant_result(layer, W, res, q.bits, q.group_size, q.grid)
                    except QuantizationError:  # UnpackableLayer among them: this layout cannot hold the shape
                        layer_quant = None
                    solved.setdefault(layer.path, {})[name] = layer_quant
    return solved


def _spec(q: GPTQ) -> GridSpec:
    return GridSpec(q.bits, q.group_size, q.sym, q.grid)
