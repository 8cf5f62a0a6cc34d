"""Mixed precision: each linear quantized by its own method and width, as a plan names them.

A plan is data — ``(("model.layers.0.self_attn.q_proj", "gptq-w4g128"), ...)`` — so it can be written
by hand in a recipe file, or chosen under a bit budget by ``AutoBits`` (passes/auto_bits.py). Every
candidate name is ``METHOD-wBITSgGROUP`` with METHOD ``rtn``, ``gptq`` or ``spqr``, or ``METHOD-TYPE``
with METHOD ``rtn`` or ``gptq`` and TYPE a llama.cpp block type (``gptq-q4_k``, ``gptq-q6_k``, ...: the
layer keeps llama.cpp's bytes, so such a mix runs in eager, ONNX Runtime and llama.cpp, as llama.cpp's own ``_M``
mixes do) or a floating-point format GPUs serve (``gptq-fp8``, ``gptq-fp8-block``, ``gptq-nvfp4``,
``gptq-mxfp4``: each layer in that format's layout, as ModelOpt's AutoQuantize mixes them); the result is
one graph whose ``qc.quant_linear`` nodes carry their own bits and group size (SpQR layers: its dense +
sparse ops), which every backend runs node by node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar, Optional

from qcompiler.algorithms.float_grid import FLOAT_FORMATS
from qcompiler.algorithms.gguf_grids import FORMATS
from qcompiler.errors import QuantizationError
from qcompiler.layouts import stored_bits
from qcompiler.passes.gptq import GPTQ
from qcompiler.passes.rtn import RTN
from qcompiler.passes.spqr import SpQR
from qcompiler.pipeline.weight_quantizer import WeightQuantizer

__all__ = ["MixedPrecision", "candidate_quantizer", "parse_candidate", "candidate_grid", "CANDIDATE_FORMAT"]

CANDIDATE_FORMAT = (
    "METHOD-wBITSgGROUP (METHOD rtn, gptq or spqr; e.g. gptq-w4g128, rtn-w8g128, spqr-w3g16) or METHOD-TYPE "
    f"(METHOD rtn or gptq, TYPE a llama.cpp block type: {', '.join(FORMATS)}; "
    f"or a floating-point format: {', '.join(FLOAT_FORMATS)})"
)
_CANDIDATE = re.compile(r"^(rtn|gptq|spqr)-w(\d+)g(\d+)$")
_GRID_CANDIDATE = re.compile(r"^(rtn|gptq)-([a-z0-9_-]+)$")


def candidate_grid(name: str) -> Optional[str]:
    """The llama.cpp block type (``gptq-q4_k``) or floating-point format (``gptq-nvfp4``) a candidate
    quantizes on (None for the integer ``wBITSgGROUP`` ones)."""
    match = _GRID_CANDIDATE.match(name)
    grid = match.group(2) if match is not None else None
    return grid if grid in FORMATS or grid in FLOAT_FORMATS else None


def parse_candidate(name: str) -> tuple[str, int, int]:
    """``(method, bits, group size)`` of a candidate name such as ``gptq-w4g128`` (``gptq-q4_k``: its
    type's code width and sub-block; ``gptq-nvfp4``: its element width and scale group)."""
    grid = candidate_grid(name)
    if grid in FLOAT_FORMATS:
        return name.split("-", 1)[0], FLOAT_FORMATS[grid].bits, FLOAT_FORMATS[grid].group
    if grid is not None:
        return name.split("-", 1)[0], FORMATS[grid].bits, FORMATS[grid].sub_block
    match = _CANDIDATE.match(name)
    if match is None:
        raise QuantizationError(f"candidate {name!r} is not {CANDIDATE_FORMAT}")
    return match.group(1), int(match.group(2)), int(match.group(3))


@lru_cache(maxsize=None)
def candidate_quantizer(name: str) -> WeightQuantizer:
    """The weight quantizer a candidate name stands for, with the project's measured best settings
    (GPTQ: act-order with static groups and the error-minimizing grid, docs/methods/gptq.md)."""
    method, bits, group = parse_candidate(name)
    grid = candidate_grid(name)
    if method == "rtn":
        return RTN(bits=bits, group_size=group, grid=grid or "mse")
    if method == "gptq":
        return GPTQ(bits=bits, group_size=group, grid=grid or "mse")
    return SpQR(bits=bits, group_size=group)


@dataclass(frozen=True)
class MixedPrecision(WeightQuantizer):
    """Quantizes each block linear with the candidate its plan names (``default`` for the others)."""

    plan: tuple[tuple[str, str], ...] = ()  # (module path, candidate name)
    default: str = ""  # candidate for layers the plan does not name; "" = a layer it misses is an error

    needs_calibration: ClassVar = True
    needs_hessian: ClassVar = True

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "plan", tuple((str(p), str(c)) for p, c in self.plan))
        for _path, name in self.plan:
            candidate_quantizer(name)
        if self.default:
            candidate_quantizer(self.default)
        if not self.plan and not self.default:
            raise QuantizationError("MixedPrecision needs a plan of (layer, candidate) pairs or a default candidate")

    def candidate_of(self, path: str) -> str:
        """The candidate name for layer ``path``."""
        chosen = dict(self.plan).get(path, self.default)
        if not chosen:
            raise QuantizationError(f"layer {path} is not in the MixedPrecision plan and there is no default")
        return chosen

    def quantize_layer(self, layer, W, H):
        """The layer's planned candidate on it; the report names the candidate."""
        return self._named(layer, candidate_quantizer(self.candidate_of(layer.path)).quantize_layer(layer, W, H), W)

    def row_split_unit(self, layer):
        """The planned candidate's."""
        return candidate_quantizer(self.candidate_of(layer.path)).row_split_unit(layer)

    def quantize_row_range(self, layer, W, H, start, stop):
        """Rows ``[start, stop)`` by the planned candidate."""
        quantizer = candidate_quantizer(self.candidate_of(layer.path))
        return self._named(layer, quantizer.quantize_row_range(layer, W, H, start, stop), W[start:stop])

    def quantize_rows(self, layer, W, H, rows):
        """Rows ``rows`` by the planned candidate."""
        quantizer = candidate_quantizer(self.candidate_of(layer.path))
        return self._named(layer, quantizer.quantize_rows(layer, W, H, rows), W.index_select(0, rows))

    def _named(self, layer, result, W):
        bits_per_weight = stored_bits(result.tensors) / W.numel()  # as bits_per_parameter counts the stored tensors
        name = self.candidate_of(layer.path)
        return result._replace(figures={**result.figures, "candidate": name, "bits_per_weight": bits_per_weight})
