"""SignRound (Cheng et al., 2023 — AutoRound's method) as a weight pass: rounding and clipping tuned
per block against the block's output error, then stored like RTN and GPTQ.

Before a block's layers are solved, ``before_block`` tunes the rounding of all its linears jointly
(``qcompiler.algorithms.signround``): each step runs the block on one cached calibration batch
(inputs from the already quantized earlier blocks) with fake-quantized weights and compares its
outputs with the block's full-precision outputs on the same inputs. ``quantize_layer`` then turns
each layer's tuned rounding into codes on the GPTQ layout (``qc.quant_linear``): every backend,
export and client that runs GPTQ/RTN weights runs these. Mixture-of-experts weights, the head and
layers the tuning did not reach are rounded to nearest on the starting grid (with a note).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from qcompiler.algorithms.gptq import check_spec
from qcompiler.algorithms.signround import Rounding, rounding_result, tune_rounding
from qcompiler.errors import QuantizationError
from qcompiler.layouts import ExpertsFormat, UnpackableLayer, check_packable, stored_bits
from qcompiler.layouts.grid_result import from_quant_result
from qcompiler.passes.mixed_precision import candidate_grid, parse_candidate
from qcompiler.passes.rtn import rtn_layer_quant
from qcompiler.pipeline.block_walk import skip_reason
from qcompiler.pipeline.weight_quantizer import WeightQuantizer

__all__ = ["SignRound"]


@dataclass(frozen=True)
class SignRound(WeightQuantizer):
    """Replaces each linear inside a transformer block with ``qc.quant_linear`` holding its SignRound weight."""

    bits: int = 4
    group_size: int = 128
    sym: bool = False
    iters: int = 200  # signed-gradient steps per block (AutoRound's default)
    lr: Optional[float] = None  # None: 1/iters, falling linearly to 0
    start: str = "mse"  # the starting grid: "mse" (searched clipping) or "minmax" (AutoRound's)
    seed: int = 0  # the order calibration batches are drawn in
    # what the block's outputs are compared with: "fp" the full-precision model's, on its own inputs
    # (AutoRound's: a block also makes up for the earlier blocks' error); "sequential" the block's
    # full-precision weights on the quantized model's inputs (GPTQ's objective)
    target: str = "fp"
    # (module path, candidate such as "gptq-w3g64"): the layers whose bits / group size differ from
    # ``bits`` / ``group_size`` (a mixed-precision plan: ``AutoBits(finish="signround")``)
    plan: tuple[tuple[str, str], ...] = ()

    needs_calibration: ClassVar = True
    needs_hessian: ClassVar = True

    def __post_init__(self):
        check_spec(self.bits, self.group_size, self.start)
        super().__post_init__()
        if self.iters < 0:
            raise QuantizationError(f"SignRound: iters must be >= 0, got {self.iters}")
        if self.lr is not None and not self.lr > 0:
            raise QuantizationError(f"SignRound: lr must be positive, got {self.lr}")
        if self.target not in ("fp", "sequential"):
            raise QuantizationError(f"SignRound: target={self.target!r}; choose 'fp' or 'sequential'")
        object.__setattr__(self, "plan", tuple((str(p), str(n)) for p, n in self.plan))
        specs = {}
        for path, name in self.plan:
            method, bits, group = parse_candidate(name)
            if method not in ("gptq", "rtn") or candidate_grid(name) is not None:
                raise QuantizationError(f"SignRound: plan entry {path}: {name!r} is not a gptq-/rtn- candidate")
            check_spec(bits, group, self.start)
            specs[path] = (bits, group)
        object.__setattr__(self, "_specs", specs)
        object.__setattr__(self, "_tuned", {})  # layer path -> Rounding, for the block being solved
        object.__setattr__(self, "_fp_states", {})  # the full-precision model's inputs to the next block

    def before_block(self, gm, block, engine, ctx) -> None:
        """Tune the rounding of every linear of ``block`` that will be quantized, jointly."""
        self._tuned.clear()
        if engine.ranks.distributed:
            raise QuantizationError(
                "SignRound: distributed runs are not supported (its per-block gradient steps would need every rank's "
                "batches); run it in one process"
            )
        outputs = engine.block_outputs(block)
        quantized_inputs = [engine.block_inputs(b) for b in range(engine.batch_count)]
        fp_inputs = self._fp_states.get(id(engine))
        if fp_inputs is None or self.target == "sequential":  # the first block: both streams are the same
            fp_inputs = [state for state, _ in quantized_inputs]
        targets, following = [], []
        with torch.no_grad():  # the block still holds its full-precision weights
            for state, (_, mask) in zip(fp_inputs, quantized_inputs):
                values, after = engine.run_block(block, state, {}, outputs, next_state=self.target == "fp")
                targets.append(_float_outputs(values, mask))
                following.append(after)
        self._fp_states.clear()
        if self.target == "fp":
            self._fp_states[id(engine)] = following
        layers = [layer for layer in block.linears if self._tunable(gm, layer)]
        if not layers:
            return
        weights, nodes = {}, {}
        for layer in layers:
            stored = layer.weight(gm)  # [out, in] whatever the layout
            weights[layer.path] = stored.detach().float().to(engine.device or stored.device)
            nodes[layer.path] = (layer.weight_node, stored.dtype, layer.transposed)

        def block_loss(batch: int, trial: dict[str, torch.Tensor]) -> torch.Tensor:
            replace = {}
            for path, W_hat in trial.items():
                node, dtype, transposed = nodes[path]
                replace[node] = (W_hat.t() if transposed else W_hat).to(dtype)
            state, mask = quantized_inputs[batch]
            got = _float_outputs(engine.run_block(block, state, replace, outputs)[0], mask)
            return sum(torch.mean((g - t) ** 2) for g, t in zip(got, targets[batch])) / len(got)

        with torch.enable_grad():
            tuned, log = tune_rounding(
                weights,
                block_loss,
                engine.batch_count,
                bits=self.bits,
                group_size=self.group_size,
                sym=self.sym,
                iters=self.iters,
                lr=self.lr,
                start=self.start,
                seed=self.seed,
                specs={path: self._specs[path] for path in weights if path in self._specs},
            )
        self._tuned.update(tuned)
        line = (
            f"{block.name}: SignRound block output error {log.first_loss:.4g} (round to nearest) -> "
            f"{log.best_loss:.4g} (best at step {log.best_step} of {self.iters}, {len(layers)} linears)"
        )
        ctx.record.notes.append(line)
        ctx.log("  " + line)

    def _spec(self, path: str, planned: bool = False) -> tuple[int, int]:
        """``(bits, group size)`` of a layer: its plan entry's, else the pass's. ``planned``: a block
        linear, which a plan must name (a layer it misses would silently get the default bits)."""
        if planned and self._specs and path not in self._specs:
            raise QuantizationError(f"layer {path} is not in the SignRound plan")
        return self._specs.get(path, (self.bits, self.group_size))

    def _tunable(self, gm, layer) -> bool:
        if skip_reason(layer.path, self.ignore):
            return False
        try:
            check_packable(layer, layer.weight(gm), self._spec(layer.path, planned=True)[0])
        except UnpackableLayer:
            return False
        return True

    def quantize_layer(self, layer, W, H):
        """The layer's tuned rounding as codes; a layer without one is rounded to nearest."""
        tuned: Optional[Rounding] = self._tuned.pop(layer.path, None)
        bits, group = self._spec(layer.path, planned=True)
        if tuned is None:
            result = self._rtn(layer, W, H)
        else:
            res = rounding_result(W, Rounding(*(t.to(W.device) for t in tuned)), bits, group, self.sym)
            result = from_quant_result(layer, W, res, bits, group)
        if not self.plan:
            return result
        # as MixedPrecision reports a planned layer: its candidate and the bits its stored tensors take
        figures = {"candidate": dict(self.plan)[layer.path], "bits_per_weight": stored_bits(result.tensors) / W.numel()}
        return result._replace(figures={**result.figures, **figures})

    def _rtn(self, layer, W, H):
        bits, group = self._spec(layer.path)
        return rtn_layer_quant(layer, W, bits, group, self.sym, self.start, H)

    def head_quantizer(self):
        """The head is quantized by RTN on the starting grid when ``lm_head`` is set."""
        return self._rtn if self.lm_head else None

    def experts_format(self):
        """Experts in the GPTQ layout, rounded to nearest on the starting grid (not tuned)."""
        return ExpertsFormat(self._rtn, "RTN")


def _float_outputs(values: list, mask: Optional[torch.Tensor]) -> list[torch.Tensor]:
    """The floating-point tensors among a block's outputs as rows, the padded positions dropped."""
    rows = []
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            r = v.float().reshape(-1, v.shape[-1]) if v.dim() > 1 else v.float().reshape(-1, 1)
            if mask is not None and r.shape[0] == mask.numel():
                r = r[mask]
            rows.append(r)
    if not rows:
        raise QuantizationError("SignRound: the block has no floating-point output to compare")
    return rows
