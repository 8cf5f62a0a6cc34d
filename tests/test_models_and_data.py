"""Bundled models, local Hugging Face folders, and the offline text they are trained and judged on."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import qcompiler as qc
from qcompiler import models
from qcompiler.data import ByteTokenizer, calibration_windows, stdlib_files, stdlib_sentences
from qcompiler.evaluation.eval import mean_pooled_embeddings


def test_splits_are_disjoint_and_calibration_is_reproducible():
    train = {p.name for p in stdlib_files("train")}
    heldout = [p for p in stdlib_files("heldout")]
    assert len(heldout) >= 10 and not any(p.parent.name == "test" for p in heldout)
    assert "argparse.py" not in train and "difflib.py" not in train
    a = calibration_windows(4, 64, seed=3)
    assert a.shape == (4, 64) and torch.equal(a, calibration_windows(4, 64, seed=3))
    assert not torch.equal(a, calibration_windows(4, 64, seed=4))
    assert ByteTokenizer().decode(ByteTokenizer().encode("déjà vu")) == "déjà vu"


def test_byte_tokenizer_as_hugging_face_files_gives_the_same_ids(tmp_path):
    from transformers import AutoTokenizer

    assert ByteTokenizer().save_pretrained(tmp_path) == ["tokenizer.json", "tokenizer_config.json"]
    hf = AutoTokenizer.from_pretrained(tmp_path)
    text = "déjà vu:\n\tdef f(x):  return x  # 日本\r\n" + "".join(map(chr, range(1, 128)))
    ids = hf.encode(text, add_special_tokens=False)
    assert ids == ByteTokenizer().encode(text).tolist() and hf.decode(ids) == text
    assert len(hf) == 256 and hf.pad_token_id == 0


def test_calibration_errors():
    with pytest.raises(ValueError, match="exceed the model's context of 512"):
        calibration_windows(2, 1024, max_length=512)
    with pytest.raises(ValueError, match="count >= 1"):
        calibration_windows(0, 16)


def test_local_hf_folder_loads_through_the_same_entry_point(tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    ).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    loaded = models.load(tmp_path)
    assert loaded.kind == "causal-lm" and isinstance(loaded.tokenizer, ByteTokenizer)
    ids = torch.randint(0, 256, (2, 9))
    assert torch.equal(loaded.model(input_ids=ids).logits, model(input_ids=ids).logits)
    cm = qc.compile(loaded.model, loaded.example_inputs(), recipe="rtn-w4g128", progress=False)
    assert cm(input_ids=ids).logits.shape == (2, 9, 256)


def test_bad_model_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.load(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        models.load(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not really")
    with pytest.raises(
        FileNotFoundError, match=r"no safetensors weights; it has pickle checkpoints \(pytorch_model.bin\)"
    ):
        models.load(tmp_path)


def test_minilm_is_the_real_pretrained_encoder(minilm):
    assert minilm.kind == "encoder" and type(minilm.model).__name__ == "BertModel"
    sentences = stdlib_sentences("heldout", 8)
    assert len(sentences) == 8 and all(s.endswith(".") for s in sentences)
    emb = mean_pooled_embeddings(
        minilm.model,
        minilm.tokenizer,
        ["A man is playing a guitar.", "Someone plays an instrument.", "Stock prices fell sharply."],
    )
    cos = torch.nn.functional.cosine_similarity
    assert cos(emb[0], emb[1], dim=0) > cos(emb[0], emb[2], dim=0) + 0.2  # pretrained semantics, not random
    with pytest.raises(ValueError, match="at least one sentence"):
        mean_pooled_embeddings(minilm.model, minilm.tokenizer, [])


def test_a_folders_own_code_runs_only_when_trusted(tmp_path):
    """transformers' trust_remote_code, off by default: refused without it, the folder's classes with it."""
    from tiny_models import make_model

    from qcompiler.models import load

    make_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(
        model_type="qcx_custom",
        architectures=["QcxForCausalLM"],
        auto_map={"AutoConfig": "configuration_qcx.QcxConfig", "AutoModelForCausalLM": "modeling_qcx.QcxForCausalLM"},
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "configuration_qcx.py").write_text(
        "from transformers import LlamaConfig\n\nclass QcxConfig(LlamaConfig):\n    model_type = 'qcx_custom'\n"
    )
    (tmp_path / "modeling_qcx.py").write_text(
        "from transformers import LlamaForCausalLM\nfrom .configuration_qcx import QcxConfig\n\n"
        "class QcxForCausalLM(LlamaForCausalLM):\n    config_class = QcxConfig\n"
    )
    with pytest.raises(ValueError, match="--trust-remote-code"):
        load(tmp_path)
    for stream in (False, True):
        loaded = load(tmp_path, trust_remote_code=True, stream=stream)
        assert type(loaded.model).__name__ == "QcxForCausalLM"
