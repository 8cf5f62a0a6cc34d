"""``auto:B``'s GPTQ candidates of one layer solved together (``qcompiler/algorithms/gptq_many.py``).

Scored on a sample of a layer's rows (``AutoBits.score_rows``), one GPTQ solve is mostly the sweep's
per-column loop, not arithmetic: the nine default GPTQ candidates stacked into one sweep cost little
more than one of them. The results are the ones ``GPTQ.quantize_layer`` gives, code for code.
"""

from __future__ import annotations

from typing import Optional

import torch

from qcompiler.algorithms.gptq_many import GridSpec, batchable, gptq_quantize_many
from qcompiler.errors import QuantizationError
from qcompiler.ir.graph import LinearLayer
from qcompiler.layouts import LayerQuant
from qcompiler.layouts.grid_result import from_quant_result
from qcompiler.passes.gptq import GPTQ
from qcompiler.pipeline.shared_factors import shared_hessian_factor

__all__ = ["solve_gptq_candidates"]

MAX_STACKED = 2**24  # weights stacked in one sweep (three float32 buffers of this size: 192 MB)


def solve_gptq_candidates(
    quantizers: dict, layer: LinearLayer, W: torch.Tensor, H: Optional[torch.Tensor]
) -> dict[str, Optional[LayerQuant]]:
    """``{name: GPTQ(...).quantize_layer(layer, W, H)}`` for the quantizers that can share a sweep
    (GPTQ on integer grids with static groups; grouped by damping, act-order and block size), None
    for one whose layout cannot hold the layer; the others are left to the caller, and so is every
    candidate of a layer larger than half ``MAX_STACKED`` (whose results, all held at once until
    scored, would be several copies of a big weight)."""
    if H is None:
        return {}
    groups: dict[tuple, list[str]] = {}
    for name, q in quantizers.items():
        if isinstance(q, GPTQ) and q.static_groups and batchable(_spec(q)):
            groups.setdefault((q.damp, q.act_order, q.block_size), []).append(name)
    solved: dict[str, Optional[LayerQuant]] = {}
    per_sweep = MAX_STACKED // max(W.numel(), 1)
    if per_sweep < 2:  # a layer this large gains nothing from stacking: each candidate alone, one at a time
        return solved
    for (damp, act_order, block_size), names in groups.items():
        if len(names) < 2:
            continue
        factor = shared_hessian_factor(H, damp, act_order)
        for start in range(0, len(names), per_sweep):
            batch = names[start : start + per_sweep]
            results = gptq_quantize_many(W, factor, [_spec(quantizers[n]) for n in batch], block_size)
            for name, res in zip(batch, results):
                q = quantizers[name]
                try:
                    solved[name] = from_quant_result(layer, W, res, q.bits, q.group_size, q.grid)
                except QuantizationError:  # UnpackableLayer among them: this layout cannot hold the shape
                    solved[name] = None
    return solved


def _spec(q: GPTQ) -> GridSpec:
    return GridSpec(q.bits, q.group_size, q.sym, q.grid)
