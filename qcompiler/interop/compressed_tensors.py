"""The compressed-tensors checkpoint format (what vLLM's llm-compressor writes and vLLM loads).

GPTQ/RTN layers → ``pack-quantized``: ``weight_packed`` int32 ``[out, in·bits/32]`` (codes offset by
``2^(bits−1)`` to signed and back, which leaves the bits exactly ours: it is ``qweight`` transposed),
``weight_scale`` ``[out, groups]``, ``weight_zero_point`` packed along the output dim (``qzeros``
transposed), ``weight_shape``. W8A8 layers → ``int-quantized``: int8 ``weight``, per-channel
``weight_scale``, dynamic per-token (or static per-tensor ``input_scale``) activations.

Not expressible, and refused with the layer named: act-order with scattered groups (the format
removed ``actorder: group``; static groups are fine), groups that do not divide ``in_features``,
SmoothQuant scales that could not be folded into a producer (BERT's post-LN blocks), SpQR.
"""

from __future__ import annotations

import torch

from qcompiler.algorithms.packing import unpack_cols
from qcompiler.interop import compressed_tensors_float  # noqa: F401  (registers the FP8 / NVFP4 / MXFP4 writers)
from qcompiler.interop.checkpoint import (
    DEFAULT_SHARD_BYTES,
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
from qcompiler.interop.moe_checkpoint import block_path, expert_layers, moe_checkpoint_names
from qcompiler.ir.graph import find_linears
from qcompiler.ir.op_registry import (
    OpArgs,
    args_of,
    implement,
    quantized_layer_path,
    refuse,
    register_target,
    spec_of,
)
from qcompiler.layouts.gptq import GPTQ_TENSORS

__all__ = ["export_compressed_tensors"]


def _weights_scheme(bits, group_size, sym):
    scheme = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False, "observer": "minmax"}
    if group_size == -1:
        scheme.update(strategy="channel", group_size=None)
    else:
        scheme.update(strategy="group", group_size=group_size)
    return scheme


