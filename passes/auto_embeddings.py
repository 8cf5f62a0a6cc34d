"""The token-embedding table as one more item of ``auto:B``'s budget (``AutoBits(embeddings=...)``).

On today's small models the table is most of the parameters (Gemma-3 270M: 63 %), so a budget over
the block linears alone says little about the file. With ``embeddings`` set, each table of the graph
(the largest lookup table: the token embeddings, and the tied head that reads it) is measured at
each setting ``wBITSgGROUP`` and at its stored width ("keep"), and the knapsack chooses its setting
together with the linears' candidates under one budget over all of them.

The measure is the forward one (``sensitivity.py``): the table swapped for its round-to-nearest at
that setting (the plain min-max grid: seconds on a 262k-row table), the sensitivity samples run
through the graph, the distance of the output from the FP output — mean next-token KL per position
for a causal LM, the unit the Fisher measure of the linears estimates — so the lookup and a tied
head are both in it, and so is what the error does downstream. A handful of forwards per setting,
against thousands of per-layer solves. The chosen setting is then applied by ``QuantizeEmbeddings``
(a tied table by GPTQ on its head's inputs: the measured RTN error is an upper bound of what it
stores) before the linears are solved, as ``--embeddings`` orders them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule

from qcompiler.errors import QuantizationError
from qcompiler.ir.tensors import get_raw_tensor, get_tensor, set_tensor
from qcompiler.layouts import stored_bits
from qcompiler.passes.embeddings import QuantizeEmbeddings, lookup_tables, names_of, table_path, table_target
from qcompiler.pipeline.pass_base import PassContext
from qcompiler.pipeline.recipe_files import EMBEDDING_SETTING
from qcompiler.pipeline.sensitivity import ForwardDistance

__all__ = [
    "TableOption",
    "TableItem",
    "parse_table_setting",
    "measure_tables",
    "table_shapes",
    "KEEP",
    "TABLE_SETTINGS",
]

KEEP = "keep"  # the table as the graph stores it
# what ``--embeddings auto`` offers the knapsack: 8 bits (llama.cpp's Q8_0-like) and the 4-bit groups
# that hold Gemma-3 270M's table best when it was set by hand (docs/results.md, "Quantized embeddings")
TABLE_SETTINGS = ("w8g128", "w4g128", "w4g64", "w4g32")


@dataclass(frozen=True)
class TableOption:
    """One way to store a table: its setting (``KEEP`` or ``wBITSgGROUP``), stored bits, measured damage."""

    setting: str
    bits: float
    distance: float


@dataclass(frozen=True)
class TableItem:
    """A table of the graph and the options the knapsack chooses among (``KEEP`` first)."""

    path: str
    weights: int
    options: tuple[TableOption, ...]


def parse_table_setting(setting: str) -> tuple[int, int]:
    """``(bits, group size)`` of ``wBITSgGROUP``; a one-line error naming a malformed one."""
    match = EMBEDDING_SETTING.fullmatch(setting)
    if match is None:
        raise QuantizationError(f"auto: embeddings setting {setting!r} is not wBITSgGROUP (e.g. w8g128, w4g64)")
    bits, group = int(match[1]), int(match[2])
    QuantizeEmbeddings(bits=bits, group_size=group)  # the same checks as --embeddings
    return bits, group


def _largest_table(gm: GraphModule):
    """The lookups of the largest table the graph looks tokens up in (the token embeddings), or None."""
    tables = lookup_tables(gm)
    if not tables:
        return None
    return max(tables, key=lambda lookups: get_raw_tensor(gm, table_target(lookups)).numel())


def table_shapes(gm: GraphModule) -> list[tuple[str, int, int]]:
    """``(path, rows, hidden)`` of the table ``measure_tables`` would measure (none: an empty list)."""
    lookups = _largest_table(gm)
    if lookups is None:
        return []
    rows, hidden = get_raw_tensor(gm, table_target(lookups)).shape
    return [(table_path(lookups), int(rows), int(hidden))]


def measure_tables(
    gm: GraphModule, ctx: PassContext, settings: tuple[str, ...], samples: int, kl: bool
) -> list[TableItem]:
    """The largest table's options, each measured forward on ``samples`` sensitivity samples (the
    graph's tensors are restored afterwards); a setting the table cannot be packed at is left out."""
    lookups = _largest_table(gm)
    if lookups is None:
        return []
    target, path = table_target(lookups), table_path(lookups)
    raw = get_raw_tensor(gm, target)
    names = names_of(gm, raw)
    originals = {name: get_raw_tensor(gm, name) for name in names}
    table = get_tensor(gm, target)
    measure = ForwardDistance(gm, ctx.calibration, samples, kl)
    options = [TableOption(KEEP, float(table.numel() * table.element_size() * 8), 0.0)]
    try:
        for setting in settings:
            bits, group = parse_table_setting(setting)
            # the plain min-max grid: a setting measured in a second (the searched grid took 17 s on
            # Gemma-3's table, four settings a minute), an upper bound of what the applied table holds
            rounding = QuantizeEmbeddings(bits=bits, group_size=group, method="rtn", grid="minmax")
            if rounding.unpackable(table):
                continue
            tensors, dequantized = rounding.quantize_table(table, None, ctx.device)
            for name in names:
                set_tensor(
                    gm, name, dequantized.to(table.dtype), parameter=isinstance(originals[name], torch.nn.Parameter)
                )
            distance = measure()
            options.append(TableOption(setting, float(stored_bits(tensors)), distance))
            ctx.log(f"  sensitivity {path}: {setting} (round-to-nearest) {distance:.3g}")
    finally:
        for name, tensor in originals.items():
            set_tensor(gm, name, tensor, parameter=isinstance(tensor, torch.nn.Parameter))
    return [TableItem(path, table.numel(), tuple(options))]
