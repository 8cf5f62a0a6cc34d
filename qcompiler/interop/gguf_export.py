"""One GGUF file that llama.cpp (and Ollama, LM Studio, llamafile) runs: ``qcompiler export ART
--format gguf --out model.gguf``.

Tensor names and metadata are llama.cpp's (the ``gguf`` package's name map, as its own converter
uses); quantized layers are written code for code as ``Q8_0`` / ``Q4_0`` / ``Q4_1`` blocks when
their grid is that block type (``gguf_blocks``: recipes ``gptq-q4_0``, ``gptq-q4_1``, ``gptq-q8_0``),
``qc.gguf_linear`` layers as the llama.cpp bytes they hold (K-quants, Q4_1, Q5_1: recipes ``gptq-q4_k``,
...), other layers only with an explicit ``requantize`` type, which re-rounds them and says so (Q4_0 /
Q4_1 / Q8_0 by llama.cpp's own round-to-nearest; K types, which the ``gguf`` package cannot quantize,
by qcompiler's fitted grid without calibration). FP matrices are stored as F16, norms and biases as F32.
LLaMA-family graphs get llama.cpp's row order for the query and key projections (its rotary
embedding rotates adjacent pairs, Hugging Face's rotates halves), which permutes whole rows and so
leaves the blocks' codes untouched.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Optional

import gguf
import numpy as np
import torch

from qcompiler.algorithms.gguf_bytes import pack
from qcompiler.algorithms.gguf_grids import FORMATS, GRID_FALLBACK, fit_grid, quantize_codes
from qcompiler.algorithms.packing import unpack_cols, unpack_rows
from qcompiler.files.atomic import atomic_file, check_output_file
from qcompiler.interop.arch_specs import GGUFArch, gguf_arch
from qcompiler.interop.checkpoint import (
    ONLINE_ROTATION,
    ExportError,
    QuantLayer,
    fp_tensors,
    gptq_layer,
    layer_writers,
    model_config_of,
    source_folder,
)
from qcompiler.interop.gguf_blocks import BLOCK_TYPES, layer_fits, pack_blocks
from qcompiler.interop.gguf_tokenizer import embed_tokenizer
from qcompiler.ir.op_registry import args_of, implement, refuse, register_target, spec_of
from qcompiler.layouts.gptq import GPTQ_TENSORS, dequantize_gptq
from qcompiler.layouts.spqr import SPQR_DENSE_TENSORS, dequantize_spqr_dense, sparse_outlier_linear
from qcompiler.store.model_files import model_files
from qcompiler.version import __version__

__all__ = ["export_gguf", "is_qcompiler_gguf"]

register_target("gguf", "exporter: GGUF files for llama.cpp")
implement("gguf", "quant_linear", gptq_layer, kind="writer", label="Q8_0/Q4_0/Q4_1 blocks")


def _gguf_bytes_layer(gm, a, path: str) -> QuantLayer:
    """A ``qc.gguf_linear`` node: llama.cpp's block bytes, written as they are."""
    return QuantLayer(path, a.node, {"blocks": a.tensor(gm, "blocks")}, 4, 32, a.block_type)


implement("gguf", "gguf_linear", _gguf_bytes_layer, kind="writer", label="its block bytes")


def _spqr_layer(gm, a, path: str) -> QuantLayer:
    """A SpQR layer as one float weight: its dense branch with the fp16 outliers of its sparse partner
    (the other input of the add after it) folded in. No GGUF type holds SpQR's grid, so only a
    ``requantize`` type writes it."""
    w = dequantize_spqr_dense(
        *a.tensors(gm, *SPQR_DENSE_TENSORS), int(a.bits), int(a.group_size), int(a.stat_bits), int(a.stat_group_size)
    )
    partners = [n for user in a.node.users for n in user.all_input_nodes if n is not a.node and spec_of(n) is not None]
    for node in partners:  # x @ Sᵀ on the identity is Sᵀ: the outliers as a dense matrix
        s = args_of(node)
        eye = torch.eye(w.shape[1], dtype=torch.float32)
        w = w + sparse_outlier_linear(eye, *s.tensors(gm, "row_ptr", "col_idx", "values"), w.shape[0]).t()
    return QuantLayer(path, a.node, {"weight": w}, int(a.bits), int(a.group_size))


