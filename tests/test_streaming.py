"""Streamed loading: a model folder is captured from a skeleton with fake parameters and each tensor
is read from its safetensors file when needed. Same quantized model as a full load; the weights
read and alive at any moment stay near one block's; bad checkpoints are refused as a full load does."""

import dataclasses
import json
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import main_output

import qcompiler as qc
from qcompiler.frontend import lazy_weights
from qcompiler.models import load


def _llama_folder(path, *, layers=4, dtype=torch.float32, shard="200KB"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(path, max_shard_size=shard)  # sharded, with an index
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return _llama_folder(tmp_path_factory.mktemp("llama") / "m")


def _calibration(n=3):
    gen = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 256, (2, 24), generator=gen)} for _ in range(n)]


def test_streamed_skeleton_has_no_weights(folder, monkeypatch):
    monkeypatch.setenv("QC_TEST_CAPTURE_MEMO", "0")  # torch.export itself must read no weight
    assert len(list(folder.glob("*.safetensors"))) > 1, "the fixture should be sharded"
    loaded = load(folder, stream=True)
    assert lazy_weights.fake_mode_of(loaded.model) is not None
    gm = qc.capture(loaded.model, loaded.example_inputs())
    tensors = gm.state_dict()
    placeholders = [t for t, v in tensors.items() if v.is_meta]
    assert "model.layers.0.mlp.down_proj.weight" in placeholders
    real = sum(v.numel() for v in tensors.values() if not v.is_meta)
    assert real < 1000, f"{real} weight values were read while capturing"  # rotary tables only


@pytest.fixture(scope="module")
def streamed_gptq(folder):
    """The streamed folder compiled with gptq-w4g128, materialized (``compile``'s default)."""
    x = load(folder).example_inputs()
    streamed = load(folder, stream=True)
    return qc.compile(streamed.model, x, recipe="gptq-w4g128", calibration=_calibration(), progress=False, device=None)


@pytest.mark.parametrize(
    "recipe",
    [
        "gptq-w4g128",
        pytest.param("spqr-w3g16", marks=pytest.mark.slow),
        pytest.param("w8a8-smoothquant", marks=pytest.mark.slow),
    ],
)
def test_streamed_compile_equals_full_load(folder, recipe, streamed_gptq):
    full, streamed = load(folder), load(folder, stream=True)
    x = full.example_inputs()
    want = qc.compile(full.model, x, recipe=recipe, calibration=_calibration(), progress=False, device=None)
    got = (
        streamed_gptq
        if recipe == "gptq-w4g128"
        else qc.compile(streamed.model, x, recipe=recipe, calibration=_calibration(), progress=False, device=None)
    )
    assert not any(v.is_meta for v in got.graph_module.state_dict().values())
    assert torch.equal(main_output(got(**x)), main_output(want(**x))), f"{recipe}: streamed differs from full load"


@pytest.mark.slow
def test_streamed_auto_bits_equals_full_load(folder):
    """The sensitivity runs read a streamed model's weights from disk: same plan, same tensors."""
    full, streamed = load(folder), load(folder, stream=True)
    x = full.example_inputs()
    recipe = [qc.passes.AutoBits(budget=3.5, candidates=("gptq-w2g32", "gptq-w4g32", "gptq-w8g32"), samples=2)]
    want = qc.compile(full.model, x, recipe=recipe, calibration=_calibration(), progress=False, device=None)
    got = qc.compile(streamed.model, x, recipe=recipe, calibration=_calibration(), progress=False, device=None)
    plan = {p: f["candidate"] for p, f in want.report.passes[0].layers.items()}
    assert len(set(plan.values())) > 1 and plan == {p: f["candidate"] for p, f in got.report.passes[0].layers.items()}
    assert torch.equal(main_output(got(**x)), main_output(want(**x)))


