"""Compile a GPTQ checkpoint made by another tool (AutoGPTQ, GPTQModel, llm-compressor's GPTQ format)
into a CompiledModel: its packed layers are used as stored, the rest of the model is loaded from the folder."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from qcompiler.compiler import compile
from qcompiler.interop.checkpoint import ExportError
from qcompiler.layouts.gptq_format import read_gptq_checkpoint
from qcompiler.models import _check_folder, loaded_from_model
from qcompiler.passes import LoadGPTQCheckpoint
from qcompiler.pipeline.recipes import Recipe

__all__ = ["import_gptq"]


def import_gptq(folder, backend: str = "eager", *, progress: bool = False):
    """A CompiledModel whose quantized layers are the checkpoint's packed tensors, unchanged: the
    model is built from ``config.json``, its other weights loaded, and compiled with the
    ``LoadGPTQCheckpoint`` pass (so a causal LM keeps its KV cache and generates)."""
    from transformers import AutoConfig

    folder = Path(folder)
    _check_folder(folder)
    ckpt = read_gptq_checkpoint(folder)
    raw = dict(ckpt.config)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    loaded = loaded_from_model(folder.name, config, folder)
    model = loaded.model
    packed = ckpt.packed_keys()  # read by the pass, where they are used: not here too
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            state.update({k: f.get_tensor(k) for k in f.keys() if k not in packed})
    missing, _ = model.load_state_dict(state, strict=False)
    quantized_weights = {f"{p}.weight" for p in ckpt.layers}
    missing = [k for k in missing if k not in quantized_weights and not _tied(model, k)]
    if missing:
        raise ExportError(f"{folder}: tensors missing from the checkpoint: {', '.join(missing[:5])}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    recipe = Recipe("gptq-checkpoint", (LoadGPTQCheckpoint(str(folder)),), f"imported from {folder}")
    return compile(model, loaded.example_inputs(), recipe=recipe, backend=backend, progress=progress)


def _tied(model, key: str) -> bool:
    return key.endswith("lm_head.weight") and getattr(model.config, "tie_word_embeddings", False)
