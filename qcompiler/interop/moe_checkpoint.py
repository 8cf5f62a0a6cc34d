"""Mixture-of-experts layers as checkpoints store them: one matrix per expert.

transformers (5.x) keeps a MoE block's experts fused in memory (``mlp.experts.gate_up_proj``
``[E, 2I, H]`` with the gate half first, ``mlp.experts.down_proj`` ``[E, H, I]``) and converts on
load; checkpoints — what ``save_pretrained`` writes, and what vLLM, GPTQModel and transformers read —
hold each expert's projections apart, under the family's historical names (Mixtral:
``block_sparse_moe.experts.{e}.w1/w3/w2`` and ``block_sparse_moe.gate``; Qwen-MoE:
``mlp.experts.{e}.gate_proj/up_proj/down_proj``) — the compressed-tensors layout; GPTQ checkpoints
follow GPTQModel, which unfuses every family into ``mlp.experts.{e}.gate_proj/up_proj/down_proj``
(``UNFUSED_NAMES``). Quantized experts are cut per expert (and the fused
gate/up along its output features, so each half computes exactly its rows); FP expert tensors are
cut the same way. A MoE family not listed is refused by name rather than written under names no
client reads.
"""

from __future__ import annotations

import re

import torch

from qcompiler.algorithms.packing import pack_cols, unpack_cols
from qcompiler.interop.arch_specs import arch_specs
from qcompiler.interop.checkpoint import ExportError, QuantLayer
from qcompiler.ir.experts import find_expert_linears
from qcompiler.layouts.gptq import GPTQ_TENSORS

__all__ = ["EXPERT_NAMES", "UNFUSED_NAMES", "split_outputs", "expert_layers", "moe_checkpoint_names", "block_path"]

# model_type -> (the MoE block's checkpoint name, the gate / up / down projection names): arch_specs.py
EXPERT_NAMES = {t: spec.experts for t, spec in arch_specs().items() if spec.experts is not None}
# GPTQModel (7.x, on transformers 5) unfuses every family's experts into modules
# ``mlp.experts.{e}.gate_proj / up_proj / down_proj`` and reads the GPTQ tensors under those names
# ("Missing required quantized weights ... mlp.experts.1.gate_proj.qweight" for Mixtral's w1)
UNFUSED_NAMES = {model_type: ("mlp", ("gate_proj", "up_proj", "down_proj")) for model_type in EXPERT_NAMES}
_FUSED = re.compile(r"(?P<layer>.+)\.mlp\.experts\.(?P<param>gate_up_proj|down_proj)")


def block_path(name: str, model_type, layout: dict = EXPERT_NAMES) -> str:
    """``name`` with its layer's ``mlp.`` renamed to the family's MoE block name (Mixtral's router
    ``mlp.gate`` is ``block_sparse_moe.gate`` on disk); other families' names are unchanged."""
    block = layout.get(model_type, ("mlp",))[0]
    return name if block == "mlp" else re.sub(r"^(.+?\.layers\.\d+)\.mlp\.", rf"\1.{block}.", name)


def split_outputs(layer: QuantLayer, paths: list[str]) -> list[QuantLayer]:
    """``layer`` cut into ``len(paths)`` equal parts along its output features (codes, scales and
    zero points column-wise; zero points unpacked and packed again): part ``i`` computes exactly
    rows ``i`` of the fused layer. One path: the layer renamed, its tensors as they are."""
    if len(paths) == 1:
        return [QuantLayer(paths[0], layer.node, layer.tensors, layer.bits, layer.group_size)]
    t, n = layer.tensors, layer.tensors["scales"].shape[1]
    width = n // len(paths)
    zeros = unpack_cols(t["qzeros"], layer.bits, n)
    out = []
    for i, path in enumerate(paths):
        cols = slice(i * width, (i + 1) * width)
        tensors = {
            "qweight": t["qweight"][:, cols].contiguous(),
            "qzeros": pack_cols(zeros[:, cols], layer.bits),
            "scales": t["scales"][:, cols].contiguous(),
            "g_idx": t["g_idx"],
        }
        out.append(QuantLayer(path, layer.node, tensors, layer.bits, layer.group_size))
    return out


def _names(path: str, model_type, layout: dict) -> tuple[str, tuple[str, ...]]:
    """(the experts' checkpoint prefix, the projection names) of a fused expert parameter, or an error."""
    match = _FUSED.fullmatch(path)
    if match is None or model_type not in layout:
        raise ExportError(
            f"layer {path}: mixture-of-experts checkpoints are written for {sorted(EXPERT_NAMES)} "
            f"(model_type {model_type!r} has no known per-expert checkpoint names); export to ONNX or "
            f"save it with cm.save"
        )
    block, (gate, up, down) = layout[model_type]
    prefix = f"{match['layer']}.{block}.experts"
    return prefix, (gate, up) if match["param"] == "gate_up_proj" else (down,)


def expert_layers(layer: QuantLayer, model_type, layout: dict = EXPERT_NAMES) -> list[QuantLayer]:
    """A ``qc.quant_experts_linear`` layer (tensors stacked on a leading expert dim) as one GPTQ
    layer per expert and projection, under the checkpoint's names."""
    prefix, names = _names(layer.path, model_type, layout)
    out = []
    for e in range(layer.tensors["qweight"].shape[0]):
        one = QuantLayer(
            f"{prefix}.{e}", layer.node, {f: layer.tensors[f][e] for f in GPTQ_TENSORS}, layer.bits, layer.group_size
        )
        out += split_outputs(one, [f"{prefix}.{e}.{name}" for name in names])
    return out


def moe_checkpoint_names(
    tensors: dict[str, torch.Tensor], gm, model_type, layout: dict = EXPERT_NAMES
) -> dict[str, torch.Tensor]:
    """FP tensors under the checkpoint's names: fused FP experts cut per expert (``[out, in]``
    ``.weight`` each), and the rest of a renamed MoE block (Mixtral's router) renamed."""
    experts = {x.path: x for x in find_expert_linears(gm)} if any(map(_FUSED.fullmatch, tensors)) else {}
    out = {}
    for name, value in tensors.items():
        if _FUSED.fullmatch(name):
            if name not in experts:
                raise ExportError(f"tensor {name}: a fused expert parameter the graph does not read as experts")
            prefix, names = _names(name, model_type, layout)
            for e in range(value.shape[0]):
                weight = experts[name].expert_weight(value, e)  # [out, in]
                for part, rows in zip(names, weight.chunk(len(names), 0)):
                    out[f"{prefix}.{e}.{part}.weight"] = rows.contiguous()
        else:
            out[block_path(name, model_type, layout)] = value
    return out
