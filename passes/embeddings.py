"""Token embeddings quantized in the graph (``QuantizeEmbeddings``), a tied output head with them.

On today's small models with large vocabularies the embedding is most of the file: Gemma-3 270M's
262,144 x 640 table is 63 % of its parameters, and the head reads the same table. Every weight pass
leaves it in 16 bits; llama.cpp's own Q4_K_M stores it in Q6_K / Q8_0. This pass stores each
embedding table in the GPTQ layout (``layouts/gptq_embedding.py``), per token and group of
``group_size`` hidden columns; the lookup becomes ``qc.quant_embedding`` and a linear that reads the
same table (a tied head) ``qc.quant_linear`` over the same stored tensors, so the tie is kept and
the table is stored — and counted by ``bits_per_parameter`` — once. It composes with any weight pass,
before or after it.

How the table is rounded (``method``): a lookup has no input Hessian (its "inputs" are one-hot), so
an untied table is rounded to nearest on the chosen grid. A tied table is also the head, a linear
whose inputs the calibration reaches: GPTQ on the head's input Hessian (gathered by running the
graph up to the head, through whatever ran before: ``--embeddings`` puts this pass before the weight
solves, so that is the FP model, rotated if the recipe rotates) moves each token row's rounding error
where the head's outputs feel it least. On Gemma-3 270M at 4 bits that cut the next-token KL the
table adds by a fifth to nearly a half (docs/results.md, "Quantized embeddings"), though the lookup reads
the rows unweighted. ``"auto"``: GPTQ where there is a tied linear and calibration, else RTN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.fx import GraphModule, Node

from qcompiler.algorithms.gptq import check_spec, gptq_quantize, hessian_factor, rtn_quantize
from qcompiler.algorithms.packing import packed_length
from qcompiler.errors import QuantizationError
from qcompiler.ir.graph import find_linears, module_path
from qcompiler.ir.op_registry import call_op
from qcompiler.ir.tensors import drop_tensor, get_raw_tensor, get_tensor, set_tensor
from qcompiler.layouts import stored_bits
from qcompiler.layouts.gptq import GPTQ, GPTQ_TENSORS, pack_gptq
from qcompiler.pipeline.input_hessian import input_hessian
from qcompiler.pipeline.layer_filter import check_patterns, ignore_reason
from qcompiler.pipeline.pass_base import GraphProperty, Pass, PassContext

__all__ = ["QuantizeEmbeddings", "lookup_tables", "names_of", "table_target", "table_path"]

_EMBEDDING = torch.ops.aten.embedding.default
ROWS_AT_ONCE = 32768  # table rows rounded at a time (whole packed words): a 262k x 640 table in 8 parts
METHODS = ("auto", "gptq", "rtn")


@dataclass(frozen=True)
class QuantizeEmbeddings(Pass):
    """Every embedding table in the GPTQ layout (tied: GPTQ on its head's inputs, else RTN), tied linears over it."""

    bits: int = 8
    group_size: int = 128
    sym: bool = False
    grid: str = "mse"  # each group's range searched for the least squared error; "minmax": the plain grid
    ignore: tuple[str, ...] = ()  # embedding module paths kept in full precision: globs, or 're:' + a regex
    # "gptq": a tied table by GPTQ on its head's input Hessian (calibration needed), an untied one by RTN;
    # "rtn": every table rounded to nearest; "auto": "gptq" when the run has calibration, else "rtn"
    method: str = "auto"
    damp: float = 0.01  # GPTQ's relative damping of the head's Hessian

    provides: ClassVar = frozenset({GraphProperty.QUANTIZED_EMBEDDINGS})
    noop_after: ClassVar = frozenset({GraphProperty.QUANTIZED_EMBEDDINGS})
    config_version: ClassVar = 2  # 2: method (version 1 rounded every table to nearest)

    def __post_init__(self):
        check_spec(self.bits, self.group_size, self.grid)
        if self.grid not in ("minmax", "mse"):
            raise QuantizationError(f"QuantizeEmbeddings: grid={self.grid!r}; choose minmax or mse")
        if self.method not in METHODS:
            raise QuantizationError(f"QuantizeEmbeddings: method={self.method!r}; choose one of {', '.join(METHODS)}")
        object.__setattr__(self, "ignore", check_patterns(self.name, self.ignore))

    @property
    def needs_calibration(self) -> bool:
        """Only ``method="gptq"`` insists on calibration (``"auto"`` uses it when the run has it)."""
        return self.method == "gptq"

    @classmethod
    def migrate_config(cls, config: dict, version: int) -> dict:
        """Version 1 had no ``method``: every table was rounded to nearest."""
        if version == 1:
            return {"method": "rtn", **config}
        return super().migrate_config(config, version)

    def run(self, gm: GraphModule, ctx: PassContext) -> bool:
        """Quantize each table the graph looks tokens up in, then point its lookups and tied linears at it."""
        tables = lookup_tables(gm)
        if not tables:
            ctx.record.notes.append("QuantizeEmbeddings: the graph looks up no embedding table; nothing changed")
            return False
        changed, kept = False, []
        for lookups in tables:
            names = names_of(gm, get_raw_tensor(gm, lookups[0].args[0].target))
            path = module_path(lookups[0]) or lookups[0].args[0].target.rsplit(".", 1)[0]
            table = get_tensor(gm, lookups[0].args[0].target)
            tied = _tied_linears(gm, names)
            problem = ignore_reason(path, self.ignore) or self.unpackable(table)
            problem = problem or _other_readers(gm, names, lookups, tied)
            if problem:
                kept.append(f"{path} kept in full precision ({problem})")
                ctx.record.notes.append(f"QuantizeEmbeddings: {kept[-1]}")
                ctx.log(ctx.record.notes[-1])
                continue
            H = None
            if tied and self.method != "rtn" and ctx.calibration:
                ctx.log(f"QuantizeEmbeddings: the input Hessian of {tied[0].path} on {len(ctx.calibration)} batches")
                H, _rows = input_hessian(gm, tied[0].node, tied[0].input, ctx.calibration, ctx.device)
            how = f"GPTQ on {tied[0].path}'s input Hessian" if H is not None else "rounded to nearest"
            ctx.log(
                f"QuantizeEmbeddings: {path} {tuple(table.shape)} to {self.bits} bits, "
                f"groups of {self.group_size}, {how}"
            )
            tensors, dequantized = self.quantize_table(table, H, ctx.device)
            for name, tensor in tensors.items():
                set_tensor(gm, f"{path}.{name}", tensor.to(table.device))
            heads = self._rewrite(gm, names, path, lookups, tied, table.dtype)
            info = gm.meta.get("qcompiler")
            if info is not None and info.tied:  # the FP table's names are gone: no alias to write under
                info.tied = {k: v for k, v in info.tied.items() if k not in names and v not in names}
            W = table.float()
            figures = {
                "bits": self.bits,
                "bits_per_weight": stored_bits(tensors) / table.numel(),
                "method": "gptq" if H is not None else "rtn",
                "rel_error": float((dequantized - W).square().sum() / W.square().sum().clamp_min(1e-30)),
            }
            if heads:
                figures["tied_linears"] = ", ".join(heads)
            ctx.record.layers[path] = figures
            changed = True
        if not changed:
            ctx.record.notes.append(f"QuantizeEmbeddings changed nothing: {'; '.join(kept)}")
        return changed

    def unpackable(self, table: torch.Tensor) -> str:
        """Why the GPTQ layout cannot hold ``table`` at these bits ('' when it can)."""
        if table.dim() != 2:
            return f"a {table.dim()}-D table"
        for what, size in (("rows", table.shape[0]), ("hidden width", table.shape[1])):
            try:
                packed_length(size, self.bits)
            except ValueError as exc:
                return f"{what} {size} cannot be packed at {self.bits} bits: {exc}"
        return ""

    def quantize_table(self, table: torch.Tensor, H, device) -> tuple[dict, torch.Tensor]:
        """The table's GPTQ-layout tensors and what they stand for, solved ``ROWS_AT_ONCE`` rows at a time
        (given ``H``, GPTQ's rows are independent, as RTN's are: one factor of ``H`` serves every part)
        and joined as the layout joins a layer's row ranges. GPTQ with act-order on static groups:
        contiguous groups, the layout a lookup reads."""
        factor = None if H is None else hessian_factor(H, self.damp, act_order=True)
        parts, values = [], []
        for start in range(0, table.shape[0], ROWS_AT_ONCE):
            W = table[start : start + ROWS_AT_ONCE].to(device or table.device, torch.float32)
            if factor is None:
                res = rtn_quantize(W, bits=self.bits, group_size=self.group_size, sym=self.sym, grid=self.grid)
            else:
                res = gptq_quantize(
                    W,
                    None,
                    bits=self.bits,
                    group_size=self.group_size,
                    sym=self.sym,
                    act_order=True,
                    static_groups=True,
                    factor=factor,
                    grid=self.grid,
                )
            packed = pack_gptq(res.codes, res.scales, res.zeros, res.g_idx, self.bits, self.group_size)
            parts.append(packed)
            values.append(res.dequantized.to(table.device))
        tensors, _constants, _figures = GPTQ.row_join(  # the layout's own join of row ranges
            [{name: getattr(p, name) for name in GPTQ_TENSORS} for p in parts], [{}] * len(parts)
        )
        return tensors, torch.cat(values)

    def _rewrite(
        self, gm: GraphModule, names: set[str], base: str, lookups: list[Node], tied: list, dtype
    ) -> list[str]:
        """Lookups become ``qc.quant_embedding``, linears reading the table ``qc.quant_linear`` over the
        same attributes (``{base}.qweight``, ...); the FP table goes under every name it had (nothing
        else reads it: ``_other_readers``). Returns the tied linears' paths."""
        graph = gm.graph
        constants = dict(bits=self.bits, group_size=self.group_size)

        def swap(node: Node, op: str, **arguments) -> None:
            with graph.inserting_before(node):
                attrs = {name: graph.get_attr(f"{base}.{name}") for name in GPTQ_TENSORS}
                new = call_op(graph, op, **arguments, **attrs, **constants)
            new.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "val", "stack_trace")})
            node.replace_all_uses_with(new)
            graph.erase_node(node)

        for node in lookups:
            swap(node, "quant_embedding", ids=node.args[1], out_dtype=dtype)
        heads = []
        for layer in tied:
            swap(layer.node, "quant_linear", x=layer.input, bias=layer.bias_node)
            heads.append(layer.path)
        for n in [n for n in graph.nodes if n.op == "get_attr" and n.target in names]:
            graph.erase_node(n)
        for name in names:
            drop_tensor(gm, name)
        graph.lint()
        gm.recompile()
        return heads