def test_finished_blocks_wait_on_disk_and_the_spill_is_removed(folder, tmp_path, monkeypatch):
    """A streamed model's packed layers are parked in a temporary folder per block instead of held
    in memory, and read back by the final rewrite (the result is the full load's: test above); the
    folder is gone afterwards."""
    import tempfile

    from qcompiler.files import spill

    parked, park = [], spill.Spill.park
    monkeypatch.setattr(
        spill.Spill, "park", lambda self, tensors: parked.append(sorted(tensors)) or park(self, tensors)
    )
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    streamed = load(folder, stream=True)
    qc.compile(
        streamed.model,
        streamed.example_inputs(),
        recipe="gptq-w4g128",
        calibration=_calibration(),
        progress=False,
        device=None,
    )
    assert len(parked) == 4 * 7 and parked[0] == ["g_idx", "qweight", "qzeros", "scales"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # 17 s; the dense form of the property runs by default (test_weights_alive_stay_near_one_block)
def test_streamed_experts_leave_memory_once_their_block_is_done(tmp_path, monkeypatch):
    """A streamed MoE model's dequantized expert weights become placeholders once the next block
    has run, and their packed tensors wait on disk: the expert bytes the graph holds stay at one
    block's whatever the depth (they grew by every block's experts: a whole Mixtral by the end).
    The result is still the full load's."""
    import transformers as T

    from qcompiler.files import spill
    from qcompiler.ir.tensors import get_raw_tensor
    from qcompiler.pipeline import block_walk as weight_only

    torch.manual_seed(0)
    config = T.MixtralConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    T.MixtralForCausalLM(config).save_pretrained(tmp_path / "m")
    held, parked = [], []
    block_done, park = weight_only._BlockQuantizer.block_done, spill.Spill.park

    def expert_bytes_after(self, start, experts_start):
        block_done(self, start, experts_start)
        tensors = [
            get_raw_tensor(self.gm, n.target)
            for n in self.gm.graph.nodes
            if n.op == "get_attr" and ".experts." in n.target
        ]
        held.append(sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta"))

    monkeypatch.setattr(weight_only._BlockQuantizer, "block_done", expert_bytes_after)
    monkeypatch.setattr(
        spill.Spill, "park", lambda self, tensors: parked.append(sorted(tensors)) or park(self, tensors)
    )
    full, streamed = load(tmp_path / "m"), load(tmp_path / "m", stream=True)
    x = _calibration(1)[0]
    got = qc.compile(streamed.model, x, recipe="gptq-w4g128", calibration=[x], progress=False, device=None)
    one_block = 4 * 3 * 48 * 32 * 4  # fp32 [gate_up 2 x 48 + down 48] x 32 per expert, 4 experts
    assert len(held) == 4 and max(held) <= one_block, held
    assert sum(names == ["g_idx", "qweight", "qzeros", "scales"] for names in parked) == 4 * (4 + 2)  # linears, experts
    want = qc.compile(full.model, x, recipe="gptq-w4g128", calibration=[x], progress=False, device=None)
    assert torch.equal(main_output(got(**x)), main_output(want(**x)))


def test_weights_alive_stay_near_one_block(tmp_path, monkeypatch):
    """Every tensor read from the checkpoint is tracked: the bytes alive at once never exceed about
    two blocks' worth, whatever the depth (full loading would hold all 8 blocks)."""
    folder = _llama_folder(tmp_path / "deep", layers=8)
    alive: weakref.WeakSet = weakref.WeakSet()
    peak = [0]
    original = lazy_weights.Checkpoint.read

    def tracked(self, key, dtype=None):
        tensor = original(self, key, dtype)  # freed by reference counting: the set forgets it at once
        alive.add(tensor)
        peak[0] = max(peak[0], sum(t.numel() * t.element_size() for t in alive))
        return tensor

    monkeypatch.setattr(lazy_weights.Checkpoint, "read", tracked)
    streamed = load(folder, stream=True)
    cm = qc.compile(
        streamed.model,
        streamed.example_inputs(),
        recipe="gptq-w4g128",
        calibration=_calibration(),
        progress=False,
        device=None,
    )
    weights = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}
    block = sum(v.numel() * v.element_size() for k, v in weights.items() if k.startswith("model.layers.0."))
    embed = 256 * 64 * 4
    total = sum(p.numel() * 4 for p in load(folder).model.parameters())
    print(f"peak {peak[0]} B alive, one block {block} B, all weights {total} B")
    assert peak[0] <= 2 * block + 2 * embed, f"peak {peak[0]} B alive; one block is {block} B"
    assert peak[0] < total / 2
    assert cm.report.passes[0].modified


def test_a_streamed_save_holds_one_tensor_at_a_time(folder, streamed_gptq, tmp_path, monkeypatch):
    """``compile(materialize=False)`` (what ``qcompiler quantize`` runs) leaves the parked packed
    layers and the untouched weights on disk; ``save`` reads each when it writes it, so the bytes
    alive during the save never exceed the largest single tensor, and the artifact is bit-identical
    to one saved from a fully materialized compile. The spill folder goes once the model is read."""
    import tempfile

    from qcompiler.files import spill

    x, recipe, want = load(folder).example_inputs(), "gptq-w4g128", streamed_gptq
    want.save(tmp_path / "want")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "spills"))
    (tmp_path / "spills").mkdir()
    cm = qc.compile(
        load(folder, stream=True).model,
        x,
        recipe=recipe,
        calibration=_calibration(),
        progress=False,
        device=None,
        materialize=False,
    )
    held = cm.graph_module.state_dict()
    assert held["model.layers.3.mlp.down_proj.qweight"].is_meta and held["lm_head.weight"].is_meta

    alive: weakref.WeakSet = weakref.WeakSet()
    peak, read = [0], [0]

    def tracked(original):
        def read_tensor(*args, **kwargs):
            tensor = original(*args, **kwargs)
            alive.add(tensor)
            read[0] += tensor.numel() * tensor.element_size()
            peak[0] = max(peak[0], sum(t.numel() * t.element_size() for t in alive))
            return tensor

        return read_tensor

    monkeypatch.setattr(lazy_weights.Checkpoint, "read", tracked(lazy_weights.Checkpoint.read))
    monkeypatch.setattr(spill.Parked, "read_one", tracked(spill.Parked.read_one))
    from qcompiler.evaluation.eval import bits_per_parameter

    assert bits_per_parameter(cm.graph_module) == bits_per_parameter(want.graph_module) and read[0] == 0
    cm.save(tmp_path / "got")
    largest = max(v.numel() * v.element_size() for v in load(folder).model.state_dict().values())
    print(f"save: {read[0]} B read, at most {peak[0]} B at once; largest tensor {largest} B")
    a, b = load_file(tmp_path / "want" / "tensors.safetensors"), load_file(tmp_path / "got" / "tensors.safetensors")
    stored = sum(t.numel() * t.element_size() for t in b.values())
    assert peak[0] <= largest and read[0] > 0.9 * stored, "the save read all but the rotary tables, one at a time"
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert list((tmp_path / "spills").iterdir()), "the parked files are what the graph reads"
    assert torch.equal(main_output(cm(**x)), main_output(want(**x)))  # the first call reads everything
    assert list((tmp_path / "spills").iterdir()) == []


