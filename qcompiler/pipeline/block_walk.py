"""The walk every weight-rewriting pass (RTN, GPTQ, SpQR, AWQ, SignRound, yours) runs: block by
block, solve each linear (and expert matrix) with the pass's method, apply the result on every
rank, rewrite the nodes into the result's storage layout at the end.

During calibration a quantized layer's weight is replaced by its dequantized value, so later
blocks see exactly the outputs the final quantized op produces (sequential calibration); once
every block is done, each linear node is swapped for the method's op(s).
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Union

import torch
from torch.fx import GraphModule, Node

from qcompiler.algorithms.finite import all_finite
from qcompiler.algorithms.output_error import output_error_terms, relative_error
from qcompiler.calib.calibration import CalibrationEngine, RankWork
from qcompiler.calib.host_memory import return_freed_memory
from qcompiler.calib.layer_stats import LayerStats
from qcompiler.distributed.ranks import Piece, SolveJob, current_ranks
from qcompiler.errors import QuantizationError
from qcompiler.files.spill import Parked, Spill
from qcompiler.frontend import lazy_weights
from qcompiler.ir.experts import ExpertLinear, find_expert_linears
from qcompiler.ir.graph import LinearLayer, block_of, find_linears, is_router
from qcompiler.ir.node_swap import replace_experts
from qcompiler.ir.tensors import get_raw_tensor, set_tensor
from qcompiler.layouts import ExpertsFormat, LayerQuant, LayerRewrite, QuantizeFn, UnpackableLayer, layout
from qcompiler.pipeline.layer_filter import ignore_reason, report_unmatched
from qcompiler.pipeline.pass_base import PassContext
from qcompiler.pipeline.solved import SolvedLayer, exchange, join_rows, moved_to

__all__ = ["quantize_block_linears", "is_output_head", "skip_reason"]


def skip_reason(path: str, ignore: tuple[str, ...]) -> Optional[str]:
    """Why the layer at ``path`` is kept in full precision whatever its weight: a router, or
    matched by the pass's ``ignore`` patterns; None when it is quantized."""
    return "mixture-of-experts router" if is_router(path) else ignore_reason(path, ignore)


def _check_finite(path: str, W: torch.Tensor) -> None:
    if not all_finite(W):
        bad = int((~torch.isfinite(W)).sum())
        raise QuantizationError(
            f"layer {path}: {bad} of its {W.numel()} weights are NaN or Inf; the "
            f"checkpoint is damaged (nothing was written)"
        )


def _release(gm: GraphModule, weight_nodes: list[Node]) -> None:
    """A calibrated block's dequantized weights (linears and 3-D expert parameters) become
    placeholders (its nodes are rewritten to the packed tensors at the end; the next block's inputs
    are already computed), so the copies do not pile up over the model's depth (they did: +1x the
    model's size at the peak; a streamed MoE model kept every block's experts)."""
    for node in weight_nodes:
        if len(node.users) == 1:
            lazy_weights.release(gm, node.target)


def is_output_head(path: str) -> bool:
    """The output projection to the vocabulary (``lm_head``; GPT-NeoX's ``embed_out``)."""
    return path.rsplit(".", 1)[-1] in ("lm_head", "embed_out")


