"""What each exporter needs to know about a transformers model type, in one record per type.

An exporter that writes a model for another runtime meets per-architecture facts: llama.cpp's
architecture name and whether it wants the query/key rows in its rotary-pair order, norms it stores
as ``1 + w``, a head it reads from the embeddings; the model type onnxruntime-genai runs it as; the
checkpoint names of a mixture-of-experts block. They lived in four files as free tables and inline
``model_type == ...`` branches; here every type the tests build (tests/causal_lms.py) has a spec,
and a runtime that cannot take a type says so in the spec (tests/test_arch_specs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import gguf

from qcompiler.errors import ExportError

__all__ = ["ArchSpec", "GGUFArch", "arch_spec", "arch_specs", "gguf_arch"]


@dataclass(frozen=True)
class GGUFArch:
    """How llama.cpp holds the type: its architecture, query/key rows reordered into its adjacent
    rotary pairs (``rotary_pairs``), norms stored as ``1 + w`` (Gemma's RMSNorm scales by ``1 + w``,
    llama.cpp by the stored value), and the output head read from the token embeddings."""

    arch: gguf.MODEL_ARCH
    rotary_pairs: bool = False
    norm_plus_one: bool = False
    head_from_embeddings: bool = False


@dataclass(frozen=True)
class ArchSpec:
    """One transformers model type as the exporters see it. ``gguf``: None with ``gguf_refusal``
    naming what the GGUF writer here lacks for it; ``genai_type``: the type onnxruntime-genai runs
    it as (its generic decoder "llama" where genai has no type of its own that takes our graph's
    inputs); ``experts``: a MoE block's checkpoint name and its gate / up / down projection names
    (None: no experts)."""

    model_type: str
    gguf: Optional[GGUFArch] = None
    gguf_refusal: str = ""
    genai_type: str = "llama"
    experts: Optional[tuple[str, tuple[str, str, str]]] = None


_SPECS = {
    spec.model_type: spec
    for spec in (
        ArchSpec("llama", GGUFArch(gguf.MODEL_ARCH.LLAMA, rotary_pairs=True)),
        ArchSpec("mistral", GGUFArch(gguf.MODEL_ARCH.LLAMA, rotary_pairs=True), genai_type="mistral"),
        ArchSpec("qwen2", GGUFArch(gguf.MODEL_ARCH.QWEN2), genai_type="qwen2"),
        ArchSpec("qwen3", GGUFArch(gguf.MODEL_ARCH.QWEN3), genai_type="qwen3"),
        # fused qkv_proj / gate_up_proj are llama.cpp's attn_qkv / ffn_up as they are (gate first, as its
        # SwiGLU splits them); its rotary embedding is NEOX-style there: rows stay in HF order
        ArchSpec("phi3", GGUFArch(gguf.MODEL_ARCH.PHI3), genai_type="phi3"),
        ArchSpec(
            "gemma2",
            GGUFArch(gguf.MODEL_ARCH.GEMMA2, norm_plus_one=True, head_from_embeddings=True),
            genai_type="gemma2",
        ),
        # QK-norm (stored 1 + w like the other norms), sliding layers with a rotary base of their own
        ArchSpec(
            "gemma3_text",
            GGUFArch(gguf.MODEL_ARCH.GEMMA3, norm_plus_one=True, head_from_embeddings=True),
        ),
        # genai's own "gpt2" type wants other input names ("Model input was not found"): GPT-2 and OPT
        # graphs run as its generic decoder
        ArchSpec("gpt2", gguf_refusal="Conv1D weights, learned positions"),
        ArchSpec("opt", gguf_refusal="learned positions"),
        ArchSpec("gpt_neox", gguf_refusal="fused query_key_value, parallel residual"),
        ArchSpec("falcon", gguf_refusal="fused query_key_value"),
        ArchSpec("bloom", gguf_refusal="ALiBi, fused query_key_value"),
        ArchSpec(
            "mixtral",
            gguf_refusal="mixture-of-experts",
            experts=("block_sparse_moe", ("w1", "w3", "w2")),
        ),
        ArchSpec(
            "qwen2_moe",
            gguf_refusal="mixture-of-experts",
            experts=("mlp", ("gate_proj", "up_proj", "down_proj")),
        ),
        ArchSpec(
            "qwen3_moe",
            gguf_refusal="mixture-of-experts",
            experts=("mlp", ("gate_proj", "up_proj", "down_proj")),
        ),
    )
}


def arch_spec(model_type: Optional[str]) -> ArchSpec:
    """The spec of ``model_type``; a type without one gets a default (genai's generic decoder, no
    GGUF, no experts)."""
    return _SPECS.get(model_type or "") or ArchSpec(str(model_type), gguf_refusal="no spec for this model type")


def arch_specs() -> dict[str, ArchSpec]:
    """Every model type with a spec of its own."""
    return dict(_SPECS)


def gguf_arch(model_type: Optional[str]) -> GGUFArch:
    """How llama.cpp holds ``model_type``, or an ExportError naming why not and what is written."""
    spec = arch_spec(model_type)
    if spec.gguf is None:
        written = ", ".join(t for t, s in _SPECS.items() if s.gguf is not None)
        raise ExportError(
            f"model type {model_type!r} is not written to GGUF yet ({spec.gguf_refusal}); supported: {written}"
        )
    return spec.gguf