def lookup_tables(gm: GraphModule) -> list[list[Node]]:
    """The lookups of each stored table the graph looks tokens up in, one list per table whatever
    names it is read under."""
    tables: dict[int, list[Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is _EMBEDDING and node.args[0].op == "get_attr":
            tables.setdefault(id(get_raw_tensor(gm, node.args[0].target)), []).append(node)
    return list(tables.values())


def table_target(lookups: list[Node]) -> str:
    """The attribute the lookups read their table from."""
    return lookups[0].args[0].target


def table_path(lookups: list[Node]) -> str:
    """The module path of a table (its lookups' module, else its attribute's owner)."""
    return module_path(lookups[0]) or table_target(lookups).rsplit(".", 1)[0]


def names_of(gm: GraphModule, table: torch.Tensor) -> set[str]:
    """Every ``get_attr`` target that holds ``table`` (a tied head reads it under its own name)."""
    return {n.target for n in gm.graph.nodes if n.op == "get_attr" and get_raw_tensor(gm, n.target) is table}


def _tied_linears(gm: GraphModule, names: set[str]) -> list:
    """The linears that read the table untransposed (a tied output head)."""
    return [layer for layer in find_linears(gm) if layer.weight_node.target in names and not layer.transposed]


def _other_readers(gm: GraphModule, names: set[str], lookups: list[Node], tied: list) -> str:
    """What else reads the FP table besides its lookups and tied linears ('' when nothing): such a
    reader could not read the quantized table, so the table stays."""
    known = {n.name for n in lookups} | {layer.node.name for layer in tied}
    readers = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target in names]
    others = sorted({u.name for n in readers for u in n.users} - known)
    return f"also read by {', '.join(others)}" if others else ""
