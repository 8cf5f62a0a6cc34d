"""A bf16 checkpoint loaded in float32 is saved no wider than it came: every untouched float32
parameter whose values bf16 holds exactly is stored as bf16 and widened again on load, so the
artifact is smaller than its source (weight-only recipe) and the reloaded graph is bit-identical.
The client checkpoints (compressed-tensors, GPTQ) likewise store those tensors in bf16 and say
``dtype: bfloat16``, as the source did, so clients run the model in the dtype it was published in."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from tiny_models import example_inputs, make_model

import qcompiler as qc
from qcompiler.interop import export_compressed_tensors, export_gptq
from qcompiler.ir.tensors import get_raw_tensor
from qcompiler.models import load
from qcompiler.store.checkpoint_dtype import WIDEN_KEY, widen
from qcompiler.store.graph_format import ArtifactError


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bf16") / "llama"
    make_model("llama").to(torch.bfloat16).save_pretrained(folder)
    return folder


def _stored_dtypes(folder) -> dict[str, torch.dtype]:
    out = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k).dtype for k in f.keys()})
    return out


def _tensors(gm) -> dict[str, torch.Tensor]:
    return {n.target: get_raw_tensor(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}


@pytest.mark.parametrize("recipe", ["rtn-w4g128", "w8a8-smoothquant"])
def test_untouched_tensors_are_stored_in_the_checkpoints_dtype_and_reload_bit_identical(bf16_folder, tmp_path, recipe):
    loaded = load(bf16_folder)  # float32 in memory
    assert next(loaded.model.parameters()).dtype == torch.float32
    calibration = [{"input_ids": torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))}]
    cm = qc.compile(loaded.model, example_inputs("llama"), recipe=recipe, calibration=calibration, progress=False)
    cm.save(tmp_path / "art")
    stored = _stored_dtypes(tmp_path / "art")
    before, after = _tensors(cm.graph_module), _tensors(qc.load(tmp_path / "art").graph_module)
    assert before.keys() == after.keys()
    for name, t in before.items():
        assert after[name].dtype == t.dtype and torch.equal(after[name], t), name  # bit-identical round trip
    embedding = "model.embed_tokens.weight"
    assert stored[embedding] == torch.bfloat16  # untouched: as the checkpoint had it
    if recipe == "rtn-w4g128":  # weight-only: never larger than the source checkpoint
        art = sum(f.stat().st_size for f in (tmp_path / "art").glob("tensors*.safetensors"))
        src = sum(f.stat().st_size for f in bf16_folder.glob("*.safetensors"))
        assert art < src
    else:  # SmoothQuant divided the norms by its scales: values bf16 does not hold stay float32
        norms = [k for k in stored if k.endswith("input_layernorm.weight")]
        assert norms and all(stored[k] == torch.float32 for k in norms)


@pytest.mark.parametrize("export", [export_compressed_tensors, export_gptq])
def test_client_checkpoints_store_untouched_tensors_in_the_sources_dtype(bf16_folder, tmp_path, export):
    import json

    loaded = load(bf16_folder)
    cm = qc.compile(loaded.model, example_inputs("llama"), recipe="rtn-w4g128-sym", progress=False)
    export(cm, tmp_path / "out", progress=lambda _m: None)
    stored = _stored_dtypes(tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        embedding = f.get_tensor("model.embed_tokens.weight")
    assert embedding.dtype == torch.bfloat16
    assert torch.equal(embedding.float(), get_raw_tensor(cm.graph_module, "model.embed_tokens.weight"))
    assert not [k for k, d in stored.items() if d == torch.float32]  # nothing wider than the source
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    out = sum(f.stat().st_size for f in (tmp_path / "out").glob("*.safetensors"))
    assert out < sum(f.stat().st_size for f in bf16_folder.glob("*.safetensors"))


def test_a_tampered_widen_list_is_refused_naming_the_tensor():
    tensors = {"a": torch.zeros(2, dtype=torch.bfloat16), "b": torch.zeros(2, dtype=torch.int32)}
    for bad in (["b"], ["missing"], "a"):
        with pytest.raises(ArtifactError, match=WIDEN_KEY):
            widen({WIDEN_KEY: bad}, dict(tensors))
    widen({WIDEN_KEY: ["a"]}, tensors)
    assert tensors["a"].dtype == torch.float32