def _pack_quantized(layer: QuantLayer, channel: bool) -> tuple[dict, dict]:
    """``channel``: one group spans each row, written as compressed-tensors' channel strategy."""
    qweight, qzeros, scales, g_idx = (layer.tensors[f] for f in GPTQ_TENSORS)
    bits, group_size, path = layer.bits, layer.group_size, layer.path
    n_in, n_out = g_idx.numel(), scales.shape[1]
    if channel:
        group_size = -1
    elif group_size > n_in:
        raise ExportError(
            f"layer {path}: group_size={group_size} is wider than its {n_in} inputs while the other "
            f"projections of its experts have several groups; vLLM and transformers fuse a MoE block's "
            f"projections and need one scheme for them: quantize with groups of at most {n_in}"
        )
    if group_size != -1:
        if n_in % group_size:
            raise ExportError(
                f"layer {path}: in_features={n_in} is not a multiple of group_size={group_size}, "
                f"which compressed-tensors requires"
            )
        if not torch.equal(g_idx.long(), torch.arange(n_in) // group_size):
            raise ExportError(
                f"layer {path}: act-order with scattered groups (g_idx) has no compressed-tensors form "
                f"(actorder 'group' was removed); use static groups, e.g. recipe gptq-w4g128-static"
            )
    zeros = unpack_cols(qzeros, bits, n_out)
    sym = bool((zeros == (1 << (bits - 1))).all())
    tensors = {
        "weight_packed": qweight.t().contiguous(),
        "weight_scale": scales.t().contiguous(),
        "weight_shape": torch.tensor([n_out, n_in], dtype=torch.int64),
    }
    if not sym:
        tensors["weight_zero_point"] = qzeros.t().contiguous()
    return tensors, {
        "format": "pack-quantized",
        "weights": _weights_scheme(bits, group_size, sym),
        "input_activations": None,
    }


def _gptq_layers(gm, a: OpArgs, path: str) -> list[tuple[str, dict, dict]]:
    """One ``(checkpoint path, tensors, scheme)`` per module: experts one per expert (``moe_checkpoint``)."""
    layer = gptq_layer(gm, a, path)
    model_type = model_config_of(gm).get("model_type")
    if layer.tensors["qweight"].dim() != 3:
        one = QuantLayer(block_path(path, model_type), a.node, layer.tensors, layer.bits, layer.group_size)
        # a group wider than the row is the channel strategy; one exactly as wide stays a group, as
        # the experts' are (transformers then finds one scheme for a MoE model's layers)
        return [(one.path, *_pack_quantized(one, layer.group_size > layer.tensors["g_idx"].numel()))]
    channel = _experts_per_channel(gm, path)
    return [(part.path, *_pack_quantized(part, channel)) for part in expert_layers(layer, model_type)]


def _experts_per_channel(gm, path: str) -> bool:
    """Whether a MoE block's experts are written per channel: vLLM and transformers fuse gate, up
    and down and read one scheme for all, so it is per channel only when one group spans the rows
    of every expert parameter of the block (``path``'s siblings)."""
    block = path.rpartition(".")[0]
    spans = []
    for node in gm.graph.nodes:
        spec = spec_of(node)
        if spec is not None and spec.name == "quant_experts_linear":
            a = args_of(node)
            if quantized_layer_path(a).rpartition(".")[0] == block:
                spans.append(int(a.group_size) >= a.tensor(gm, "g_idx").shape[-1])
    return all(spans)


def _int8_layer(gm, a: OpArgs, path: str) -> list[tuple[str, dict, dict]]:
    weight, weight_scale = a.tensors(gm, "weight", "weight_scale")
    if a.smooth_inv is not None:
        raise ExportError(
            f"layer {path}: its SmoothQuant scales are applied inside the activation quantizer "
            f"(no producer could absorb them), which compressed-tensors cannot express"
        )
    tensors = {"weight": weight, "weight_scale": weight_scale.reshape(-1, 1).float()}
    acts = {"num_bits": 8, "type": "int", "symmetric": True, "observer": None}
    if a.act_scale is None:
        acts.update(strategy="token", dynamic=True)
    else:
        acts.update(strategy="tensor", dynamic=False)
        tensors["input_scale"] = a.tensor(gm, "act_scale").float().reshape(1)
    scheme = {
        "format": "int-quantized",
        "weights": _weights_scheme(8, -1, True) | {"strategy": "channel"},
        "input_activations": acts,
    }
    return [(block_path(path, model_config_of(gm).get("model_type")), tensors, scheme)]


register_target("compressed-tensors", "exporter: compressed-tensors checkpoint folders (transformers, vLLM)")
implement("compressed-tensors", "quant_linear", _gptq_layers, kind="writer", label="pack-quantized")
implement(
    "compressed-tensors", "quant_experts_linear", _gptq_layers, kind="writer", label="pack-quantized, one per expert"
)
implement("compressed-tensors", "int8_linear", _int8_layer, kind="writer", label="int-quantized")
_NO_FORM = (
    "compressed-tensors cannot express it (supported: GPTQ/RTN weight-only, W8A8, FP8, NVFP4 and MXFP4 layers); "
    "export this "
    "recipe to ONNX or save it with cm.save"
)
refuse("compressed-tensors", "spqr_dense_linear", _NO_FORM)
refuse("compressed-tensors", "sparse_outlier_linear", _NO_FORM)
refuse("compressed-tensors", "spqr_experts_linear", _NO_FORM)
refuse("compressed-tensors", "hadamard", ONLINE_ROTATION)
refuse("compressed-tensors", "gguf_linear", GGUF_BLOCKS_ONLY)
refuse(
    "compressed-tensors",
    "quant_embedding",
    "quantized embeddings (QuantizeEmbeddings) are not written to compressed-tensors checkpoints (vLLM and "
    "transformers read embeddings unquantized there); quantize without QuantizeEmbeddings for this format",
)


# the client limit docs/formats.md ("Which client runs what") measured: said at export, not found at load
ASYMMETRIC_NOTE = (
    "note: this checkpoint has asymmetric integer groups (zero points); vLLM reads them, but transformers "
    "with compressed-tensors 0.20 cannot load them (it sizes the packed zero points wrong and refuses the "
    "file): for transformers quantize with a symmetric recipe (e.g. gptq-w4g128-sym)"
)


def export_compressed_tensors(
    cm,
    out_dir,
    *,
    progress=print,
    overwrite: bool = False,
    protect=(),
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
):
    """Write ``cm`` as a compressed-tensors checkpoint folder (atomic)."""
    if hasattr(cm, "materialize"):  # weights a compile(materialize=False) left on disk
        cm.materialize()
    gm = cm.graph_module if hasattr(cm, "graph_module") else cm
    config = model_config_of(gm)
    tensors, groups, consumed, kv_cache = {}, {}, set(), None
    transposed = set(getattr(gm.meta.get("qcompiler"), "transposed_layers", ()))
    for a, path, write in layer_writers(gm, "compressed-tensors", "compressed-tensors"):
        if path in transposed:  # measured: transformers then runs the random-init Conv1D (rel. error 0.79)
            raise ExportError(
                f"{path} is a quantized Conv1D layer ({config.get('model_type', 'this model')}); transformers' "
                "and vLLM's compressed-tensors loaders quantize nn.Linear only and would leave it random: "
                "export --format gptq or onnx-genai"
            )
        for module, layer_tensors, scheme in write(gm, a, path):
            tensors.update({f"{module}.{k}": v for k, v in layer_tensors.items()})
            if "kv_cache_scheme" in scheme:  # an attention's k/v scale: no config group of its own
                kv_cache = scheme["kv_cache_scheme"]
                continue
            key = repr(sorted(scheme.items(), key=str))
            groups.setdefault(key, (scheme, []))[1].append(module)
        consumed.update(n.target for n in a.stored() if not n.target.endswith(".bias"))
    fp = in_source_dtype(fp_tensors(gm, consumed), config, gm)
    tensors.update(moe_checkpoint_names(fp, gm, config.get("model_type")))
    formats = {scheme["format"] for scheme, _ in groups.values()}
    config_groups = {
        f"group_{i}": {"targets": sorted(paths), **{k: v for k, v in scheme.items()}}
        for i, (scheme, paths) in enumerate(groups.values())
    }
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision" if formats else "dense",
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": sorted(block_path(layer.path, config.get("model_type")) for layer in find_linears(gm)),
        "kv_cache_scheme": kv_cache,
    }
    progress(
        f"compressed-tensors checkpoint: {sum(len(p) for _, p in groups.values())} layers in "
        f"{len(groups)} scheme group(s)"
    )
    if any(
        scheme["weights"].get("type") == "int" and not scheme["weights"].get("symmetric")
        for scheme, _ in groups.values()
    ):
        progress(ASYMMETRIC_NOTE)
    return write_checkpoint(
        out_dir,
        tensors,
        config,
        kind="compressed-tensors",
        gm=gm,
        overwrite=overwrite,
        protect=protect,
        max_shard_bytes=max_shard_bytes,
        progress=progress,
    )
