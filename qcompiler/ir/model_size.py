"""The whole model's size, counted from the stored tensors: "4.156 bits per quantized weight" says
nothing of a model whose largest tensor (a 262k-token embedding) stays 16-bit, so every command
that states a size states it over all parameters too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from torch.fx import GraphModule, Node

from qcompiler.ir.op_registry import OpArgs, spec_of
from qcompiler.ir.tensors import get_raw_tensor

__all__ = ["ModelSize", "model_size"]


@dataclass(frozen=True)
class ModelSize:
    """Stored bytes of every tensor the model keeps, and the parameters they stand for."""

    stored_bytes: int  # every stored tensor once (a tied table once), codes, scales, indices and all
    parameters: int  # the model's parameters: each quantized weight once, every other parameter's elements
    quantized_parameters: int  # the weights of the quantized layers
    quantized_bits: int  # the bits those layers store (codes, zero points, scales: bits_per_parameter's count)

    @property
    def bits_per_parameter(self) -> float:
        """Stored bits over all parameters: what the file costs per parameter of the model."""
        return 8 * self.stored_bytes / self.parameters if self.parameters else 0.0

    @property
    def bits_per_quantized_weight(self) -> float | None:
        """Bits per weight over the quantized layers alone (None: nothing is quantized)."""
        return self.quantized_bits / self.quantized_parameters if self.quantized_parameters else None

    def describe(self) -> str:
        """One line: size, bits over all parameters, and what part is quantized at what width."""
        line = (
            f"{self.stored_bytes / 1e6:.1f} MB, {self.bits_per_parameter:.3f} bits per parameter over all "
            f"{self.parameters / 1e6:.2f} M parameters"
        )
        per_weight = self.bits_per_quantized_weight
        if per_weight is None:
            return line + " (no layer quantized)"
        share = 100 * self.quantized_parameters / self.parameters
        return line + f" ({per_weight:.3f} bits per quantized weight over the {share:.0f} % quantized)"

    @classmethod
    def from_counts(cls, counts) -> "ModelSize | None":
        """The four counts as :meth:`as_dict` wrote them (a manifest is untrusted: None unless each is
        a non-negative integer; an artifact written before sizes were recorded has none)."""
        keys = ("stored_bytes", "parameters", "quantized_parameters", "quantized_bits")
        if not isinstance(counts, dict) or not all(type(counts.get(k)) is int and counts[k] >= 0 for k in keys):
            return None
        return cls(*(counts[k] for k in keys))

    def as_dict(self) -> dict:
        """The four counts (the manifest keeps them, so ``inspect`` need not load the tensors)."""
        return {
            "stored_bytes": self.stored_bytes,
            "parameters": self.parameters,
            "quantized_parameters": self.quantized_parameters,
            "quantized_bits": self.quantized_bits,
        }


def _nbytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    return t.numel() * (t.element_size() if dtype is None else dtype.itemsize)


def model_size(gm: GraphModule, stored_as: Mapping[str, torch.dtype] | None = None) -> ModelSize:
    """Count ``gm``'s stored tensors (a streamed graph's placeholders by shape, never read);
    ``stored_as``: tensors a writer stores in another dtype than the graph holds them, counted so."""
    auxiliary: set[str] = set()  # codes, scales, g_idx, ...: stored, but no parameter of the model
    quantized_parameters = quantized_bits = 0
    counted: set[tuple] = set()  # storage already counted: a tied head reads its embedding's tensors
    for node in gm.graph.nodes:
        op_spec = spec_of(node)
        if op_spec is None or not op_spec.storage:
            continue
        a = OpArgs(op_spec, node)
        arguments = a.as_dict()
        stored = tuple(getattr(arguments[n], "target", id(arguments[n])) for n in op_spec.storage)
        if stored in counted:
            continue
        counted.add(stored)
        quantized_bits += sum(8 * _nbytes(a.stored_like(gm, n)) for n in op_spec.storage)
        if op_spec.weights is not None:
            quantized_parameters += op_spec.weights(a, gm)
        auxiliary |= {
            v.target for k, v in a.as_dict().items() if isinstance(v, Node) and v.op == "get_attr" and k != "bias"
        }
    stored_bytes, parameters, seen = 0, quantized_parameters, set()
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target in seen:
            continue
        seen.add(node.target)
        t = get_raw_tensor(gm, node.target)
        if not hasattr(t, "element_size"):  # a submodule target, no tensor
            continue
        stored_bytes += _nbytes(t, (stored_as or {}).get(node.target))
        if isinstance(t, torch.nn.Parameter) and node.target not in auxiliary:  # not a buffer (rope tables)
            parameters += t.numel()
    return ModelSize(stored_bytes, parameters, quantized_parameters, quantized_bits)
