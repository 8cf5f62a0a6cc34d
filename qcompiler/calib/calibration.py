"""The shared calibration engine: runs a captured graph block by block over calibration batches.

The graph is cut into segments at the first node of each transformer block (blocks found from
module paths). Only the values live across the current cut — the block's inputs: hidden states,
masks, rotary tables — are cached, one set per batch, so peak memory is one block's activations
and statistics plus the model, whatever the depth. A pass quantizes a block, then ``advance()``
re-runs that block with its quantized weights to produce the next block's inputs (sequential
calibration, as the GPTQ reference does).

Statistics are streamed: a Hessian ``H = 2/n Σ x xᵀ`` (summed in float64, read as fp32) and
per-input-channel ``max|x|`` per observed linear. Rows whose attention-mask entry is 0 (padding)
never enter them.

Several ranks (``qcompiler/distributed/``): each rank runs its contiguous shard of the batches, and
``collect`` combines the ranks' statistics before returning them, so every rank gets the whole
set's — bit for bit what one process computes (see ``layer_stats._add_batch_products``).

Device onloading: with ``device`` set, each run copies only the weights the running nodes read to
that device and drops them afterwards, so the device holds one block's weights, the cached block
inputs (or, with ``offload``, one batch of them at a time, the rest on the CPU) and the statistics.
The graph's own weights never move.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
import torch.fx._pytree as fx_pytree
from torch.fx import GraphModule, Node
from torch.utils._pytree import tree_map

from qcompiler.calib.cpu_products import Float32Products
from qcompiler.calib.host_memory import return_freed_memory
from qcompiler.calib.layer_stats import LayerStats, check_finite_stats, float_row_chunks
from qcompiler.distributed.ranks import current_ranks
from qcompiler.errors import CalibrationError
from qcompiler.ir.experts import ExpertLinear, expert_rows, find_expert_linears
from qcompiler.ir.graph import LinearLayer, block_of, find_linears, module_path, source_of
from qcompiler.ir.tensors import get_raw_tensor, get_tensor

__all__ = ["LayerStats", "Segment", "CalibrationEngine"]

_BATCH_LINE_SECONDS = 4.0  # a progress line at most this often while batches run through a block


class _DeviceInterpreter(Float32Products):
    """Runs nodes on ``device``: the graph was captured where the model lives, so factory, copy and
    metadata-check nodes name that device (``arange(device=cpu)``, ``_assert_tensor_metadata``).
    Half-precision matrix products on a CPU without half-precision units run in float32
    (calib/cpu_products.py: same products, 5-7x faster on AVX2)."""

    def __init__(self, gm: GraphModule, device: Optional[torch.device]):
        super().__init__(gm, garbage_collect_values=False)
        self.device = device

    def call_function(self, target, args, kwargs):
        if self.device is not None:
            args = tuple(self.device if isinstance(a, torch.device) else a for a in args)
            if isinstance(kwargs.get("device"), torch.device):
                kwargs = {**kwargs, "device": self.device}
        return super().call_function(target, args, kwargs)


def _duration(seconds: float) -> str:
    """``42s``, ``7m05s``, ``3h12m``: a progress line's estimate."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


@dataclass
class Segment:
    """The nodes from one block's first node up to the next block's first node."""

    name: str
    start: int
    end: int
    linears: list[LinearLayer] = field(default_factory=list)
    experts: list[ExpertLinear] = field(default_factory=list)  # 3-D MoE expert parameters

    def sibling_groups(self) -> list[list[LinearLayer]]:
        """Linears grouped by the tensor they read, in graph order (q/k/v; o; gate/up; down)."""
        groups: dict[Node, list[LinearLayer]] = {}
        for layer in self.linears:
            groups.setdefault(source_of(layer.input), []).append(layer)
        return list(groups.values())


