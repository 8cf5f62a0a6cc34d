"""Every model type the tests build has one exporter spec (tests/causal_lms.py's 13 architectures):
each is written to GGUF or refused with its reason, named for onnxruntime-genai, and a MoE type
names its experts' checkpoint layout — so a new architecture fails here until its exporters know it."""

import pytest
import transformers
from causal_lms import ARCHITECTURES, config

from qcompiler.errors import ExportError
from qcompiler.interop.arch_specs import arch_spec, arch_specs, gguf_arch


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_tested_architecture_has_a_spec_or_a_stated_refusal(arch):
    model_type = config(arch).model_type
    assert model_type in arch_specs(), f"{model_type}: add an ArchSpec to qcompiler/interop/arch_specs.py"
    spec = arch_spec(model_type)
    if spec.gguf is None:
        assert len(spec.gguf_refusal) > 8
        with pytest.raises(
            ExportError, match=rf"model type '{model_type}' is not written to GGUF yet \(.+\); supported"
        ):
            gguf_arch(model_type)
    else:
        assert gguf_arch(model_type) is spec.gguf
    is_moe = any(k in config(arch).to_dict() for k in ("num_local_experts", "num_experts"))
    assert (spec.experts is not None) == is_moe
    assert spec.genai_type in ("llama", model_type)


def test_a_type_without_a_spec_is_refused_naming_what_is_written():
    with pytest.raises(ExportError, match=r"model type 'mamba' is not written to GGUF yet .*supported: llama, mistral"):
        gguf_arch("mamba")
    assert arch_spec("mamba").genai_type == "llama" and arch_spec(None).experts is None


def test_gemma_norms_and_tied_head_are_declared_where_llama_cpp_needs_them():
    gemma = gguf_arch("gemma2")
    assert gemma.norm_plus_one and gemma.head_from_embeddings and not gguf_arch("llama").norm_plus_one
    assert gguf_arch("llama").rotary_pairs and not gguf_arch("qwen2").rotary_pairs
    assert transformers.Gemma2Config().model_type == "gemma2"
