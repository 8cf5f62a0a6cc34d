"""Loading a GPTQ checkpoint's packed layers into a captured graph: the import as an ordinary pass.

Each layer the checkpoint quantized becomes ``qc.quant_linear`` on the checkpoint's own tensors,
bit for bit (v1 zero points converted). Running it on the normal compile pipeline gives an imported
model what a compiled one has: the KV-cache graphs and ``generate``, every backend, ``save``.
The other weights are the model's own: load them from the checkpoint first (``import_gptq`` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch.fx import GraphModule

from qcompiler.errors import QuantizationError
from qcompiler.ir.graph import find_linears
from qcompiler.ir.node_swap import replace_linear
from qcompiler.layouts.gptq_format import read_gptq_checkpoint
from qcompiler.pipeline.pass_base import GraphProperty, Pass, PassContext

__all__ = ["LoadGPTQCheckpoint"]


@dataclass(frozen=True)
class LoadGPTQCheckpoint(Pass):
    """Replaces each linear quantized in the GPTQ checkpoint ``folder`` with its packed tensors."""

    folder: str = ""

    requires: ClassVar = frozenset()
    provides: ClassVar = frozenset({GraphProperty.QUANTIZED_WEIGHTS})
    noop_after: ClassVar = frozenset({GraphProperty.QUANTIZED_WEIGHTS, GraphProperty.INT8_LOWERED})

    def __post_init__(self):
        if not self.folder:
            raise QuantizationError("LoadGPTQCheckpoint(folder=...) needs the checkpoint folder")

    def run(self, gm: GraphModule, ctx: PassContext) -> bool:
        """Swap each linear the checkpoint holds for ``qc.quant_linear`` with the checkpoint's packed tensors."""
        ckpt = read_gptq_checkpoint(self.folder)
        layers = {layer.path: layer for layer in find_linears(gm)}
        unknown = sorted(set(ckpt.layers) - set(layers))
        if unknown:
            raise QuantizationError(
                f"checkpoint layer {unknown[0]} is not a linear layer of this graph "
                f"({len(unknown)} such; the graph's linears: {', '.join(sorted(layers)[:4])}, ...)"
            )
        ctx.log(
            f"{self.name}: {len(ckpt.layers)} layers, {ckpt.bits}-bit, group {ckpt.group_size}, "
            f"{'v1' if ckpt.v1 else 'v2'} zero points"
        )
        for path in sorted(ckpt.layers):
            layer = layers[path]
            bits, group_size = ckpt.settings(path)  # per-module overrides (``dynamic``) or the base
            replace_linear(
                gm,
                layer,
                "quant_linear",
                ckpt.packed(path),
                lambda x, a, layer=layer, bits=bits, group_size=group_size: dict(
                    x=x, **a, bias=layer.bias_node, bits=bits, group_size=group_size
                ),
            )
            ctx.record.layers[path] = {"bits": bits, "group_size": group_size}
        ctx.record.notes.append(f"packed tensors from {self.folder} ({ckpt.quant.get('checkpoint_format', 'gptq')})")
        return True
