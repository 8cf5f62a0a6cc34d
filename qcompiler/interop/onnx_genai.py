"""A folder that onnxruntime-genai runs as is: ``model.onnx`` + ``genai_config.json`` + tokenizer files.

The KV-cache graph's ONNX export already has the input/output contract genai's decoder-only
models use (``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values.N.key/value``
in; ``logits``, ``present.N.key/value`` out). Quantized linears are ``MatMulNBits`` (GPTQ/RTN,
SpQR's dense part) and ``MatMulInteger`` (W8A8), standard attention one ``GroupQueryAttention``
node per layer, as in every qcompiler ONNX export of a KV-cache graph (docs/backends/onnx.md).

When every layer's cache goes straight through its ``GroupQueryAttention`` node, the folder is
rewritten to genai's shared-buffer contract (``past_present_share_buffer``, as its own model
builder writes): genai then keeps one ``[batch, kv_heads, max_length, head]`` buffer per cache
that the node appends to in place. Otherwise every decode step copies the whole past into a new
present (measured: most of the gap to the builder's int4 model at 32 layers, docs/results.md).
The node's lengths then come from the mask (``seqlens_k`` = row sum − 1, the total = its width)
and the model's own mask is dropped (causal masking is the node's own). A sliding-window cache
(its present a slice) is never shared, and such a model's context is capped at the window.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import onnx
from onnx import TensorProto, helper

from qcompiler.files.atomic import publish_directory
from qcompiler.interop.arch_specs import arch_spec
from qcompiler.interop.checkpoint import ExportError, source_folder, write_tokenizer_files

__all__ = ["export_onnx_genai", "genai_config"]


def cache_window(config: dict) -> Optional[int]:
    """The sliding window of a model that attends through one: its cache keeps the last
    ``window − 1`` positions, while genai sizes every present as past + new tokens."""
    window = config.get("sliding_window")
    if not isinstance(window, int) or window <= 0 or config.get("use_sliding_window") is False:
        return None
    return window


def genai_config(cm) -> dict:
    """``genai_config.json`` for ``cm``'s cache graph (greedy search by default). A sliding-window
    model's context is capped at ``window − 1`` tokens: past that its cache stops growing and genai,
    which expects present = past + new, fails (measured on a Mistral with an 8-token window)."""
    layout = cm.cache_layout
    config = cm.capture_info.model_config or {}
    if layout is None:
        raise ExportError(
            f"the onnx-genai format needs a causal LM captured with its KV cache; this graph of "
            f"{cm.capture_info.model_class} has none (an encoder, or captured with use_cache=False)"
        )
    if len(set(layout.heads)) != 1 or len(set(layout.key_dims + layout.value_dims)) != 1:
        raise ExportError(
            f"onnxruntime-genai needs the same KV heads and head size in every layer; this model has "
            f"heads {sorted(set(layout.heads))}, "
            f"head sizes {sorted(set(layout.key_dims + layout.value_dims))}"
        )
    window = cache_window(config)
    context = layout.max_length if window is None else min(layout.max_length, window - 1)
    inputs = {
        "input_ids": "input_ids",
        "attention_mask": "attention_mask",
        "past_key_names": "past_key_values.%d.key",
        "past_value_names": "past_key_values.%d.value",
    }
    if layout.uses_position_ids:
        inputs["position_ids"] = "position_ids"
    hidden = config.get("hidden_size") or config.get("n_embd")
    heads = config.get("num_attention_heads") or config.get("n_head") or layout.heads[0]
    eos = config.get("eos_token_id")
    model_type = arch_spec(config.get("model_type")).genai_type  # genai picks its runtime by it
    return {
        "model": {
            "type": model_type,
            "vocab_size": config.get("vocab_size"),
            "context_length": context,
            "bos_token_id": config.get("bos_token_id") if config.get("bos_token_id") is not None else 0,
            "eos_token_id": eos if eos is not None else 0,  # genai needs one; a model without EOS gets id 0
            "pad_token_id": config.get("pad_token_id")
            if config.get("pad_token_id") is not None
            else (eos[0] if isinstance(eos, list) else eos if eos is not None else 0),
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": "model.onnx",
                "head_size": layout.key_dims[0],
                "hidden_size": hidden,
                "num_attention_heads": heads,
                "num_key_value_heads": layout.heads[0],
                "num_hidden_layers": layout.layers,
                "inputs": inputs,
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {
            "do_sample": False,
            "num_beams": 1,
            "num_return_sequences": 1,
            "max_length": context,
            "min_length": 0,
            "past_present_share_buffer": False,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
            "repetition_penalty": 1.0,
            "length_penalty": 1.0,
            "no_repeat_ngram_size": 0,
            "diversity_penalty": 0.0,
            "early_stopping": True,
        },
    }


def share_kv_buffers(path: Path, layers: int) -> bool:
    """Rewrite ``path`` (an export's ``model.onnx``, weights untouched) so that each
    ``GroupQueryAttention`` reads its lengths from ``attention_mask`` and no mask tensor; True when
    done, False (file untouched) when some layer's cache does not go straight through the node."""
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    inputs, outputs = {i.name for i in graph.input}, {o.name for o in graph.output}
    attention = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    if (
        "attention_mask" not in inputs
        or len(attention) != layers
        or any(
            len(n.input) < 11
            or n.input[3] not in inputs
            or n.input[4] not in inputs
            or n.output[1] not in outputs
            or n.output[2] not in outputs
            for n in attention
        )
    ):
        return False
    lengths = [
        helper.make_node("Cast", ["attention_mask"], ["qc_mask_int64"], to=TensorProto.INT64),
        helper.make_node("ReduceSum", ["qc_mask_int64", "qc_axis_1"], ["qc_mask_rows"], keepdims=0),
        helper.make_node("Sub", ["qc_mask_rows", "qc_one"], ["qc_seqlens_k_int64"]),
        helper.make_node("Cast", ["qc_seqlens_k_int64"], ["qc_seqlens_k"], to=TensorProto.INT32),
        helper.make_node("Shape", ["attention_mask"], ["qc_total_int64"], start=1, end=2),
        helper.make_node("Cast", ["qc_total_int64"], ["qc_total_length"], to=TensorProto.INT32),
    ]
    graph.initializer.extend(
        [
            helper.make_tensor("qc_axis_1", TensorProto.INT64, [1], [1]),
            helper.make_tensor("qc_one", TensorProto.INT64, [], [1]),
        ]
    )
    for node in attention:  # inputs 5, 6, 10: seqlens_k, total_sequence_length, attention_bias
        node.input[5], node.input[6], node.input[10] = "qc_seqlens_k", "qc_total_length", ""
    needed, kept = set(outputs), []
    for node in reversed([*lengths, *graph.node]):  # drop what only computed the old lengths and mask
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(i for i in node.input if i)
    graph.ClearField("node")
    graph.node.extend(reversed(kept))
    used = [t for t in graph.initializer if t.name in needed]
    graph.ClearField("initializer")
    graph.initializer.extend(used)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return True


def export_onnx_genai(
    cm,
    out_dir,
    *,
    accuracy_level: Optional[int] = None,
    overwrite: bool = False,
    progress=print,
    fused_attention: bool = True,
    protect=(),
) -> Path:
    """Write ``cm`` as an onnxruntime-genai model folder (published atomically)."""
    out_dir = Path(out_dir)
    config = genai_config(cm)
    protect = (*protect, *source_folder(cm.graph_module))
    with publish_directory(out_dir, "onnx-genai", overwrite=overwrite, protect=protect) as tmp:
        progress(f"exporting {cm.capture_info.model_class} ({cm.recipe.name}) to ONNX with its KV cache")
        cm.export_onnx(tmp / "model.onnx", accuracy_level=accuracy_level, fused_attention=fused_attention)
        config["search"]["past_present_share_buffer"] = share_kv_buffers(
            tmp / "model.onnx", config["model"]["decoder"]["num_hidden_layers"]
        )
        if config["model"]["context_length"] < cm.cache_layout.max_length:
            progress(
                f"context capped at {config['model']['context_length']} tokens: the model's sliding-window "
                f"cache keeps only that many, and onnxruntime-genai expects every step's cache to grow"
            )
        (tmp / "genai_config.json").write_text(json.dumps(config, indent=2) + "\n")
        written = write_tokenizer_files(tmp, cm.graph_module)
        shared = "shared KV buffers" if config["search"]["past_present_share_buffer"] else "KV cache by concatenation"
        progress(
            f"genai_config.json ({config['model']['type']}, {config['model']['decoder']['num_hidden_layers']} "
            f"layers, {shared}); tokenizer and generation files: {', '.join(written) or 'none'}"
        )
    return out_dir
