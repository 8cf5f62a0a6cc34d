"""GPTQ-format Hugging Face checkpoints: export a quantized graph; import one through the compile
pipeline (the ``LoadGPTQCheckpoint`` pass).

Per quantized layer the checkpoint holds ``{path}.qweight`` (int32 ``[in·bits/32, out]``),
``{path}.qzeros`` (int32 ``[groups, out·bits/32]``), ``{path}.scales`` (fp16 ``[groups, out]``) and
``{path}.g_idx`` (int32 ``[in]``), the same layout as ``qc.quant_linear``, plus every other tensor
under its usual name; ``config.json`` carries ``quantization_config`` (quant_method ``gptq``, bits,
group_size, desc_act, sym, checkpoint_format).

Zero points. ``checkpoint_format: "gptq"`` (v1, what AutoGPTQ, transformers and vLLM's GPTQ
kernels read) stores ``zero − 1`` — the historical AutoGPTQ offset — wrapped to ``bits`` bits, and
loaders add the 1 back; a real zero of 0 cannot survive that round trip. ``"gptq_v2"`` (GPTQModel)
stores the real zero, as qcompiler does internally. ``zero_format="auto"`` writes v1 when every zero
is ≥ 1 and v2 otherwise, and says which; ``"v1"`` refuses (naming the layer) rather than write a
checkpoint that loads wrong.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import torch

from qcompiler.algorithms.gptq import groups_in_column_order
from qcompiler.algorithms.packing import unpack_cols
from qcompiler.interop.checkpoint import (
    DEFAULT_SHARD_BYTES,
    FLOAT_FORMATS_ONLY,
    FP8_KV_CACHE_ONLY_CT,
    GGUF_BLOCKS_ONLY,
    ONLINE_ROTATION,
    ExportError,
    QuantLayer,
    fp_tensors,
    gptq_layer,
    in_source_dtype,
    layer_writers,
    model_config_of,
    write_checkpoint,
)
from qcompiler.interop.moe_checkpoint import UNFUSED_NAMES, expert_layers, moe_checkpoint_names, split_outputs
from qcompiler.ir.op_registry import args_of, implement, refuse, register_target
from qcompiler.layouts.gptq import GPTQ_TENSORS
from qcompiler.layouts.gptq_format import SPLIT_PROJECTIONS, zeros_from_v1, zeros_to_v1

__all__ = ["export_gptq", "zeros_to_v1", "zeros_from_v1", "V1_ASYMMETRIC_NOTE"]

V1_ASYMMETRIC_NOTE = (
    "note: asymmetric groups in v1 zero points: AutoGPTQ-era loaders read them, but GPTQModel (and "
    "transformers' GPTQ support through it) refuses asymmetric v1 files from other quantizers; for "
    "GPTQModel export with zero_format='v2' (--zero-format v2)"
)

register_target("gptq", "exporter: GPTQ checkpoint folders (transformers, GPTQModel, vLLM)")
implement("gptq", "quant_linear", gptq_layer, kind="writer", label="qweight/qzeros/scales/g_idx")
_ONLY_GPTQ = (
    "the GPTQ format holds only weight-only GPTQ/RTN layers (qc.quant_linear); export this recipe to "
    "ONNX or save it with cm.save"
)
implement("gptq", "quant_experts_linear", gptq_layer, kind="writer", label="one GPTQ layer per expert")
refuse("gptq", "int8_linear", _ONLY_GPTQ)
refuse("gptq", "spqr_dense_linear", _ONLY_GPTQ)
refuse("gptq", "sparse_outlier_linear", _ONLY_GPTQ)
refuse("gptq", "spqr_experts_linear", _ONLY_GPTQ)
refuse("gptq", "hadamard", ONLINE_ROTATION)
refuse("gptq", "gguf_linear", GGUF_BLOCKS_ONLY)
for _op in ("fp8_linear", "nvfp4_linear", "mxfp4_linear"):
    refuse("gptq", _op, FLOAT_FORMATS_ONLY)
refuse("gptq", "fp8_kv_quant", FP8_KV_CACHE_ONLY_CT)
refuse(
    "gptq",
    "quant_embedding",
    "a GPTQ checkpoint holds quantized linears only (its loaders read embeddings in 16 bits); quantize without "
    "QuantizeEmbeddings for --format gptq",
)


def _for_loaders(layer: QuantLayer, model_type) -> list[QuantLayer]:
    """``layer`` as the loaders want it: experts one per expert under GPTQModel's names
    (``moe_checkpoint.UNFUSED_NAMES``), a fused projection in halves where they read it apart
    (``SPLIT_PROJECTIONS``: GPTQModel's Phi-3 reports "Missing required quantized weights ...
    gate_proj.qweight" for a fused gate_up_proj), anything else under its checkpoint name."""
    if layer.tensors["qweight"].dim() == 3:
        return expert_layers(layer, model_type, UNFUSED_NAMES)
    base, _, name = layer.path.rpartition(".")
    parts = SPLIT_PROJECTIONS.get(model_type, {}).get(name)
    return split_outputs(layer, [f"{base}.{part}" for part in parts or (name,)])


def _base_setting(layers: list) -> tuple[int, int, dict]:
    """One base ``(bits, group_size)`` — the one holding the most weights — and the other layers'
    settings as GPTQModel's per-module ``dynamic`` overrides (regular expressions of their paths)."""
    weights = Counter()
    for layer in layers:
        weights[(layer.bits, layer.group_size)] += layer.tensors["g_idx"].numel() * layer.tensors["scales"].shape[1]
    bits, group_size = weights.most_common(1)[0][0]
    dynamic = {
        f"+:{re.escape(layer.path)}$": {"bits": layer.bits, "group_size": layer.group_size}
        for layer in layers
        if (layer.bits, layer.group_size) != (bits, group_size)
    }
    return bits, group_size, dynamic


def export_gptq(
    cm,
    out_dir,
    *,
    zero_format: str = "auto",
    progress=print,
    overwrite: bool = False,
    protect=(),
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write ``cm``'s GPTQ/RTN layers as a GPTQ Hugging Face checkpoint folder (atomic)."""
    if zero_format not in ("auto", "v1", "v2"):
        raise ValueError(f"zero_format must be 'auto', 'v1' or 'v2', got {zero_format!r}")
    if hasattr(cm, "materialize"):  # weights a compile(materialize=False) left on disk
        cm.materialize()
    gm = cm.graph_module if hasattr(cm, "graph_module") else cm
    config = model_config_of(gm)
    layers = [write(gm, a, path) for a, path, write in layer_writers(gm, "gptq", "GPTQ")]
    layers = [part for layer in layers for part in _for_loaders(layer, config.get("model_type"))]
    if not layers:
        raise ExportError("the graph has no GPTQ/RTN layer (qc.quant_linear) to write")
    bits, group_size, dynamic = _base_setting(layers)

    def zeros(layer) -> torch.Tensor:
        return unpack_cols(layer.tensors["qzeros"], layer.bits, layer.tensors["scales"].shape[1])

    zero_layers = [layer.path for layer in layers if (zeros(layer) == 0).any()]
    if zero_format == "v1" and zero_layers:
        raise ExportError(
            f"layer {zero_layers[0]} has zero points equal to 0, which the v1 format (stored zero − 1) "
            f"cannot hold; use zero_format='v2' (GPTQModel) or a symmetric recipe"
        )
    v1 = zero_format == "v1" or (zero_format == "auto" and not zero_layers)
    consumed = {getattr(args_of(layer.node), name).target for layer in layers for name in GPTQ_TENSORS}
    fp = in_source_dtype(fp_tensors(gm, consumed), config, gm)
    tensors = moe_checkpoint_names(fp, gm, config.get("model_type"), UNFUSED_NAMES)
    for layer in layers:
        t = dict(layer.tensors)
        if v1:
            t["qzeros"] = zeros_to_v1(t["qzeros"], layer.bits, t["scales"].shape[1])
        tensors.update({f"{layer.path}.{name}": value for name, value in t.items()})
    desc_act = any(not groups_in_column_order(layer.tensors["g_idx"], layer.group_size) for layer in layers)
    sym = all(bool((zeros(layer) == (1 << (layer.bits - 1))).all()) for layer in layers)
    quant = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "checkpoint_format": "gptq" if v1 else "gptq_v2",
        "pack_dtype": "int32",
        "lm_head": any(layer.path.rsplit(".", 1)[-1] in ("lm_head", "embed_out") for layer in layers),
        "meta": {"quantizer": ["qcompiler"], "zero_points": "stored minus 1 (v1)" if v1 else "real (v2)"},
    }
    if dynamic:
        quant["dynamic"] = dynamic
    config["quantization_config"] = quant
    progress(
        f"GPTQ checkpoint: {len(layers)} layers, {bits}-bit, group {group_size}"
        + (f" ({len(dynamic)} with their own settings)" if dynamic else "")
        + ", "
        f"{'v1' if v1 else 'v2'} zero points{_why_v2(v1, zero_layers)}"
    )
    if v1 and not sym:
        progress(V1_ASYMMETRIC_NOTE)
    return write_checkpoint(
        out_dir,
        tensors,
        config,
        {"quantize_config.json": quant},
        kind="gptq",
        gm=gm,
        overwrite=overwrite,
        protect=protect,
        max_shard_bytes=max_shard_bytes,
        progress=progress,
    )


def _why_v2(v1: bool, zero_layers: list[str]) -> str:
    """Why the file holds real (v2) zero points: only say v1 cannot hold them when some are 0."""
    if v1:
        return ""
    return " (some zeros are 0: v1 cannot hold them)" if zero_layers else " (as asked)"