implement("gguf", "spqr_dense_linear", _spqr_layer, kind="writer", label="re-rounded, outliers folded in")
implement(
    "gguf", "sparse_outlier_linear", lambda gm, a, path: None, kind="writer", label="folded into its dense branch"
)
_NOT_GGUF = (
    "GGUF holds weight-only block quantization (recipes gptq-q4_0, gptq-q4_1, gptq-q8_0, gptq-q4_k, gptq-q5_k, "
    "gptq-q6_k, gptq-q3_k, ...); "
    "export this recipe to ONNX"
)
for _op in ("int8_linear", "spqr_experts_linear"):
    refuse("gguf", _op, _NOT_GGUF)


def _mxfp4_layer(gm, a, path: str) -> QuantLayer:
    """A ``qc.mxfp4_linear`` node as llama.cpp's MXFP4 blocks, code for code: per 32 inputs the e8m0
    byte, then 16 bytes holding inputs j (low nibble) and j + 16 (high); llama.cpp's table is the
    e2m1 values doubled and its scale halved, so the codes and the exponent byte are ours."""
    packed, scale = a.tensors(gm, "weight_packed", "weight_scale")
    out = packed.shape[0]
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(out, -1, 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    blocks = torch.cat((scale.reshape(out, -1, 1), qs), dim=-1).reshape(out, -1)
    return QuantLayer(path, a.node, {"blocks": blocks.contiguous()}, 4, 32, "MXFP4")


implement("gguf", "mxfp4_linear", _mxfp4_layer, kind="writer", label="MXFP4 blocks")
_NO_GGUF_TYPE = (
    "its weights are {what}, which GGUF holds {why}; export it with --format compressed-tensors (transformers, "
    "vLLM), or quantize with rtn-mxfp4 / gptq-mxfp4 (llama.cpp's MXFP4) or gptq-q4_k for llama.cpp"
)
refuse(
    "gguf",
    "fp8_kv_quant",
    "an FP8 KV cache's key/value scale (the FP8KVCache pass): llama.cpp quantizes its own cache "
    "(llama-cli --cache-type-k q8_0); quantize without FP8KVCache for GGUF",
)
refuse("gguf", "fp8_linear", _NO_GGUF_TYPE.format(what="FP8 (e4m3)", why="in no type"))
refuse(
    "gguf",
    "nvfp4_linear",
    _NO_GGUF_TYPE.format(
        what="NVFP4 (e4m3 scales in units of a per-tensor global scale)",
        why="only as blocks without a global scale (qcompiler does not re-round them)",
    ),
)
refuse("gguf", "quant_experts_linear", "GGUF files of mixture-of-experts models are not written yet")
refuse(
    "gguf",
    "quant_embedding",
    "the graph's quantized embedding table (QuantizeEmbeddings) is not re-rounded to a GGUF type; quantize "
    "without it and choose the file's token embedding type at export (--token-embedding q8_0)",
)
refuse("gguf", "hadamard", ONLINE_ROTATION.replace("checkpoint clients (transformers, vLLM, GPTQModel)", "llama.cpp"))

_FILE_TYPES = {
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_M,
    "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
    "Q3_K": gguf.LlamaFileType.MOSTLY_Q3_K_M,
    "Q2_K": gguf.LlamaFileType.MOSTLY_Q2_K,
    "MXFP4": gguf.LlamaFileType.MOSTLY_MXFP4_MOE,  # llama.cpp's only file type of MXFP4 tensors
}
_RECIPES = ", ".join(
    dict.fromkeys(
        [b.recipe for b in BLOCK_TYPES.values()] + ["gptq-q4_k", "gptq-q5_k", "gptq-q6_k", "gptq-q3_k", "gptq-q2_k"]
    )
)
RECIPE_KEY = "qcompiler.recipe"


def is_qcompiler_gguf(path: Path) -> bool:
    """Whether ``path`` is a GGUF file qcompiler wrote (its header has ``qcompiler.recipe``)."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return False
        return RECIPE_KEY in gguf.GGUFReader(str(path)).fields
    except Exception:  # a truncated or foreign file: not ours
        return False


def _rope_theta(config: dict, model_type: str, layer_type: str = "full_attention") -> float:
    """The rotary base of ``layer_type``'s layers (Gemma-3 keeps one per attention kind); rope
    scaling, which the writer does not carry over yet, is refused."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if layer_type in rope:  # {"full_attention": {...}, "sliding_attention": {...}}
        rope = rope[layer_type] or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ExportError(f"{model_type}: rope scaling {kind!r} is not written to GGUF yet")
    default = config.get("rope_local_base_freq") if layer_type == "sliding_attention" else None
    return float(rope.get("rope_theta", default or config.get("rope_theta", 10000.0)))


def _check_query_scale(arch: str, config: dict, n_layers: int, head_dim: int, theirs: int) -> None:
    """Refuse a Gemma whose queries are scaled by 1/sqrt(query_pre_attn_scalar) other than llama.cpp's
    1/sqrt(``theirs``) (head_dim, or hidden/heads at the size it special-cases)."""
    scalar = config.get("query_pre_attn_scalar") or head_dim
    if int(scalar) != theirs:
        raise ExportError(
            f"{arch}: query_pre_attn_scalar={scalar}, but llama.cpp scales queries by 1/sqrt({theirs}) "
            f"for a {n_layers}-layer model"
        )


def _gemma2_metadata(writer, config: dict, n_layers: int, hidden: int, heads: int, head_dim: int) -> None:
    """Gemma-2's soft-capping and sliding-window keys, refusing what llama.cpp's gemma2 model would
    compute differently (it always soft-caps, alternates sliding and full layers starting with
    sliding, and scales queries by 1/sqrt(head_dim) — by 1/sqrt(hidden/heads) at 46 layers, its 27B)."""
    caps = (config.get("attn_logit_softcapping"), config.get("final_logit_softcapping"))
    if None in caps:
        raise ExportError("gemma2: llama.cpp always soft-caps attention and final logits; this config turns one off")
    _check_query_scale("gemma2", config, n_layers, head_dim, hidden // heads if n_layers == 46 else head_dim)
    kinds = config.get("layer_types") or []
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    if kinds and list(kinds) != alternating:
        raise ExportError("gemma2: llama.cpp alternates sliding and full attention from layer 0; layer_types differ")
    writer.add_attn_logit_softcapping(float(caps[0]))
    writer.add_final_logit_softcapping(float(caps[1]))
    writer.add_sliding_window(int(config.get("sliding_window") or 4096))


def _gemma3_metadata(writer, config: dict, n_layers: int, hidden: int, heads: int, head_dim: int) -> None:
    """Gemma-3's sliding window, which layers slide (written per layer, as llama.cpp reads it, not its
    default of five in six), the sliding layers' own rotary base, and the final soft-cap when the
    config has one; refused: attention soft-capping (llama.cpp's gemma3 has none) and a query scale
    other than llama.cpp's (1/sqrt(head_dim), 1/sqrt(hidden/heads) at 62 layers, its 27B)."""
    if config.get("attn_logit_softcapping") is not None:
        raise ExportError("gemma3: llama.cpp's gemma3 does not soft-cap attention logits; this config does")
    _check_query_scale("gemma3", config, n_layers, head_dim, hidden // heads if n_layers == 62 else head_dim)
    kinds = list(config.get("layer_types") or [])
    if len(kinds) != n_layers or not set(kinds) <= {"sliding_attention", "full_attention"}:
        raise ExportError(f"gemma3: layer_types should name sliding or full attention for each of {n_layers} layers")
    window = int(config.get("sliding_window") or 0)
    if window and "sliding_attention" in kinds:
        writer.add_sliding_window(window)
        writer.add_sliding_window_pattern([k == "sliding_attention" for k in kinds])
        writer.add_rope_freq_base_swa(_rope_theta(config, "gemma3", "sliding_attention"))
    if config.get("final_logit_softcapping") is not None:
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))


def _rotary_rows(n_rows: int, heads: int) -> torch.Tensor:
    """Row order taking Hugging Face's half-split rotary layout to llama.cpp's adjacent pairs."""
    return torch.arange(n_rows).view(heads, 2, n_rows // heads // 2).transpose(1, 2).reshape(-1)


def _quant_tensor(layer, requantize: Optional[str]) -> tuple[np.ndarray, gguf.GGMLQuantizationType, str]:
    """A quantized layer's GGUF data, type, and how it got there."""
    if layer.block_type is not None:  # qc.gguf_linear: llama.cpp's bytes already
        return layer.tensors["blocks"].numpy(), gguf.GGMLQuantizationType[layer.block_type], "exact"
    if "weight" in layer.tensors:  # SpQR, outliers folded in
        if requantize is None:
            raise ExportError(
                f"layer {layer.path} is SpQR ({layer.bits}-bit groups of {layer.group_size} plus fp16 outliers), "
                "which no GGUF type holds: pass requantize='q4_k' / --requantize q4_k to re-round its weight "
                "with the outliers folded in"
            )
        return (*_rerounded(layer.tensors["weight"], requantize), "re-rounded")
    t, bits = layer.tensors, layer.bits
    n_in, n_out = t["g_idx"].numel(), t["scales"].shape[1]
    zeros = unpack_cols(t["qzeros"], bits, n_out)
    candidates = [b for b in BLOCK_TYPES.values() if b.bits == bits]  # symmetric first: Q4_0 before Q4_1
    reasons = [layer_fits(b, bits, layer.group_size, zeros, t["g_idx"]) for b in candidates]
    block = next((b for b, why in zip(candidates, reasons) if why is None), None)
    if block is not None:
        codes = unpack_rows(t["qweight"], bits, n_in).t()
        data = pack_blocks(block, codes, t["scales"].t(), zeros.t())
        return data, gguf.GGMLQuantizationType[block.name], "exact"
    why = reasons[-1] if reasons else f"{bits}-bit, which no GGUF block type qcompiler writes holds"
    if requantize is None:
        raise ExportError(
            f"layer {layer.path} is {why}: quantize with recipe {_RECIPES} (GGUF's own grids), "
            f"or pass requantize='q4_0' / --requantize q4_0 to re-round it with llama.cpp's round-to-nearest"
        )
    w = dequantize_gptq(*(t[n] for n in GPTQ_TENSORS), bits)
    return (*_rerounded(w, requantize), "re-rounded")


def _rerounded(w: torch.Tensor, requantize: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """``w`` re-rounded to ``requantize``: llama.cpp's own round-to-nearest (the ``gguf`` package's) for
    Q4_0 / Q4_1 / Q8_0, qcompiler's fitted grid for K types (their 32-column fallback where needed)."""
    if requantize in BLOCK_TYPES:
        qtype = gguf.GGMLQuantizationType[BLOCK_TYPES[requantize].name]
        return gguf.quants.quantize(w.float().numpy(), qtype), qtype
    kind = requantize if w.shape[1] % FORMATS[requantize].super_block == 0 else GRID_FALLBACK[requantize]
    grid = fit_grid(kind, w)
    data = pack(kind, quantize_codes(w, grid, FORMATS[kind].bits), grid)
    return data.numpy(), gguf.GGMLQuantizationType[FORMATS[kind].name]


REQUANTIZE_TYPES = (*BLOCK_TYPES, *GRID_FALLBACK)  # llama.cpp's RTN for the first, qcompiler's fitted grid for K types


def _check_requantize(requantize: Optional[str], setting: str = "requantize") -> None:
    if requantize is not None and requantize not in REQUANTIZE_TYPES:
        raise ExportError(
            f"{setting}={requantize!r} is not a GGUF block type qcompiler writes; choose one of "
            f"{', '.join(REQUANTIZE_TYPES)}"
        )


def _quantized_tensors(gm) -> set:
    """Every stored tensor a quantized op reads, but its bias (written as the layer's F32 bias)."""
    return {
        value.target
        for node in gm.graph.nodes
        if spec_of(node) is not None
        for name, value in args_of(node).as_dict().items()
        if name != "bias" and isinstance(value, torch.fx.Node) and value.op == "get_attr"
    }


def export_gguf(
    cm, path, *, requantize: Optional[str] = None, token_embedding: Optional[str] = None, protect=(), progress=print
) -> Path:
    """Write ``cm`` as one GGUF file for llama.cpp (atomic; replaces only an earlier qcompiler GGUF).
    ``token_embedding``: store the FP token embeddings as this block type (llama.cpp's own Q4_K_M
    stores them as Q6_K, or Q8_0 where rows are not a multiple of 256) instead of F16 — re-rounded,
    so the file's logits then differ from the graph's; where the head is the embeddings (Gemma) the
    head is re-rounded too."""
    _check_requantize(requantize)
    _check_requantize(token_embedding, "token_embedding")
    if hasattr(cm, "materialize"):  # weights a compile(materialize=False) left on disk
        cm.materialize()
    gm = cm.graph_module if hasattr(cm, "graph_module") else cm
    config = model_config_of(gm)
    model_type = config.get("model_type")
    spec = gguf_arch(model_type)
    path = check_output_file(Path(path), "GGUF", ours=is_qcompiler_gguf, protect=(*protect, *source_folder(gm)))
    arch = spec.arch
    written = [write(gm, a, path) for a, path, write in layer_writers(gm, "gguf", "GGUF", require_any=False)]
    layers = [layer for layer in written if layer is not None]  # SpQR's outliers: folded into their dense branch
    consumed = _quantized_tensors(gm)
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    hidden, n_layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    names = gguf.get_tensor_name_map(arch, n_layers)

    def gguf_name(hf_name: str) -> str:
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ExportError(f"tensor {hf_name} has no llama.cpp name for {model_type}; GGUF export cannot place it")
        return name

    def rows(hf_name: str) -> Optional[torch.Tensor]:
        if not spec.rotary_pairs:
            return None
        for proj, n in (("q_proj", heads), ("k_proj", kv_heads)):
            if f".self_attn.{proj}." in hf_name or hf_name.endswith(f".self_attn.{proj}"):
                return _rotary_rows(n * head_dim, n)
        return None

    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[arch])
    recipe = getattr(getattr(cm, "recipe", None), "name", None) or gm.meta.get("qcompiler_recipe", "")
    _write_hparams(writer, config, model_type, recipe, (heads, kv_heads, head_dim), progress)
    if spec.head_from_embeddings and any(layer.path == "lm_head" for layer in layers):
        raise ExportError(
            f"{model_type}: llama.cpp reads the output head from the token embeddings; quantize without lm_head"
        )
    tokenizer = embed_tokenizer(writer, model_files(gm), config)

    counts: Counter = Counter()  # (GGUF type, "exact" | "re-rounded") -> layers
    for layer in layers:
        data, qtype, how = _quant_tensor(layer, requantize)
        order = rows(layer.path)
        if order is not None:
            data = data[order.numpy()]
        writer.add_tensor(gguf_name(layer.path + ".weight"), data, raw_dtype=qtype)
        counts[qtype.name, how] += 1
    embedding = _write_fp_tensors(writer, fp_tensors(gm, consumed), spec, model_type, gguf_name, rows, token_embedding)
    main = counts.most_common(1)[0][0][0] if counts else "F16"
    writer.add_file_type(_FILE_TYPES.get(main, gguf.LlamaFileType.MOSTLY_F16))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    summary = ", ".join(f"{n} {name} ({how})" for (name, how), n in counts.items()) or "no quantized layers (F16)"
    summary += f"; token embeddings {embedding}"
    progress(f"GGUF ({gguf.MODEL_ARCH_NAMES[arch]}): {summary}; tokenizer {tokenizer}")
    if any(how == "re-rounded" for _, how in counts):
        how = "llama.cpp's round-to-nearest" if requantize in BLOCK_TYPES else "qcompiler's fitted grid, uncalibrated"
        progress(
            f"re-quantized to {requantize.upper()} by {how}: those layers' codes are not the ones the recipe chose"
        )
    with atomic_file(path) as tmp:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return path


def _write_hparams(writer, config: dict, model_type: str, recipe: str, shape: tuple[int, int, int], progress) -> None:
    """The model's hyperparameters as llama.cpp's keys (and qcompiler's recipe and version)."""
    heads, kv_heads, head_dim = shape
    hidden, n_layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    writer.add_string(RECIPE_KEY, recipe)
    writer.add_string("qcompiler.version", __version__)
    writer.add_name(str(config.get("_name_or_path") or model_type))
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(hidden)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rotary = float(config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
    writer.add_rope_dimension_count(int(head_dim * rotary))
    window = int(config.get("sliding_window") or 0) if model_type == "phi3" else 0
    if window:  # written as llama.cpp's converter does; its phi3 model then ignores it (SWA disabled)
        writer.add_sliding_window(window)
        progress(
            f"note: llama.cpp runs Phi-3 with full attention (its phi3 model disables the sliding window): "
            f"outputs match the graph's within the first {window} tokens of a sequence"
        )
    if model_type == "gemma2":
        _gemma2_metadata(writer, config, n_layers, hidden, heads, head_dim)
    if model_type == "gemma3_text":
        _gemma3_metadata(writer, config, n_layers, hidden, heads, head_dim)
    writer.add_rope_freq_base(_rope_theta(config, model_type))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(int(config["vocab_size"]))


def _write_fp_tensors(writer, fp: dict, spec: GGUFArch, model_type: str, gguf_name, rows, embedding_type) -> str:
    """The unquantized tensors: vectors as F32, matrices as F16 (Gemma's norms as llama.cpp scales),
    the token embeddings as ``embedding_type`` when given. Returns how the embeddings were written."""
    embedding_name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.TOKEN_EMBD] + ".weight"
    written = "F16"
    for hf_name, value in fp.items():
        value = value.float()
        if spec.head_from_embeddings and hf_name == "lm_head.weight":  # llama.cpp has no head of its own there
            if not torch.equal(value, fp["model.embed_tokens.weight"].float()):
                raise ExportError(
                    f"{model_type}: llama.cpp reads the output head from the token embeddings; this head differs"
                )
            continue
        if spec.norm_plus_one and hf_name.endswith("norm.weight"):
            value = value + 1  # Gemma's RMSNorm scales by 1 + w; llama.cpp by the stored w
        order = rows(hf_name)
        if order is not None:
            value = value[order]
        name = gguf_name(hf_name)
        if value.dim() == 1:
            writer.add_tensor(name, value.numpy())
        elif name == embedding_name and embedding_type is not None:
            data, qtype = _rerounded(value, embedding_type)
            writer.add_tensor(name, data, raw_dtype=qtype)
            how = "llama.cpp's round-to-nearest" if embedding_type in BLOCK_TYPES else "qcompiler's fitted grid"
            head = ", the output head with them" if spec.head_from_embeddings else ""
            written = f"{qtype.name} (re-rounded by {how}{head}: logits differ from the graph's)"
        else:
            writer.add_tensor(name, value.half().numpy())
    return written