class _BlockQuantizer:
    """One weight-quantizing pass's walk: solves each layer (or expert matrix) on the compute
    device, records it, and keeps what the final rewrite stores."""

    def __init__(
        self,
        gm: GraphModule,
        ctx: PassContext,
        quantize: QuantizeFn,
        experts: Optional[ExpertsFormat],
        ignore: tuple[str, ...],
        splitter=None,
    ):
        self.gm, self.ctx, self.record = gm, ctx, ctx.record
        self.quantize, self.experts_format, self.ignore = quantize, experts, ignore
        # the WeightQuantizer when it may solve a layer's rows apart (row_split_unit, quantize_row_range)
        self.splitter = splitter
        # (layer, its tensors or the spill file they were parked in, rewrite)
        self.done: list[tuple[LinearLayer, Union[dict, Parked], Callable]] = []
        self._spill = Spill() if lazy_weights.lazy_source(gm) is not None else None  # streamed: a big model
        self.experts_done: list[tuple[ExpertLinear, str, dict, dict]] = []  # expert, op, tensors, constants
        self.skipped: list[str] = []
        self._on_device: list = []  # (Hessian, its compute-device copy): siblings share one copy, so one factor
        self.ranks = current_ranks()
        self.journal: list[tuple[str, str, object]] = []  # what was applied since the block began (run_checkpoint.py)
        self.work = RankWork()  # this rank's seconds: the calibration engine's, when there is one

    def _to_compute(self, H: Optional[torch.Tensor], compute) -> Optional[torch.Tensor]:
        if H is None:
            return None
        if not self._on_device or self._on_device[0] is not H:
            self._on_device[:] = [H, H.to(compute)]
        return self._on_device[1]

    def drop_hessians(self) -> None:
        """Forget the compute-device Hessian: its layers are solved (its factor goes with it)."""
        self._on_device.clear()

    def skip(self, path: str, why: str) -> None:
        self.journal.append(("skip", path, why))
        self.skipped.append(path)
        self.record.notes.append(f"{path}: kept in full precision ({why})")
        self.ctx.log(f"  {path}: kept in full precision ({why})")

    @staticmethod
    def solve(
        method: QuantizeFn,
        layer: LinearLayer,
        path: str,
        W: torch.Tensor,
        H: Optional[torch.Tensor],
        energy: Optional[float] = None,
        rows: Optional[tuple[int, int]] = None,
    ) -> tuple[Optional[LayerQuant], Union[dict, str]]:
        """``method`` on one fp32 matrix (on the compute device) and its report figures, or
        ``(None, why)`` when the packed layout cannot hold it (the caller skips the layer).
        ``rows``: only that row range of ``W`` is solved (``method(layer, W, H, start, stop)``),
        and the figures carry the error's terms (``_error``) for ``join_rows`` instead of its ratio."""
        _check_finite(path, W)
        try:
            result = method(layer, W, H) if rows is None else method(layer, W, H, *rows)
        except UnpackableLayer as exc:
            return None, str(exc).split(": ", 1)[-1]
        except QuantizationError as exc:
            raise QuantizationError(exc.args[0] if str(exc).startswith("layer ") else f"layer {path}: {exc}") from None
        if not isinstance(result.rewrite, LayerRewrite):  # a closure would work here and fail across ranks or on resume
            raise QuantizationError(
                f"layer {path}: the method's result names no storage layout (LayerQuant.rewrite must be a "
                f"LayerRewrite(layout, constants), got {type(result.rewrite).__name__})"
            )
        try:
            layout(result.rewrite.layout)  # an unknown name is one line now, not at the rewrite after every block
        except QuantizationError as exc:
            raise QuantizationError(f"layer {path}: {exc}") from None
        figures = dict(result.figures)
        if H is not None:
            W_solved = W if rows is None else W[rows[0] : rows[1]]
            terms = output_error_terms(W_solved, result.dequantized, H, result.damped_error, energy)
            if rows is None:
                figures["rel_error"] = relative_error(*terms)
            else:
                figures["_error"] = list(terms)
        return result, figures

    def skip_reason(self, path: str) -> Optional[str]:
        """Why a layer is kept in full precision before any solve (the same on every rank)."""
        return skip_reason(path, self.ignore)

    def solve_linear(
        self,
        layer: LinearLayer,
        H: Optional[torch.Tensor],
        *,
        energy: Optional[float] = None,
        method: Optional[QuantizeFn] = None,
        store: bool = True,
        rows: Optional[tuple[int, int]] = None,
    ) -> SolvedLayer:
        """Solve one layer on this rank (the caller applies the result on every rank); ``rows``:
        only that row range, by the quantizer's ``quantize_row_range`` (``join_rows`` joins them)."""
        start = time.perf_counter()
        stored = layer.weight(self.gm)  # read once (a streamed weight comes from disk)
        compute = self.ctx.device or stored.device
        result, figures = self.solve(
            (method or self.quantize) if rows is None else self.splitter.quantize_row_range,
            layer,
            layer.path,
            stored.detach().float().to(compute),
            self._to_compute(H, compute),
            energy,
            rows,
        )
        if result is None:
            return SolvedLayer(skipped=figures)
        figures["seconds"] = round(time.perf_counter() - start, 4)
        weight = None
        if store:  # later blocks must see the quantized weights; nothing runs after the head
            W_hat = result.dequantized.t() if layer.transposed else result.dequantized
            weight = W_hat.to(device=stored.device, dtype=stored.dtype).contiguous()
        # Only what is stored is kept (on the weights' device), not the fp32 dequantized weight.
        return SolvedLayer(figures, {k: v.to(stored.device) for k, v in result.tensors.items()}, result.rewrite, weight)

    def apply_linear(self, layer: LinearLayer, solved: SolvedLayer) -> None:
        """Record a solved layer and put its dequantized weight into the graph."""
        if solved.skipped is not None:
            return self.skip(layer.path, solved.skipped)
        self.journal.append(("linear", layer.path, solved))
        if solved.weight is not None:
            set_tensor(self.gm, layer.weight_node.target, solved.weight)
        figures = solved.figures
        if figures.get("damp_steps"):
            self.record.notes.append(
                f"{layer.path}: Hessian needed damping {figures['damp']:g} "
                f"(raised {figures['damp_steps']}x from the default)"
            )
        if figures.get("grid_fallback"):
            self.record.notes.append(f"{layer.path}: {figures['grid_fallback']}")
        self.record.layers[layer.path] = figures
        error = f", relative output error {figures['rel_error']:.3g}" if "rel_error" in figures else ""
        split = f", rows on {figures['row_ranks']} ranks" if "row_ranks" in figures else ""
        self.ctx.log(f"  {layer.path}: {figures.get('bits', '?')}-bit{split}{error}, {figures['seconds']:.2f}s")
        self.done.append((layer, solved.tensors, solved.rewrite))

    def linear(self, layer: LinearLayer, H: Optional[torch.Tensor], *, method=None, store: bool = True) -> None:
        """Solve and apply one layer on this rank (every rank does the same: RTN without calibration, the head)."""
        if why := self.skip_reason(layer.path):
            return self.skip(layer.path, why)
        self.apply_linear(layer, self.solve_linear(layer, H, method=method, store=store))

    def plan(self, layers: list[LinearLayer]) -> dict[str, list[Piece]]:
        """Which rank solves which rows of each layer to solve (``Ranks.pieces``: whole layers
        balanced by solve cost, a big one split by rows where a rank would otherwise wait); the
        skipped ones are recorded here."""
        todo = []
        for layer in layers:
            if why := self.skip_reason(layer.path):
                self.skip(layer.path, why)
            else:
                todo.append(layer)
        jobs = []
        for layer in todo:
            shape = get_raw_tensor(self.gm, layer.weight_node.target).shape
            rows, cols = shape[::-1] if layer.transposed else shape
            unit = None if self.splitter is None else self.splitter.row_split_unit(layer)
            jobs.append(SolveJob(rows, cols, unit, layer.input.name))
        return {layer.path: pieces for layer, pieces in zip(todo, self.ranks.pieces(jobs))}

    def linears(self, layers: list[LinearLayer], plan: dict[str, list[Piece]], stats: dict[str, LayerStats]) -> None:
        """Solve the planned layers (or row ranges) this rank holds, then apply every result on every
        rank in graph order. A Hessian (and its compute-device factor) goes once its last reader here
        is solved."""
        todo = [layer for layer in layers if layer.path in plan]
        rank = self.ranks.rank
        mine = [(layer, p) for layer in todo for p in plan[layer.path] if p.rank == rank]
        for st in {id(st): st for st in stats.values()}.values():
            if not any(stats[layer.path] is st for layer, _ in mine):
                st.release()  # another rank solves every layer that reads it
        solved: dict[tuple[str, int], SolvedLayer] = {}
        for k, (layer, p) in enumerate(mine):
            st, whole = stats[layer.path], len(plan[layer.path]) == 1
            solved[layer.path, p.start] = self._attempt(
                lambda: self.solve_linear(
                    layer,
                    st.hessian,
                    energy=st.reference_energy(layer.path),
                    rows=None if whole else (p.start, p.stop),
                )
            )
            if not any(stats[later.path] is st for later, _ in mine[k + 1 :]):
                self.drop_hessians()
            return_freed_memory()
        for layer in todo:
            home = self._home(layer.weight_node)
            parts = [self._share(solved.get((layer.path, p.start)), p.rank, home) for p in plan[layer.path]]
            if len(parts) > 1:
                energy = stats[layer.path].reference_energy(layer.path)
                parts = [join_rows(layer, parts, plan[layer.path], stats[layer.path].in_features, energy)]
            self.apply_linear(layer, parts[0])

    def _attempt(self, solve: Callable[[], SolvedLayer]) -> SolvedLayer:
        """``solve()``; in a distributed run a QuantizationError becomes a result that every rank
        raises, so all ranks stop with the owner's one line instead of waiting for it."""
        began = time.perf_counter()
        try:
            return solve()
        except QuantizationError as exc:
            if not self.ranks.distributed:
                raise
            return SolvedLayer(error=str(exc))
        finally:
            self.work.solve_s += time.perf_counter() - began
            self.work.solved += 1

    def _home(self, weight_node: Node) -> torch.device:
        """Where the graph's weights live (a streamed placeholder: they are read onto the CPU)."""
        device = get_raw_tensor(self.gm, weight_node.target).device
        return torch.device("cpu") if device.type == "meta" else device

    def _share(self, solved: Optional[SolvedLayer], owner: int, home: torch.device) -> SolvedLayer:
        """The owner's ``solved`` on every rank (as is in one process)."""
        if not self.ranks.distributed:
            return solved
        began = time.perf_counter()
        try:
            return exchange(solved, owner, home)
        finally:
            self.work.exchange_s += time.perf_counter() - began

    def experts(self, expert: ExpertLinear, stats: Optional[dict], *, store: bool = True) -> None:
        """Quantize each expert matrix of one 3-D parameter (the experts shared out among the ranks);
        later blocks see the dequantized ones. An expert no calibration row reached is quantized by
        the format's ``no_tokens``, with a note."""
        why = ignore_reason(expert.path, self.ignore) or (
            None if self.experts_format else f"{self.record.name} does not quantize 3-D expert weights"
        )
        if why:
            return self.skip(expert.path, why)
        start, stored = time.perf_counter(), expert.stored(self.gm)
        owners = self.ranks.owners([1.0] * expert.num_experts)  # equal shapes: equal costs
        mine = {
            e: self._attempt(lambda e=e: self._solve_expert(expert, stored, stats, e))
            for e in range(expert.num_experts)
            if owners[e] == self.ranks.rank
        }
        parts = [self._share(mine.get(e), owners[e], stored.device) for e in range(expert.num_experts)]
        self.apply_experts(expert, parts, store=store, seconds=time.perf_counter() - start)

    def apply_experts(self, expert: ExpertLinear, parts: list[SolvedLayer], *, store: bool, seconds: float) -> None:
        """Record one 3-D parameter's solved experts and put its dequantized weights into the graph."""
        if skipped := next((p.skipped for p in parts if p.skipped is not None), None):
            return self.skip(expert.path, skipped)
        self.journal.append(("experts", expert.path, parts))
        errors, fmt = [], self.experts_format
        for e, part in enumerate(parts):
            path, figures = expert.expert_path(e), part.figures
            if "rel_error" in figures:
                errors.append(figures["rel_error"])
            if "fallback" in figures:
                self.record.notes.append(f"{path}: received no calibration tokens, quantized with {fmt.no_tokens_name}")
            self.record.layers[path] = figures
        home = self._home(expert.weight_node)
        if store:
            W_hat = torch.stack([part.weight for part in parts])  # [E, out, in]
            W_hat = W_hat if expert.transposed else W_hat.transpose(1, 2)
            set_tensor(self.gm, expert.weight_node.target, W_hat.contiguous())
        stored_as = layout(parts[0].rewrite.layout)
        if stored_as.experts_stack is None or any(p.rewrite.layout != stored_as.name for p in parts):
            raise QuantizationError(
                f"{expert.path}: the experts' results are in layout(s) "
                f"{sorted({p.rewrite.layout for p in parts})}; one layout with an experts op is needed"
            )
        op, tensors, constants = stored_as.experts_stack(
            [LayerQuant(None, p.figures, p.tensors, p.rewrite) for p in parts]
        )
        self.experts_done.append((expert, op, {k: v.to(home) for k, v in tensors.items()}, constants))
        error = f", mean relative output error {sum(errors) / len(errors):.3g}" if errors else ""
        bits = parts[0].figures.get("bits", "?")
        self.ctx.log(f"  {expert.path}: {expert.num_experts} experts, {bits}-bit{error}, {seconds:.2f}s")

    def replay(self, events: list, seg) -> None:
        """Apply a block's results recorded by an earlier run (``run_checkpoint.py``), in order."""
        linears = {layer.path: layer for layer in seg.linears}
        experts = {expert.path: expert for expert in seg.experts}
        for kind, path, solved in events:
            if kind == "skip":
                self.skip(path, solved)
            elif kind == "linear":
                self.apply_linear(linears[path], moved_to(solved, self._home(linears[path].weight_node)))
            else:
                home = self._home(experts[path].weight_node)
                self.apply_experts(experts[path], [moved_to(p, home) for p in solved], store=True, seconds=0.0)

    def _solve_expert(self, expert: ExpertLinear, stored: torch.Tensor, stats: Optional[dict], e: int) -> SolvedLayer:
        """One expert's matrix on this rank: its weight comes back ``[out, in]`` in the stored dtype."""
        fmt, path = self.experts_format, expert.expert_path(e)
        compute = self.ctx.device or stored.device
        layer = LinearLayer(expert.node, path, expert.input, expert.weight_node, None, False)
        st = None if stats is None else stats[path]
        H = None if st is None or st.rows == 0 else st.hessian.to(compute)
        method = self.quantize if st is None or H is not None else fmt.no_tokens
        W = expert.expert_weight(stored, e).detach().float().to(compute)
        result, figures = self.solve(method, layer, path, W, H)
        if result is None:
            return SolvedLayer(skipped=figures)
        if st is not None:
            figures["calib_rows"] = st.rows
            if "rel_error" not in figures:
                figures["fallback"] = fmt.no_tokens_name
        weight = result.dequantized.to(device=stored.device, dtype=stored.dtype)
        return SolvedLayer(figures, {k: v.to(stored.device) for k, v in result.tensors.items()}, result.rewrite, weight)

    def block_done(self, start: int, experts_start: int) -> None:
        """Park the results of ``done[start:]`` and ``experts_done[experts_start:]`` (one block's
        layers and expert parameters, a file each) on disk when the model is streamed."""
        if self._spill is None:
            return
        for k in range(start, len(self.done)):
            layer, tensors, rewrite = self.done[k]
            self.done[k] = (layer, self._spill.park(tensors), rewrite)
        for k in range(experts_start, len(self.experts_done)):
            expert, op, tensors, constants = self.experts_done[k]
            self.experts_done[k] = (expert, op, self._spill.park(tensors), constants)

    def rewrite(self) -> bool:
        """Swap every solved node for the method's op(s); returns whether anything was quantized.
        A parked layer's tensors go back to its file once stored (``lazy_weights.adopt_parked``):
        the graph holds one layer's results at a time here, and the spill lives as long as it."""
        for layer, tensors, rewrite in self.done:
            self._stored(tensors, lambda t, layer=layer, rewrite=rewrite: rewrite(self.gm, layer, t))
        for expert, op, tensors, constants in self.experts_done:
            self._stored(tensors, lambda t, e=expert, op=op, c=constants: replace_experts(self.gm, e, op, t, c))
        if self._spill is not None:
            lazy_weights.keep_spill(self.gm, self._spill)
        self.gm.graph.eliminate_dead_code()
        return bool(self.done or self.experts_done)

    def _stored(self, tensors, store: Callable[[dict], object]) -> None:
        if not isinstance(tensors, Parked):
            store(tensors)
            return
        values = tensors.read()
        store(values)
        lazy_weights.adopt_parked(self.gm, tensors, values)