@dataclass
class RankWork:
    """This rank's seconds in the current block: a distributed run's progress line shows every
    rank's, so a slow or overloaded rank (one big layer, a shared machine) is seen, not guessed."""

    forward_s: float = 0.0  # calibration forward passes and statistics over this rank's batches
    solve_s: float = 0.0  # the layers (and experts) this rank solves
    exchange_s: float = 0.0  # combining statistics and sharing results with the other ranks
    solved: int = 0

    def reset(self) -> None:
        """Zero every figure (a new block)."""
        self.forward_s = self.solve_s = self.exchange_s = 0.0
        self.solved = 0

    def summary_of_ranks(self) -> str:
        """Every rank's figures in rank order, one line (a collective: every rank calls it)."""
        from qcompiler.distributed.collectives import gather_rows

        mine = torch.tensor([[self.forward_s, self.solve_s, self.exchange_s, self.solved]], dtype=torch.float64)
        rows = gather_rows(mine).tolist()
        return "; ".join(
            f"rank {r}: {f:.1f}s forward, {s:.1f}s solving {int(n)}, {x:.1f}s exchange"
            for r, (f, s, x, n) in enumerate(rows)
        )


class CalibrationEngine:
    """Block-sequential execution of ``gm`` over calibration batches ``[(args, kwargs), ...]``."""

    def __init__(
        self,
        gm: GraphModule,
        batches: list[tuple[tuple, dict]],
        *,
        log: Callable[[str], None] = lambda _m: None,
        device: Optional[torch.device] = None,
        offload: bool = False,
    ):
        if not batches:
            raise CalibrationError("the calibration set is empty: pass at least one batch of inputs")
        self.ranks = current_ranks()
        batches = self.ranks.shard(batches)
        self.work = RankWork()  # reset after each block; the weight walk adds its solves
        self.gm = gm
        self.log = log
        self.device = None if device is None else torch.device(device)
        self.cache_device = torch.device("cpu") if offload else self.device
        self.nodes = list(gm.graph.nodes)
        self._index = {n: i for i, n in enumerate(self.nodes)}
        self.segments = self._cut()
        self._interp = _DeviceInterpreter(gm, self.device)
        self._masks: list[Optional[torch.Tensor]] = []
        self._states: list[dict[Node, object]] = []
        for args, kwargs in batches:
            flat = fx_pytree.tree_flatten_spec((args, kwargs), gm._in_spec)
            placeholders = [n for n in self.nodes if n.op == "placeholder"]
            if len(flat) != len(placeholders):
                raise CalibrationError(
                    f"a calibration batch has {len(flat)} inputs, the graph takes {len(placeholders)}"
                )
            self._states.append(self._to(dict(zip(placeholders, flat)), self.cache_device))
            mask = kwargs.get("attention_mask")
            mask = mask.reshape(-1).bool() if isinstance(mask, torch.Tensor) else None
            self._masks.append(self._to(mask, self.device))
        first = self.segments[0].start if self.segments else len(self.nodes)
        self._run_range(0, first, {}, advance_to=first)
        self.position = first

    @classmethod
    def for_pass(cls, gm: GraphModule, ctx) -> "CalibrationEngine":
        """The engine over ``ctx``'s calibration batches, on ``ctx``'s device."""
        return cls(gm, ctx.calibration, log=ctx.log, device=ctx.device, offload=ctx.offload)

    @staticmethod
    def _to(value, device: Optional[torch.device]):
        if device is None:
            return value
        return tree_map(lambda v: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v, value)

    # -- structure -------------------------------------------------------------------------
    def _cut(self) -> list[Segment]:
        starts: list[tuple[int, str]] = []
        seen = set()
        for i, node in enumerate(self.nodes):
            if node.op in ("placeholder", "get_attr", "output"):
                continue
            block = block_of(module_path(node))
            if block is not None and block not in seen:
                seen.add(block)
                starts.append((i, block))
        # The last block ends at its own last node: the head (final norm, lm_head: logits for every
        # calibration token) never runs during calibration.
        last = (
            max(
                (i for i, n in enumerate(self.nodes) if starts and block_of(module_path(n)) == starts[-1][1]),
                default=len(self.nodes) - 1,
            )
            + 1
        )
        segments = [
            Segment(name, s, starts[k + 1][0] if k + 1 < len(starts) else last) for k, (s, name) in enumerate(starts)
        ]

        def segment_of(node: Node, path: str) -> Optional[Segment]:
            i = self._index[node]
            return next((s for s in segments if s.start <= i < s.end and block_of(path) == s.name), None)

        for layer in find_linears(self.gm):
            if (seg := segment_of(layer.node, layer.path)) is not None:
                seg.linears.append(layer)
        for expert in find_expert_linears(self.gm):
            if (seg := segment_of(expert.node, expert.path)) is not None:
                seg.experts.append(expert)
        return segments

    def blocks(self) -> Iterator[Segment]:
        """Segments in order; the caller must ``advance(seg)`` before moving to the next."""
        first = time.perf_counter()
        for k, seg in enumerate(self.segments):
            start = time.perf_counter()
            yield seg
            if self.position != seg.end and k + 1 < len(self.segments):  # nothing reads the last block's output
                self.advance(seg)
            return_freed_memory()
            now, left = time.perf_counter(), len(self.segments) - k - 1
            eta = f", about {_duration((now - first) / (k + 1) * left)} left" if left else ""
            done = f"block {k + 1}/{len(self.segments)} {seg.name}: {len(seg.linears)} linears, {now - start:.1f}s"
            self.log(done + eta)
            if self.ranks.distributed:
                self.log(f"  {self.work.summary_of_ranks()}")
            self.work.reset()

    # -- execution -------------------------------------------------------------------------
    def _live_after(self, index: int) -> set[Node]:
        """Non-attribute nodes defined before ``index`` and read at or after it by a node that runs
        during calibration. Graph outputs are never needed: a causal LM's per-layer KV cache (an
        output) would otherwise stay cached for every block (32 MB per block at 8 x 512 tokens and
        width 1024; 8.6 GB per block for a 7B model at 128 x 2048)."""
        return {
            n
            for n in self.nodes[:index]
            if n.op != "get_attr" and any(self._index[u] >= index and u.op != "output" for u in n.users)
        }

    def weights_read(self, start: int, end: int) -> set[Node]:
        """The ``get_attr`` nodes that nodes ``start:end`` read: all a run of that range onloads."""
        return {a for n in self.nodes[start:end] for a in n.all_input_nodes if a.op == "get_attr"}

    def _run_range(
        self,
        start: int,
        end: int,
        observers: dict[Node, Callable],
        *,
        advance_to: Optional[int],
        after: Optional[dict[Node, Callable]] = None,
    ) -> None:
        """Run nodes ``start:end`` per batch; an observed node's observer sees the values before it
        runs, so a node at ``end`` may be observed without running (the last linear of a collect);
        ``after`` observers see them once the node has run."""
        began = shown = time.perf_counter()
        after = after or {}
        attrs = {n: self._to(get_tensor(self.gm, n.target), self.device) for n in self.weights_read(start, end)}
        last = self.nodes[end] if end < len(self.nodes) and self.nodes[end] in observers else None
        keep = self._live_after(advance_to) if advance_to is not None else None
        release = self._last_uses(start, end)
        for b, state in enumerate(self._states):
            env = {**attrs, **self._to(state, self.device)}
            self._interp.env = env
            for node in self.nodes[start:end]:
                if node.op in ("placeholder", "get_attr"):
                    continue
                if node.op == "output":
                    break
                if node in observers:
                    observers[node](env, self._masks[b])
                env[node] = self._interp.run_node(node)
                if node in after:
                    after[node](env, self._masks[b])
                for done in release.get(node, ()):
                    del env[done]
            if last is not None:
                observers[last](env, self._masks[b])
            if keep is not None:
                self._states[b] = self._to({n: env[n] for n in keep}, self.cache_device)
            self._interp.env = env = {}
            if time.perf_counter() - shown >= _BATCH_LINE_SECONDS and b + 1 < len(self._states):
                shown = time.perf_counter()  # a slow block is never silent between its layers' lines
                where = block_of(module_path(self.nodes[start])) or f"nodes {start}-{end}"
                self.log(f"  {where}: calibration batch {b + 1}/{len(self._states)}")
        self.work.forward_s += time.perf_counter() - began

    @property
    def batch_count(self) -> int:
        """How many calibration batches this rank holds."""
        return len(self._states)

    def block_outputs(self, seg: Segment) -> list[Node]:
        """The values ``seg`` computes that later nodes read (the residual stream, a block's extra
        outputs): what a block-output loss compares."""
        return [n for n in self._live_after(seg.end) if seg.start <= self._index[n] < seg.end]

    def block_inputs(self, batch: int) -> tuple[dict, Optional[torch.Tensor]]:
        """Calibration batch ``batch`` as the current block reads it (the values live at its start,
        on the cache device) and its flattened attention mask (None without one)."""
        return self._states[batch], self._masks[batch]

    def run_block(
        self,
        seg: Segment,
        state: dict,
        replace: dict[Node, torch.Tensor],
        outputs: list[Node],
        *,
        next_state: bool = False,
    ) -> tuple[list, Optional[dict]]:
        """``seg`` on one batch's ``state`` (``block_inputs``, or a state this returned), with the
        ``get_attr`` values in ``replace`` (weights under trial: autograd flows through them),
        caching nothing: the values of ``outputs``, and with ``next_state`` the state the next
        block reads (on the cache device) — how a caller keeps a second stream of activations
        (e.g. the full-precision model's) beside the engine's."""
        if self.position != seg.start:
            raise RuntimeError(f"engine is at node {self.position}, not at the start of block {seg.name}")
        attrs = {n: self._to(get_tensor(self.gm, n.target), self.device) for n in self.weights_read(seg.start, seg.end)}
        env = {**attrs, **replace, **self._to(state, self.device)}
        self._interp.env = env
        try:
            for node in self.nodes[seg.start : seg.end]:
                if node.op not in ("placeholder", "get_attr", "output"):
                    env[node] = self._interp.run_node(node)
            after = self._to({n: env[n] for n in self._live_after(seg.end)}, self.cache_device) if next_state else None
            return [env[n] for n in outputs], after
        finally:
            self._interp.env = {}

    def _last_uses(self, start: int, end: int) -> dict[Node, list[Node]]:
        """For each node of ``start:end``, the values computed in that range whose last reader it is:
        freed once it ran, so a batch holds its live activations, not every intermediate of the
        block (measured: ~0.6 GB at 16 x 512 tokens on a 1024-wide LLaMA). Values read at or after
        ``end`` (the next block's inputs, a collect's unrun last node) stay."""
        release: dict[Node, list[Node]] = {}
        for node in self.nodes[start:end]:
            if node.op in ("placeholder", "get_attr", "output") or not node.users:
                continue
            final = max(self._index[u] for u in node.users)
            if final < end:
                release.setdefault(self.nodes[final], []).append(node)
        return release

    def collect(
        self,
        seg: Segment,
        layers: list[LinearLayer],
        *,
        hessian: bool = True,
        keep_rows: int = 0,
        experts: list[ExpertLinear] = (),
        owners: Optional[dict[str, set[int]]] = None,
    ) -> dict[str, LayerStats]:
        """Run ``seg`` over every batch and return input statistics of ``layers`` (by module path)
        and of each expert of ``experts`` (by ``{path}.{e}``: the rows the router sent it);
        ``keep_rows`` input rows per layer are kept as a sample (for searches that need real rows).
        Over several ranks, ``owners`` (layer path -> the ranks that solve it or its row ranges) sends
        each Hessian only to the ranks that read it (the others get none); without it every rank gets
        every one."""
        if self.position != seg.start:
            raise RuntimeError(f"engine is at node {self.position}, not at the start of block {seg.name}")
        stats: dict[str, LayerStats] = {}
        observers, outputs = {}, {}
        by_input: dict[Node, LayerStats] = {}  # q/k/v, gate/up read one input: one Hessian for all of them
        for layer in layers:
            w = get_raw_tensor(self.gm, layer.weight_node.target)  # shape only: a placeholder will do
            in_features = w.shape[0] if layer.transposed else w.shape[1]
            st = by_input.get(layer.input)
            if st is None or st.in_features != in_features:
                st = by_input[layer.input] = LayerStats(in_features, want_hessian=hessian, keep=keep_rows)
                observers[layer.node] = self._observer(layer.path, layer.input, st)
            stats[layer.path] = st
            if hessian:
                outputs[layer.node] = self._output_observer(layer, st)
        for expert in experts:
            per_expert = [
                LayerStats(expert.in_features, want_hessian=hessian, keep=keep_rows) for _ in range(expert.num_experts)
            ]
            stats.update((expert.expert_path(e), st) for e, st in enumerate(per_expert))
            observers[expert.node] = self._expert_observer(expert, per_expert)
        nodes = [layer.node for layer in layers] + [expert.node for expert in experts]
        last = max(self._index[node] for node in nodes) if nodes else seg.start
        self._run_range(seg.start, last, observers, advance_to=None, after=outputs)  # the last node does not run
        if self.ranks.distributed:
            began = time.perf_counter()
            distinct = {id(st): st for st in stats.values()}  # insertion order: the same on every rank
            for key, st in distinct.items():
                to = (
                    None
                    if owners is None
                    else {r for p, s in stats.items() if id(s) == key and p in owners for r in owners[p]}
                )
                st.reduce_across_ranks(self.device, hessian_to=to)
            self.work.exchange_s += time.perf_counter() - began
        return stats

    @staticmethod
    def _observer(path: str, source: Node, st: LayerStats):
        def observe(env: dict, mask: Optional[torch.Tensor]) -> None:
            rows = env[source].reshape(-1, st.in_features)
            if mask is not None and mask.numel() == rows.shape[0]:
                rows = rows[mask]
            st.add(rows)
            check_finite_stats(path, st)

        return observe

    @staticmethod
    def _output_observer(layer: LinearLayer, st: LayerStats):
        """``2/n Σ ‖W x‖²`` over the rows the Hessian saw: ``tr(W H Wᵀ)``, the report's error
        denominator, from outputs the collect computed anyway (not an out x in² GEMM). A layer
        collected without running (a collect's last) gets none."""

        def observe(env: dict, mask: Optional[torch.Tensor]) -> None:
            y = env[layer.node]
            if layer.bias_node is not None:
                y = y - env[layer.bias_node]
            y = y.detach().reshape(-1, y.shape[-1])
            if mask is not None and mask.numel() == y.shape[0]:
                y = y[mask]
            # squared norms in float32 per chunk, one float64 total per batch (summed by reference_energy)
            total = torch.zeros((), dtype=torch.float64, device=y.device)
            for chunk in float_row_chunks(y):
                total = total + torch.linalg.vector_norm(chunk).double() ** 2
            st.output_energy.setdefault(layer.path, []).append(float(total))

        return observe

    @staticmethod
    def _expert_observer(expert: ExpertLinear, per_expert: list[LayerStats]):
        """Rows arrive sorted by expert; the attention mask cannot be applied to them (the token
        order is the router's), so padded positions reach the experts they were routed to."""

        def observe(env: dict, _mask: Optional[torch.Tensor]) -> None:
            for st, rows in zip(per_expert, expert_rows(env[expert.input], env[expert.offsets])):
                st.add(rows)
                check_finite_stats(expert.path, st)

        return observe

    def advance(self, seg: Segment) -> None:
        """Run ``seg`` with the graph's current weights and cache the next block's inputs."""
        self._run_range(seg.start, seg.end, {}, advance_to=seg.end)
        self.position = seg.end