def test_dtype_of_the_checkpoint_is_kept(tmp_path):
    folder = _llama_folder(tmp_path / "bf16", dtype=torch.bfloat16, layers=2)
    streamed = load(folder, stream=True)
    assert {p.dtype for p in streamed.model.parameters()} == {torch.bfloat16}
    cm = qc.compile(streamed.model, streamed.example_inputs(), recipe="rtn-w4g128", progress=False, device=None)
    norm = cm.graph_module.state_dict()["model.norm.weight"]
    assert norm.dtype == torch.bfloat16 and not norm.is_meta
    assert torch.isfinite(main_output(cm(**streamed.example_inputs())).float()).all()


def _break(folder, how):
    files = sorted(folder.glob("*.safetensors"))
    if how == "lost shard":
        files[-1].unlink()
        return "the download is incomplete"
    tensors = load_file(files[0])
    key = next(iter(tensors))
    if how == "missing":
        del tensors[key]
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        del index["weight_map"][key]
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        expect = f"is missing {key}"
    elif how == "shape":
        tensors[key] = tensors[key][:-1].contiguous()
        expect = f"wrong shape for {key}"
    else:
        tensors["model.layers.0.extra.weight"] = torch.zeros(2)
        expect = "holds tensors the model does not have: model.layers.0.extra.weight"
    save_file(tensors, files[0], metadata={"format": "pt"})
    return expect


