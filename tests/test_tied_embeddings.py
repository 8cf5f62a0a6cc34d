"""A tied output head is exported under the name the clients read the shared table from.

torch.export keeps one name for a shared parameter, often the head's (``lm_head.weight``); vLLM
skips that name for a tied model and, without the embedding, generated token 0 forever. The
checkpoint must store the table as ``save_pretrained`` does: under the input embedding's name.
"""

import pytest
import torch
import transformers
from causal_lms import calibration, config, prompt
from safetensors import safe_open

import qcompiler as qc
from qcompiler.interop import export_compressed_tensors, export_gptq

EMBEDDING = {"llama": "model.embed_tokens.weight", "opt": "model.decoder.embed_tokens.weight"}
EMBEDDING |= {"gpt2": "transformer.wte.weight", "qwen2": "model.embed_tokens.weight"}


def _tied(arch: str) -> torch.nn.Module:
    cfg = config(arch)
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    return model


def _names(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


CASES = [(a, e) for a in sorted(EMBEDDING) for e in (export_compressed_tensors, export_gptq)]
CASES.remove(("gpt2", export_compressed_tensors))  # refused: its Conv1D layers (test below)


@pytest.mark.parametrize("arch,export", CASES, ids=[f"{a}-{e.__name__}" for a, e in CASES])
def test_a_tied_table_is_stored_under_the_embedding_name(arch, export, tmp_path):
    model = _tied(arch)
    cm = qc.compile(model, {"input_ids": prompt()}, recipe="rtn-w4g128", calibration=calibration(), progress=False)
    export(cm, tmp_path / "out", progress=lambda _: None)
    names = _names(tmp_path / "out")
    assert EMBEDDING[arch] in names and "lm_head.weight" not in names
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor(EMBEDDING[arch]), model.get_input_embeddings().weight.detach())


def test_an_untied_config_gets_the_table_under_both_names(tmp_path):
    """A model sharing the tensor while its config says untied: a client reads both names."""
    model = _tied("llama")
    model.config.tie_word_embeddings = False
    cm = qc.compile(model, {"input_ids": prompt()}, recipe="rtn-w4g128", calibration=calibration(), progress=False)
    export_compressed_tensors(cm, tmp_path / "out", progress=lambda _: None)
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= _names(tmp_path / "out")


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_transformers_runs_the_tied_export_like_the_quantized_graph(arch, tmp_path):
    """Symmetric grid (this transformers' compressed-tensors loader mis-sizes asymmetric zeros)."""
    recipe = [qc.passes.GPTQ(bits=4, group_size=32, sym=True)]
    cm = qc.compile(_tied(arch), {"input_ids": prompt()}, recipe=recipe, calibration=calibration(), progress=False)
    cm.save(tmp_path / "art")  # through an artifact: the tie survives save and load
    export_compressed_tensors(qc.load(tmp_path / "art"), tmp_path / "ct", progress=lambda _: None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ct").eval()
    ids = prompt(1, 12)
    ours, theirs = cm(input_ids=ids).logits, hf(input_ids=ids).logits
    assert (ours - theirs).norm() / ours.norm() < 1e-5
    assert torch.equal(hf.generate(prompt(), max_new_tokens=16, do_sample=False), cm.generate(prompt(), 16))


def test_compressed_tensors_refuses_gpt2s_conv1d_layers_by_name(tmp_path):
    """transformers' compressed-tensors loader swaps nn.Linear only: a quantized Conv1D would load as
    its random initialization (measured: logits off by 0.79 relative), so the export refuses."""
    from causal_lms import causal_lm

    from qcompiler.interop import ExportError

    cm = qc.compile(causal_lm("gpt2"), {"input_ids": prompt()}, recipe="rtn-w4g128", progress=False)
    cm.save(tmp_path / "art")
    for model in (cm, qc.load(tmp_path / "art")):  # the capture's record survives the artifact
        with pytest.raises(ExportError, match=r"transformer\.h\.0\.attn\.c_attn is a quantized Conv1D .*--format gptq"):
            export_compressed_tensors(model, tmp_path / "ct", progress=lambda _: None)
        assert not (tmp_path / "ct").exists()
