"""``auto:B``'s SpQR candidates of one layer and its siblings (one input) solved together
(``spqr_quantize_many``).

On a sample of a layer's rows an SpQR solve is its per-column loop and per-group fit, not arithmetic:
the default candidates ``spqr-w3g16`` and ``spqr-w4g16`` stacked into one sweep (code widths per
row, the outlier threshold the whole layer's) cost little more than one. The results are the ones
``SpQR.quantize_layer`` / ``quantize_rows`` give, bit for bit (tests/test_spqr.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from qcompiler.algorithms.spqr import SpQRPart, spqr_quantize_many
from qcompiler.errors import QuantizationError
from qcompiler.ir.graph import LinearLayer
from qcompiler.layouts import LayerQuant, UnpackableLayer
from qcompiler.passes.gptq_candidates import MAX_STACKED
from qcompiler.passes.spqr import SpQR
from qcompiler.pipeline.shared_factors import shared_hessian_factor

__all__ = ["solve_spqr_candidates"]


def solve_spqr_candidates(
    quantizers: dict,
    members: list[tuple[LinearLayer, torch.Tensor, Optional[torch.Tensor]]],
    H: Optional[torch.Tensor],
) -> dict[str, dict[str, LayerQuant]]:
    """``{path: {name: SpQR(...).quantize_layer(layer, W, H, whole=whole)}}`` for every ``(layer, W,
    whole)`` of ``members`` (layers that read one input, so one ``H``) and the SpQR quantizers that
    differ only in bits (a fixed outlier threshold: an ``outlier_fraction`` searches τ per candidate);
    a candidate whose layout cannot hold a layer is left out, as the caller's own solve would skip it.
    ``whole``: the layer's weight when ``W`` is a sample of its rows (τ is the whole layer's)."""
    if H is None:
        return {}
    spqr = {name: q for name, q in quantizers.items() if isinstance(q, SpQR) and q.outlier_fraction is None}
    if len(members) > 1 and sum(W.numel() for _layer, W, _whole in members) * len(spqr) > MAX_STACKED:
        return {path: row for member in members for path, row in solve_spqr_candidates(quantizers, [member], H).items()}
    groups: dict[tuple, list[tuple]] = {}
    for name, q in spqr.items():
        key = (q.group_size, q.stat_bits, q.stat_group_size, q.outlier_threshold, q.act_order, q.damp, q.block_size)
        for layer, W, whole in members:
            try:
                q.check_shape(layer, W)
            except (UnpackableLayer, QuantizationError):
                continue
            groups.setdefault(key, []).append((name, layer, W, whole))
    solved: dict[str, dict[str, LayerQuant]] = {}
    for (group_size, stat_bits, stat_group, tau, act_order, damp, block_size), entries in groups.items():
        if len(entries) < 2:
            continue
        results = spqr_quantize_many(
            [SpQRPart(W, quantizers[name].bits, whole) for name, _layer, W, whole in entries],
            H,
            group_size=group_size,
            stat_bits=stat_bits,
            stat_group_size=stat_group,
            outlier_threshold=tau,
            act_order=act_order,
            damp=damp,
            block_size=block_size,
            factor=shared_hessian_factor(H, damp, act_order),
        )
        for (name, layer, W, _whole), res in zip(entries, results):
            solved.setdefault(layer.path, {})[name] = quantizers[name].layer_quant(W, res, tau)
    return solved