@pytest.mark.parametrize("how", ["missing", "shape", "extra", "lost shard"])
def test_damaged_checkpoints_are_refused_by_name(tmp_path, how):
    folder = _llama_folder(tmp_path / how, layers=2)
    expect = _break(folder, how)
    with pytest.raises(ValueError, match=expect.replace(".", r"\.").replace("[", r"\[")):
        load(folder, stream=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch", ["mistral", "qwen2", "qwen3", "gemma2", "phi3", "gpt2", "opt", "gpt_neox", "falcon", "bloom"]
)
def test_every_dense_architecture_streams(tmp_path, arch):
    """Checkpoint names go through transformers' renamings (GPT-NeoX embed_out) and base-model
    prefixes (GPT-2's transformer.): the streamed model equals the fully loaded one."""
    import causal_lms

    model = causal_lms.causal_lm(arch)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(tmp_path)
    full, streamed = load(tmp_path), load(tmp_path, stream=True)
    x = full.example_inputs()
    want = qc.compile(full.model, x, recipe="gptq-w4g128", calibration=[x], progress=False, device=None)
    got = qc.compile(streamed.model, x, recipe="gptq-w4g128", calibration=[x], progress=False, device=None)
    assert torch.equal(main_output(got(**x)), main_output(want(**x)))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_moe_checkpoints_transformers_converts_stream_and_compile_like_a_full_load(tmp_path, arch):
    """Mixtral / Qwen2-MoE checkpoints store one linear per expert; the model stacks them
    (``experts.gate_up_proj [E, 2I, H]``). Streaming builds each stacked tensor from its sources
    through transformers' own conversion, when its block is calibrated."""
    import causal_lms

    causal_lms.causal_lm(arch).save_pretrained(tmp_path)
    assert not any(".experts.gate_up_proj" in k for f in tmp_path.glob("*.safetensors") for k in load_file(f))
    full, streamed = load(tmp_path), load(tmp_path, stream=True)
    x = full.example_inputs()
    want = qc.compile(full.model, x, recipe="gptq-w4g128", calibration=[x], progress=False, device=None)
    got = qc.compile(streamed.model, x, recipe="gptq-w4g128", calibration=[x], progress=False, device=None)
    assert got.report.passes[0].layers.keys() == want.report.passes[0].layers.keys()
    assert sum(".experts." in k for k in got.report.passes[0].layers) == 2 * 2 * 4  # layers x matrices x experts
    assert torch.equal(main_output(got(**x)), main_output(want(**x)))


def test_converted_experts_keep_their_order_past_ten(tmp_path):
    """``experts.10`` is the eleventh expert, not the third (a plain sort of the keys)."""
    import transformers as T

    from qcompiler.frontend.checkpoint_keys import Converted, checkpoint_keys

    torch.manual_seed(0)
    config = T.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=12,
        num_experts_per_tok=2,
    )
    T.MixtralForCausalLM(config).save_pretrained(tmp_path)
    model, checkpoint = load(tmp_path).model, lazy_weights.Checkpoint(tmp_path)
    keys = checkpoint_keys(model, checkpoint.file_of)
    entry = keys["model.layers.0.mlp.experts.down_proj"]
    assert isinstance(entry, Converted) and len(entry.keys()) == 12
    for name in ("model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj"):
        assert checkpoint.shape_of_entry(keys[name]) == tuple(model.get_parameter(name).shape)
        assert torch.equal(checkpoint.read_entry(keys[name]), model.get_parameter(name))


def test_a_pass_that_computes_on_a_placeholder_is_caught(folder):
    """A user pass reading ``gm.get_parameter`` gets a meta placeholder; storing what it computed
    from it must fail loudly, not be silently replaced by the checkpoint's weight."""
    from qcompiler.errors import PassError
    from qcompiler.ir.graph import find_linears
    from qcompiler.ir.tensors import set_tensor

    @dataclasses.dataclass(frozen=True)
    class ReadsParameters(qc.Pass):
        def run(self, gm, ctx):
            layer = find_linears(gm)[0]
            set_tensor(gm, layer.weight_node.target, gm.get_parameter(layer.weight_node.target) * 0.5)
            return True

    streamed = load(folder, stream=True)
    with pytest.raises(PassError, match="placeholder.*get_tensor"):
        qc.compile(streamed.model, streamed.example_inputs(), recipe=[ReadsParameters()], progress=False)


def test_a_killed_runs_spill_folder_is_swept_by_the_next_run(tmp_path, monkeypatch):
    """kill -9 skips every cleanup: the next Spill removes folders whose PID no longer runs, and
    leaves a live run's, a foreign folder and a link alone."""
    import os
    import subprocess
    import sys
    import tempfile

    from qcompiler.files import spill

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"qcompiler-spill-{int(dead.stdout)}-abc"
    stale.mkdir()
    (stale / "0.safetensors").write_bytes(b"x" * 100)
    live = tmp_path / f"qcompiler-spill-{os.getpid()}-def"
    live.mkdir()
    foreign = tmp_path / "qcompiler-spill-notes"
    foreign.mkdir()
    (tmp_path / f"qcompiler-spill-{int(dead.stdout)}-lnk").symlink_to(foreign)
    s = spill.Spill()
    assert not stale.exists() and live.exists() and foreign.exists()
    assert s._folder.name.startswith(f"qcompiler-spill-{os.getpid()}-")
    s.close()
