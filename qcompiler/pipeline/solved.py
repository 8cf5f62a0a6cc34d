"""One layer's solve as every rank applies it (``SolvedLayer``), described as JSON plus named
tensors — what crosses between the ranks of a distributed run and into a resumable run's records
— and the join of a layer solved in row ranges on several ranks (the layout's row join does the
tensors; the figures are combined here)."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from qcompiler.algorithms.output_error import relative_error
from qcompiler.distributed.collectives import broadcast_json, broadcast_tensors
from qcompiler.distributed.ranks import Piece
from qcompiler.errors import QuantizationError
from qcompiler.ir.graph import LinearLayer
from qcompiler.layouts import LayerRewrite, layout, stored_bits

__all__ = ["SolvedLayer", "solved_header", "solved_tensors", "solved_from", "moved_to", "exchange", "join_rows"]


class SolvedLayer(NamedTuple):
    """One layer's solve as every rank applies it: the report figures, the stored tensors (on the
    weights' device), the rewrite, and the dequantized weight as the graph stores it (its dtype and
    layout; None when not stored back) — or only ``skipped``, why it stays in full precision."""

    figures: dict = {}
    tensors: dict = {}
    rewrite: Optional[LayerRewrite] = None
    weight: Optional[torch.Tensor] = None
    skipped: Optional[str] = None
    error: Optional[str] = None  # a QuantizationError on the owner rank, raised on every rank


def solved_header(solved: SolvedLayer) -> dict:
    """``solved`` without its tensors, as JSON data (what crosses to other ranks and into a run's
    checkpoint file)."""
    if solved.error is not None or solved.skipped is not None:
        return {"error": solved.error, "skipped": solved.skipped}
    return {
        "figures": solved.figures,
        "rewrite": [solved.rewrite.layout, solved.rewrite.constants],
        "tensors": list(solved.tensors),  # in order: the rewrite creates its get_attr nodes in it
        "weight": solved.weight is not None,
    }


def solved_tensors(solved: SolvedLayer) -> dict[str, torch.Tensor]:
    """Every tensor of ``solved`` by one name: the stored ones as ``t.NAME``, the weight as ``weight``."""
    out = {f"t.{name}": t for name, t in solved.tensors.items()}
    if solved.weight is not None:
        out["weight"] = solved.weight
    return out


def solved_from(header: dict, tensors: dict[str, torch.Tensor]) -> SolvedLayer:
    """The SolvedLayer ``solved_header`` and ``solved_tensors`` describe."""
    if header.get("error"):
        return SolvedLayer(error=header["error"])
    if header.get("skipped"):
        return SolvedLayer(skipped=header["skipped"])
    layout_name, constants = header["rewrite"]
    stored = {name: tensors[f"t.{name}"] for name in header["tensors"]}
    return SolvedLayer(header["figures"], stored, LayerRewrite(layout_name, constants), tensors.get("weight"))


def moved_to(solved: SolvedLayer, device: torch.device) -> SolvedLayer:
    """``solved`` with its tensors on ``device`` (a replayed record: onto where the weights live)."""
    weight = None if solved.weight is None else solved.weight.to(device)
    return solved._replace(tensors={k: v.to(device) for k, v in solved.tensors.items()}, weight=weight)


def exchange(solved: Optional[SolvedLayer], owner: int, home: torch.device) -> SolvedLayer:
    """The owner rank's ``solved`` on every rank (``solved`` is None on the others); its tensors
    arrive on ``home``; an error on the owner is raised on every rank."""
    header = broadcast_json(None if solved is None else solved_header(solved), owner)
    if header.get("error"):
        raise QuantizationError(header["error"])
    mine = None if solved is None else solved_tensors(solved)
    tensors = {} if "figures" not in header else broadcast_tensors(mine, owner, home)
    return solved_from(header, tensors)


def join_rows(
    layer: LinearLayer, parts: list[SolvedLayer], pieces: list[Piece], in_features: int, energy: Optional[float]
) -> SolvedLayer:
    """One layer solved in row ranges (in row order, on several ranks) as the whole layer's
    result: the stored tensors joined by its layout's row join (bit-identical to a whole
    solve where the method's rows are independent), the graph's weight concatenated, the report's
    figures combined (output error from the summed terms, per-weight figures weighted by rows)."""
    if failed := next((p for p in parts if p.error is not None or p.skipped is not None), None):
        return failed
    name = parts[0].rewrite.layout
    row_join = layout(name).row_join
    if row_join is None:
        raise QuantizationError(f"layer {layer.path}: layout {name!r} has no row join; its layers solve whole")
    tensors, constants, joined = row_join([p.tensors for p in parts], [p.rewrite.constants for p in parts])
    rows = [piece.stop - piece.start for piece in pieces]
    figures = {k: v for k, v in parts[0].figures.items() if k != "_error"}
    if "outlier_fraction" in figures:  # per weight: every row has the layer's width
        figures["outlier_fraction"] = sum(p.figures["outlier_fraction"] * n for p, n in zip(parts, rows)) / sum(rows)
    if "bits_per_weight" in figures:  # what is stored counts once (a CSR's row pointers end once)
        figures["bits_per_weight"] = stored_bits(tensors) / (sum(rows) * in_features)
    if "_error" in parts[0].figures:
        num = math.fsum(p.figures["_error"][0] for p in parts)
        den = energy if energy is not None else math.fsum(p.figures["_error"][1] for p in parts)
        figures["rel_error"] = relative_error(num, den)
    figures["seconds"] = max(p.figures.get("seconds", 0.0) for p in parts)
    figures["row_ranks"] = len({piece.rank for piece in pieces})
    figures.update(joined)
    weight = None
    if parts[0].weight is not None:
        weight = torch.cat([p.weight for p in parts], dim=1 if layer.transposed else 0)
    return SolvedLayer(figures, tensors, LayerRewrite(name, constants), weight)