def quantize_block_linears(gm: GraphModule, ctx: PassContext, quantizer) -> bool:
    """The walk of a ``WeightQuantizer`` (``weight_quantizer.py``): quantize every linear inside a
    transformer block with ``quantizer.quantize_layer``, and the output head with its
    ``head_quantizer()`` when it has one (it sees no Hessian: RTN); returns True if any layer was
    quantized.

    Mixture-of-experts 3-D expert parameters are quantized expert by expert, each from the rows
    the router sent it, and stored as ``quantizer.experts_format()`` says; an expert that received
    no calibration rows is quantized by its ``no_tokens`` and named in a note. Without a format
    they stay in full precision, with a note.

    Layers are solved on ``ctx.device`` (one at a time: only that layer's weight, Hessian and result
    are there); what is stored goes back to where the graph's weights live."""
    ignore, head = quantizer.ignore, quantizer.head_quantizer()
    walk = _BlockQuantizer(gm, ctx, quantizer.quantize_layer, quantizer.experts_format(), ignore, quantizer)
    if ctx.calibration is None:
        if quantizer.needs_hessian:
            raise QuantizationError("calibration data is required")
        for layer in find_linears(gm):  # nothing runs the graph: no need to store what stands for the codes
            if block_of(layer.path) is not None:
                walk.linear(layer, None, store=False)
        for expert in find_expert_linears(gm):
            if block_of(expert.path) is not None:
                walk.experts(expert, None, store=False)
    else:
        _calibrated_walk(walk, CalibrationEngine.for_pass(gm, ctx), quantizer)
    if head is not None:  # not stored back: a tied embedding keeps reading the FP weight
        heads = [layer for layer in find_linears(gm) if is_output_head(layer.path)]
        if not heads:
            ctx.record.notes.append("asked to quantize the output head, but the graph has no lm_head/embed_out linear")
        for layer in heads:
            walk.linear(layer, None, method=head, store=False)
    report_unmatched(
        ctx.record.name,
        ignore,
        [layer.path for layer in find_linears(gm)] + [expert.path for expert in find_expert_linears(gm)],
        ctx.record.notes,
    )
    if walk.rewrite():
        return True
    ctx.record.notes.append(
        "nothing was quantized: "
        + (  # the pass contract turns this into the error
            f"every eligible layer was kept in full precision ({len(walk.skipped)})"
            if walk.skipped
            else "no unquantized linear layer inside a transformer block (an earlier pass quantized them, or the "
            "model's linears lie outside numbered blocks such as model.layers.N; lm_head is never quantized)"
        )
    )
    return False


