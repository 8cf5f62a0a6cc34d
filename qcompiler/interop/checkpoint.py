"""What every checkpoint exporter needs: the quantized layers of a graph and its remaining FP tensors."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file
from torch.fx import GraphModule, Node

from qcompiler.data import ByteTokenizer
from qcompiler.errors import ExportError
from qcompiler.files.atomic import publish_directory
from qcompiler.files.sharding import DEFAULT_SHARD_BYTES, plan_shards, shard_names
from qcompiler.ir.op_registry import OpArgs, args_of, implementation, quantized_layer_path, spec_of
from qcompiler.ir.tensors import get_tensor
from qcompiler.layouts.gptq import GPTQ_TENSORS
from qcompiler.store.checkpoint_dtype import checkpoint_float_dtype, narrowing
from qcompiler.store.model_files import model_files

__all__ = [
    "ONLINE_ROTATION",
    "ExportError",
    "FLOAT_FORMATS_ONLY",
    "FP8_KV_CACHE_ONLY_CT",
    "QuantLayer",
    "layer_writers",
    "gptq_layer",
    "fp_tensors",
    "in_source_dtype",
    "write_checkpoint",
    "model_config_of",
    "source_folder",
    "write_tokenizer_files",
]

GGUF_BLOCKS_ONLY = (
    "its weights are llama.cpp's block bytes (K-quants, Q4_1, Q5_1: qc.gguf_linear), "
    "which no GPTQ or compressed-tensors checkpoint holds; export it with --format gguf or onnx, or quantize "
    "with gptq-w4g128 for checkpoint clients"
)
FLOAT_FORMATS_ONLY = (
    "its weights are on a floating-point grid (FP8, NVFP4, MXFP4), which only compressed-tensors checkpoints "
    "hold here; export it with --format compressed-tensors (transformers, vLLM) or save it with cm.save"
)
FP8_KV_CACHE_ONLY_CT = (
    "an FP8 KV cache's key/value scale (the FP8KVCache pass), which only compressed-tensors checkpoints hold "
    "(kv_cache_scheme); export --format compressed-tensors, or quantize without FP8KVCache"
)
ONLINE_ROTATION = (
    "an online Hadamard rotation (Rotate's online step), which checkpoint clients (transformers, vLLM, "
    "GPTQModel) cannot run; quantize with Rotate(online=False) for an ordinary checkpoint, or export to ONNX"
)


@dataclass
class QuantLayer:
    """One GPTQ-layout layer as a checkpoint stores it."""

    path: str  # HF module path, e.g. "model.layers.0.self_attn.q_proj"
    node: Node
    tensors: dict[str, torch.Tensor]
    bits: int
    group_size: int
    block_type: Optional[str] = None  # qc.gguf_linear: llama.cpp's block type of its bytes


def layer_writers(
    gm: GraphModule, target: str, fmt: str, *, require_any: bool = True
) -> list[tuple[OpArgs, str, object]]:
    """``(arguments, layer path, writer)`` for each ``qc`` node, the writer being what ``target``
    registered for its op; an op the target refuses (or never registered) is an error naming the
    layer, the format and the reason. ``require_any``: a graph without quantized layers is an error
    (formats that also hold FP models, GGUF's F16, pass False)."""
    found = []
    for node in gm.graph.nodes:
        if spec_of(node) is None:
            continue
        a = args_of(node)
        path = quantized_layer_path(a)
        impl = implementation(target, a.spec.name)
        if impl is None or impl.refusal is not None:
            why = impl.refusal if impl is not None else "no writer is registered for it"
            raise ExportError(f"layer {path} is qc.{a.spec.name}: {why}")
        found.append((a, path, impl.load()))
    if not found and require_any:
        raise ExportError(f"the graph has no quantized layers to write in the {fmt} format")
    return found


def gptq_layer(gm: GraphModule, a: OpArgs, path: str) -> QuantLayer:
    """A ``qc.quant_linear`` node's tensors and settings, as GPTQ checkpoints store them."""
    return QuantLayer(
        path, a.node, dict(zip(GPTQ_TENSORS, a.tensors(gm, *GPTQ_TENSORS))), int(a.bits), int(a.group_size)
    )


def fp_tensors(gm: GraphModule, consumed: set[str]) -> dict[str, torch.Tensor]:
    """Every stored tensor of the model's state not in ``consumed``, under its state-dict name.
    Left out: what the capture recorded as transient (non-persistent buffers, export's lifted
    constants: vLLM refuses a checkpoint holding a name its model does not have) and ``_…`` names."""
    info = gm.meta.get("qcompiler")
    transient = set(getattr(info, "transient", ()))
    stored = {
        node.target: get_tensor(gm, node.target).detach()
        for node in gm.graph.nodes
        if node.op == "get_attr"
        and node.target not in consumed
        and node.target not in transient
        and not any(part.startswith("_") for part in node.target.split("."))
    }
    return _under_client_names(stored, getattr(info, "tied", None) or {}, getattr(info, "model_config", None) or {})


def in_source_dtype(tensors: dict[str, torch.Tensor], config: dict, gm: GraphModule) -> dict[str, torch.Tensor]:
    """The FP tensors in the 16-bit dtype of the checkpoint the model came from, where that holds
    their values exactly, and ``config``'s dtype set to it (in place): a bf16 model loaded in float32
    otherwise came back wider than it was loaded (Gemma-3 270M at 4 bits: 723 MB against the
    536 MB bf16 source) and clients ran it in float32. Tensors a pass changed keep float32."""
    dtype = checkpoint_float_dtype(getattr(gm.meta.get("qcompiler"), "source_path", None))
    if dtype is None:
        return tensors
    narrow = narrowing(tensors, dict.fromkeys(tensors, "parameter"), dtype)
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name
    if "torch_dtype" in config:  # transformers before 5 wrote this key
        config["torch_dtype"] = name
    return {name: t.to(narrow[name]) if name in narrow else t for name, t in tensors.items()}


def _under_client_names(stored: dict, tied: dict, config: dict) -> dict:
    """A tied table exported once captures it under the head's name (``lm_head.weight``), which
    vLLM never reads for a tied model (it generates token 0 forever): store it under the embedding's
    name, as ``save_pretrained`` does, and under both when the config does not tie them. A table a
    pass untied (Rotate) has its own tensor under each name and stays as it is."""
    out = dict(stored)
    ties = config.get("tie_word_embeddings", True)
    for alias, name in tied.items():
        if alias in stored and name not in stored:
            out[name] = stored[alias]
            if ties:
                del out[alias]
    return out


def model_config_of(gm: GraphModule) -> dict:
    """The transformers config the capture recorded (a checkpoint needs it), or an error."""
    info = gm.meta.get("qcompiler")
    config = getattr(info, "model_config", None)
    if not config:
        raise ExportError(
            "the graph was not captured from a transformers model (no model config recorded), "
            "so there is no config.json to write; use cm.save or ONNX export instead"
        )
    config = dict(config)
    if not config.get("architectures"):  # a model built in code, not loaded: name its class for loaders
        config["architectures"] = [info.model_class]
    return config


def write_tokenizer_files(tmp: Path, gm: GraphModule) -> list[str]:
    """Write the model's tokenizer and generation files (``store.model_files``) into ``tmp``; a
    256-token model without any (the bundled byte-level LM) gets the byte tokenizer as Hugging Face
    files. Returns the names."""
    files = model_files(gm)
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    names = list(files)
    has_tokenizer = any(n in files for n in ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt"))
    vocab = (getattr(gm.meta.get("qcompiler"), "model_config", None) or {}).get("vocab_size")
    if not has_tokenizer and vocab == ByteTokenizer.vocab_size:
        names += ByteTokenizer().save_pretrained(tmp)
    return names


def source_folder(gm: GraphModule) -> tuple[str, ...]:
    """The folder the model was loaded from, as a path no output may replace (never read from)."""
    source = getattr(gm.meta.get("qcompiler"), "source_path", None)
    return (str(source),) if source else ()


def _write_shards(tmp: Path, tensors: dict[str, torch.Tensor], shards: list[list[str]]) -> list[str]:
    """``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``
    (what transformers, vLLM and GPTQModel read). One shard's contiguous copies exist at a time, so
    the packed layers are never all copied at once. Returns the files written."""
    names = shard_names("model", len(shards))
    seen, weight_map, total = set(), {}, 0
    for file, shard in zip(names, shards):
        unique = {}
        for name in shard:  # safetensors refuses tensors that share storage (tied embeddings)
            t = tensors[name]
            key = (t.data_ptr(), tuple(t.shape))
            unique[name] = t.clone() if key in seen else t.contiguous()
            seen.add(key)
            weight_map[name], total = file, total + t.numel() * t.element_size()
        save_file(unique, str(tmp / file), metadata={"format": "pt"})
        del unique
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def write_checkpoint(
    out_dir,
    tensors: dict[str, torch.Tensor],
    config: dict,
    extra_files: Optional[dict[str, dict]] = None,
    *,
    kind: str,
    gm: GraphModule,
    overwrite: bool = False,
    protect=(),
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress=None,
) -> Path:
    """The weights (one ``model.safetensors``, or shards of at most ``max_shard_bytes`` with an
    index) + ``config.json`` (+ extra JSON files, + the tokenizer and generation files of ``gm``'s
    source folder), published atomically and only over an earlier export of the same ``kind``."""
    shards = plan_shards(tensors, max_shard_bytes)  # before any file is touched: it refuses a bound <= 0
    out_dir = Path(out_dir)
    protect = (*protect, *source_folder(gm))
    with publish_directory(out_dir, kind, overwrite=overwrite, protect=protect) as tmp:
        write_tokenizer_files(tmp, gm)
        files = _write_shards(tmp, tensors, shards)
        if progress is not None and len(files) > 1:
            progress(f"{len(files)} safetensors shards of at most {max_shard_bytes / 1024**3:.3g} GiB, with an index")
        for name, data in (extra_files or {}).items():
            (tmp / name).write_text(json.dumps(data, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
