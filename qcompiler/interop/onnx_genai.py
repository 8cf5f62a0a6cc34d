"""A folder that onnxruntime-genai runs as is: ``model.onnx`` + ``genai_config.json`` + tokenizer files.

The KV-cache graph's ONNX export already has the input/output contract genai's decoder-only
models use (``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values.N.key/value``
in; ``logits``, ``present.N.key/value`` out; the cache grows by concatenation, so
``past_present_share_buffer`` is false). Quantized linears are ``MatMulNBits`` (GPTQ/RTN, SpQR's
dense part) and ``MatMulInteger`` (W8A8), standard attention one ``GroupQueryAttention`` node per
layer, as in every qcompiler ONNX export of a KV-cache graph (docs/backends/onnx.md).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..atomic import publish_directory
from .checkpoint import ExportError, source_files, write_tokenizer_files

__all__ = ["export_onnx_genai", "genai_config"]

# genai picks its runtime by model type; these decoder-only types share the contract above.
_GENAI_TYPES = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gpt2"}


def genai_config(cm) -> dict:
    """``genai_config.json`` for ``cm``'s cache graph (greedy search by default)."""
    layout = cm.cache_layout
    config = cm.capture_info.model_config or {}
    if layout is None:
        raise ExportError(f"the onnx-genai format needs a causal LM captured with its KV cache; this graph of "
                          f"{cm.capture_info.model_class} has none (an encoder, or captured with use_cache=False)")
    if len(set(layout.heads)) != 1 or len(set(layout.key_dims + layout.value_dims)) != 1:
        raise ExportError(f"onnxruntime-genai needs the same KV heads and head size in every layer; this model has "
                          f"heads {sorted(set(layout.heads))}, head sizes {sorted(set(layout.key_dims + layout.value_dims))}")
    inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask",
              "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    if layout.uses_position_ids:
        inputs["position_ids"] = "position_ids"
    hidden = config.get("hidden_size") or config.get("n_embd")
    heads = config.get("num_attention_heads") or config.get("n_head") or layout.heads[0]
    eos = config.get("eos_token_id")
    model_type = config.get("model_type") if config.get("model_type") in _GENAI_TYPES else "llama"
    return {
        "model": {
            "type": model_type,
            "vocab_size": config.get("vocab_size"),
            "context_length": layout.max_length,
            "bos_token_id": config.get("bos_token_id") if config.get("bos_token_id") is not None else 0,
            "eos_token_id": eos if eos is not None else 0,   # genai needs one; a model without EOS gets id 0
            "pad_token_id": config.get("pad_token_id") if config.get("pad_token_id") is not None
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
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
            },
        },
        "search": {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": layout.max_length,
                   "min_length": 0, "past_present_share_buffer": False, "temperature": 1.0, "top_k": 1, "top_p": 1.0,
                   "repetition_penalty": 1.0, "length_penalty": 1.0, "no_repeat_ngram_size": 0,
                   "diversity_penalty": 0.0, "early_stopping": True},
    }


def export_onnx_genai(cm, out_dir, *, accuracy_level: Optional[int] = None, overwrite: bool = False,
                      progress=print, fused_attention: bool = True) -> Path:
    """Write ``cm`` as an onnxruntime-genai model folder (published atomically)."""
    out_dir = Path(out_dir)
    config = genai_config(cm)
    copies = source_files(cm.graph_module)
    with publish_directory(out_dir, "onnx-genai", overwrite=overwrite,
                           protect=[str(p.parent) for p in copies.values()]) as tmp:
        progress(f"exporting {cm.capture_info.model_class} ({cm.recipe.name}) to ONNX with its KV cache")
        cm.export_onnx(tmp / "model.onnx", accuracy_level=accuracy_level, overwrite=True,
                       fused_attention=fused_attention)
        (tmp / "genai_config.json").write_text(json.dumps(config, indent=2) + "\n")
        written = write_tokenizer_files(tmp, cm.graph_module, copies)
        progress(f"genai_config.json ({config['model']['type']}, {config['model']['decoder']['num_hidden_layers']} "
                 f"layers); tokenizer and generation files: {', '.join(written) or 'none'}")
    return out_dir