def _solve_block(walk: _BlockQuantizer, engine: CalibrationEngine, quantizer, seg) -> None:
    """One block: the quantizer's ``before_block``, collect each group's statistics, solve, ``after_block``."""
    quantizer.before_block(walk.gm, seg, engine, walk.ctx)
    for group in seg.sibling_groups() if quantizer.true_sequential else [seg.linears]:
        if not group:
            continue
        plan = walk.plan(group)
        stats = engine.collect(seg, group, owners={path: {p.rank for p in pieces} for path, pieces in plan.items()})
        return_freed_memory()
        walk.linears(group, plan, stats)  # it drops each compute-device Hessian after its last reader
        del stats  # nothing of this collect lives into the next one
        return_freed_memory()
    for expert in seg.experts:  # one at a time: down_proj sees the quantized gate_up_proj
        walk.experts(expert, engine.collect(seg, [], experts=[expert]) if walk.experts_format else None)
    quantizer.after_block(walk.gm, seg, walk.ctx)


def _calibrated_walk(walk: _BlockQuantizer, engine: CalibrationEngine, quantizer) -> None:
    """Block by block: the quantizer's ``before_block``, collect the inputs' statistics, solve,
    ``after_block``, move on with the quantized weights."""
    previous: list[Node] = []
    walk.work = engine.work  # the block's progress line shows every rank's forward, solve and exchange seconds
    progress = walk.ctx.checkpoint
    if progress is not None and not quantizer.replayable:
        raise QuantizationError(
            f"{quantizer.name} has its own before_block() / after_block(): a run with it cannot record resumable "
            "progress (its hooks may change the graph in ways a replay of its results would not redo)"
        )
    for k, seg in enumerate(engine.blocks()):
        _release(walk.gm, previous)  # the previous block has run with them: nothing reads them again
        first, first_expert = len(walk.done), len(walk.experts_done)
        walk.journal.clear()
        recorded = None if progress is None else progress.recorded(walk.ctx.pass_index, k)
        if recorded is not None:  # an earlier run solved it: apply, and the engine re-runs it forward
            walk.replay(recorded, seg)
        else:
            _solve_block(walk, engine, quantizer, seg)
            if progress is not None:
                progress.record(walk.ctx.pass_index, k, walk.journal)
        previous = [layer.weight_node for layer in seg.linears if layer.path in walk.record.layers] + [
            expert.weight_node for expert, *_ in walk.experts_done[first_expert:]
        ]  # quantized, not skipped
        walk.block_done(first, first_expert)
