"""Saving/loading artifacts, recipe files, and the GPTQ / compressed-tensors checkpoint formats."""

import json

import pytest
import torch
from tiny_models import example_inputs, main_output, make_model

import qcompiler as qc
from qcompiler import import_gptq
from qcompiler.algorithms.packing import pack_cols, unpack_rows
from qcompiler.errors import RecipeError
from qcompiler.interop import ExportError, export_compressed_tensors, export_gptq
from qcompiler.ir.graph import module_path
from qcompiler.ir.tensors import get_tensor
from qcompiler.layouts.gptq import dequantize_gptq
from qcompiler.layouts.gptq_format import zeros_from_v1, zeros_to_v1
from qcompiler.pipeline.recipe_files import load_recipe_file, recipe_from_dict, recipe_to_dict


def _compile(recipe, arch="llama"):
    model = make_model(arch)
    calib = [example_inputs(arch, seed=s) for s in range(2)]
    return qc.compile(model, example_inputs(arch), recipe=recipe, calibration=calib, progress=False)


def _same_outputs(a, b, arch="llama"):
    inputs = example_inputs(arch, batch=1, seq=5, seed=9)
    return torch.equal(main_output(a(**inputs)), main_output(b(**inputs)))


@pytest.mark.parametrize("recipe", ["gptq-w4g128-act", "spqr-w3g16", "w8a8-smoothquant"])
def test_save_then_load_gives_identical_outputs_without_calibration(recipe, tmp_path):
    cm = _compile(recipe)
    cm.save(tmp_path / "a")
    loaded = qc.load(tmp_path / "a")
    assert _same_outputs(cm, loaded)
    assert loaded.recipe.passes == cm.recipe.passes
    assert loaded.report.to_dict() == json.loads(json.dumps(cm.report.to_dict()))


def test_a_sharded_artifact_reloads_identical_and_each_shard_is_checked(tmp_path):
    """Past ``max_shard_bytes`` the tensors go to several files (manifest version 3): the reload,
    the report page and the checksums see all of them; an unsharded save stays version 2."""
    from qcompiler.evaluation.report_page import write_report
    from qcompiler.store.artifact import read_manifest

    cm = _compile("spqr-w3g16")
    cm.save(tmp_path / "one")
    assert read_manifest(tmp_path / "one")["version"] == 2
    cm.save(tmp_path / "a", max_shard_bytes=16 * 1024)
    manifest = read_manifest(tmp_path / "a")
    shards = manifest["files"]["tensors"]
    assert manifest["version"] == 3 and len(shards) > 2
    from safetensors.torch import load_file

    whole, parts = load_file(tmp_path / "one" / "tensors.safetensors"), [load_file(tmp_path / "a" / n) for n in shards]
    for part in parts:  # at most the bound, unless one tensor alone is bigger
        assert len(part) == 1 or sum(t.numel() * t.element_size() for t in part.values()) <= 16 * 1024
    assert sorted(k for part in parts for k in part) == sorted(whole)
    loaded = qc.load(tmp_path / "a")
    assert _same_outputs(cm, loaded)
    write_report(tmp_path / "a", tmp_path / "rep")
    assert (tmp_path / "rep" / "outliers.png").is_file()  # reads col_idx/perm across shards
    last = tmp_path / "a" / shards[-1]
    data = bytearray(last.read_bytes())
    data[-1] ^= 0xFF
    last.write_bytes(bytes(data))
    from qcompiler.store.graph_format import ArtifactError

    with pytest.raises(ArtifactError, match=f"{shards[-1]} does not match its SHA-256"):
        qc.load(tmp_path / "a")


def test_interrupted_save_leaves_the_previous_artifact(tmp_path, monkeypatch):
    first, second = _compile("rtn-w4g128"), _compile("rtn-w3g128")
    first.save(tmp_path / "a")
    import qcompiler.store.artifact as artifact

    real = artifact.save_file
    calls = []

    def failing(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 1:  # the example inputs, after the weights: the crash comes mid-save
            raise KeyboardInterrupt("injected")
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(artifact, "save_file", failing)
    with pytest.raises(KeyboardInterrupt):
        second.save(tmp_path / "a")
    assert [p.name for p in tmp_path.iterdir()] == ["a"]  # no temporary folder left behind
    import os
    import stat

    mask = os.umask(0)
    os.umask(mask)
    for entry in [tmp_path / "a", *(tmp_path / "a").iterdir()]:  # not the private modes of mkdtemp/mkstemp
        expected = (0o777 if entry.is_dir() else 0o666) & ~mask
        assert stat.S_IMODE(entry.stat().st_mode) == expected, entry
    reloaded = qc.load(tmp_path / "a")
    assert reloaded.recipe.name == "rtn-w4g128" and _same_outputs(first, reloaded)


def test_recipe_files_parse_to_the_typed_passes(tmp_path):
    (tmp_path / "r.yaml").write_text(
        "name: mine\npasses:\n  - pass: SmoothQuant\n    alpha: 0.8\n  - pass: LowerInt8\n"
    )
    r = load_recipe_file(tmp_path / "r.yaml")
    assert r.passes == (qc.passes.SmoothQuant(alpha=0.8), qc.passes.LowerInt8())
    (tmp_path / "r.toml").write_text('[[passes]]\npass = "GPTQ"\nbits = 3\ngroup_size = -1\nact_order = true\n')
    assert load_recipe_file(tmp_path / "r.toml").passes == (qc.passes.GPTQ(bits=3, group_size=-1, act_order=True),)
    for name in ("gptq-w4g128-static", "spqr-w3g16", "w8a8-smoothquant-auto"):
        builtin = qc.get_recipe(name)
        assert recipe_from_dict(recipe_to_dict(builtin)).passes == builtin.passes
    with pytest.raises(RecipeError, match=r"passes\[0\] \(SpQR\): unknown key 'outlier_treshold'; did you mean"):
        recipe_from_dict({"passes": [{"pass": "SpQR", "outlier_treshold": 0.5}]})
    with pytest.raises(RecipeError, match="bits='4' must be int"):
        recipe_from_dict({"passes": [{"pass": "RTN", "bits": "4"}]})
    assert (
        qc.compile(
            make_model("llama"),
            example_inputs("llama"),
            recipe=str(tmp_path / "r.yaml"),
            calibration=[example_inputs("llama")],
            progress=False,
        ).recipe.name
        == "mine"
    )


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_v1_zero_points_round_trip(bits):
    z = torch.randint(1, 2**bits, (3, 64))
    packed = pack_cols(z, bits)
    assert torch.equal(zeros_from_v1(zeros_to_v1(packed, bits, 64), bits, 64), packed)


@pytest.mark.parametrize(
    "recipe,zero_format,desc_act",
    [
        ([qc.passes.GPTQ(bits=4, group_size=32, act_order=True, static_groups=False)], "auto", True),
        pytest.param("rtn-w3g128", "v2", False, marks=pytest.mark.slow),
        pytest.param("gptq-w2g128", "auto", False, marks=pytest.mark.slow),
    ],
)
def test_gptq_checkpoint_round_trip_is_bit_identical(recipe, zero_format, desc_act, tmp_path):
    cm = _compile(recipe)
    export_gptq(cm, tmp_path / "ckpt", zero_format=zero_format, progress=lambda _: None)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_method"] == "gptq" and quant["desc_act"] == desc_act
    back = import_gptq(tmp_path / "ckpt")

    def packed(c):
        return {
            module_path(n.args[1]): [get_tensor(c.graph_module, a.target) for a in n.args[1:5]]
            for n in c.graph_module.graph.nodes
            if n.target == torch.ops.qc.quant_linear.default
        }

    ours, theirs = packed(cm), packed(back)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(a, b) for k in ours for a, b in zip(ours[k], theirs[k]))
    assert _same_outputs(cm, back)


def test_checkpoint_exports_hold_only_the_models_own_tensor_names(tmp_path):
    """Loaders map every tensor name to a parameter (vLLM refuses an unknown one): no export-lifted
    constants, no non-persistent buffers (rotary inv_freq), nothing beside the packed layers."""
    from safetensors import safe_open

    model = make_model("llama")
    cm = qc.compile(model, {"input_ids": example_inputs("llama")["input_ids"]}, recipe="rtn-w4g128", progress=False)
    assert cm.cache_layout is not None and any("lifted_tensor" in n for n in cm.capture_info.transient)
    state = set(model.state_dict())
    quantized = {row["layer"] for row in cm.report.layer_table()}
    for export, suffixes in (
        (export_gptq, ("qweight", "qzeros", "scales", "g_idx")),
        (export_compressed_tensors, ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")),
    ):
        folder = export(cm, tmp_path / export.__name__, progress=lambda _m: None)
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        packed = {f"{layer}.{s}" for layer in quantized for s in suffixes}
        assert names - packed <= state, sorted(names - packed - state)
        assert names - packed == state - {f"{layer}.weight" for layer in quantized}


def test_sharded_checkpoint_has_an_index_and_imports_bit_identical(tmp_path):
    cm = _compile("rtn-w4g128")
    limit = 40_000
    folder = export_gptq(cm, tmp_path / "sharded", max_shard_bytes=limit, progress=lambda _m: None)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 2 and shards == sorted(set(index["weight_map"].values()))
    assert not (folder / "model.safetensors").exists()
    from safetensors import safe_open

    total = 0
    for shard in shards:
        with safe_open(str(folder / shard), "pt") as f:
            sizes = [f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()]
            assert all(index["weight_map"][k] == shard for k in f.keys())
        assert sum(sizes) <= limit or len(sizes) == 1  # a bigger tensor gets a shard of its own
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total
    assert _same_outputs(cm, import_gptq(folder))
    with pytest.raises(ValueError, match="max_shard_bytes"):
        export_gptq(cm, tmp_path / "bad", max_shard_bytes=0, progress=lambda _m: None)


def test_gptq_v1_refuses_zero_points_it_cannot_hold(tmp_path):
    model = make_model("llama")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.abs_()  # all weights >= 0: an asymmetric grid's zero is 0
    cm = qc.compile(model, example_inputs("llama"), recipe="rtn-w4g128", progress=False)
    with pytest.raises(ExportError, match=r"layer model\.layers\.0\.mlp\.up_proj has zero points equal to 0"):
        export_gptq(cm, tmp_path / "v1", zero_format="v1", progress=lambda _: None)
    assert not (tmp_path / "v1").exists()
    export_gptq(cm, tmp_path / "auto", progress=lambda _: None)
    assert (
        json.loads((tmp_path / "auto" / "config.json").read_text())["quantization_config"]["checkpoint_format"]
        == "gptq_v2"
    )
    assert _same_outputs(cm, import_gptq(tmp_path / "auto"))


def _library_decompress(folder):
    """Each layer's weight as the compressed-tensors library itself decompresses it."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(config)
    state = load_file(str(folder / "model.safetensors"))
    out = {}
    for name, scheme in parsed.config_groups.items():
        compressor = BaseCompressor.load_from_registry(config["config_groups"][name]["format"])
        for path in scheme.targets:
            local = {k[len(path) + 1 :]: v for k, v in state.items() if k.startswith(path + ".")}
            out[path] = (compressor.decompress(local, scheme)["weight"], local)
    return out


def test_compressed_tensors_export_matches_the_library_decompression(tmp_path):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    cm = _compile("gptq-w4g128")
    export_compressed_tensors(cm, tmp_path / "ct", progress=lambda _: None)
    theirs = _library_decompress(tmp_path / "ct")
    gm = cm.graph_module
    nodes = [n for n in gm.graph.nodes if n.target == torch.ops.qc.quant_linear.default]
    assert len(theirs) == len(nodes) == 14
    for node in nodes:
        qweight, qzeros, scales, g_idx = (get_tensor(gm, a.target) for a in node.args[1:5])
        weight, stored = theirs[module_path(node.args[1])]
        codes = unpack_from_int32(stored["weight_packed"], 4, stored["weight_shape"]).int() + 8
        assert torch.equal(codes, unpack_rows(qweight, 4, g_idx.numel()).t())  # integer codes: exact
        ours = dequantize_gptq(qweight, qzeros, scales, g_idx, 4)
        torch.testing.assert_close(weight.float(), ours, rtol=2**-10, atol=1e-7)  # fp16 rounding of the product


def test_compressed_tensors_w8a8_and_refusals(tmp_path):
    cm = _compile("w8a8-smoothquant")
    export_compressed_tensors(cm, tmp_path / "ct8", progress=lambda _: None)
    theirs = _library_decompress(tmp_path / "ct8")
    gm = cm.graph_module
    for node in (n for n in gm.graph.nodes if n.target == torch.ops.qc.int8_linear.default):
        ours = get_tensor(gm, node.args[1].target).float() * get_tensor(gm, node.args[2].target).float().reshape(-1, 1)
        torch.testing.assert_close(theirs[module_path(node.args[1])][0].float(), ours, rtol=1e-6, atol=0)
    with pytest.raises(ExportError, match=r"layer model\.layers\.0\.\S+ is qc\.spqr_dense_linear"):
        export_compressed_tensors(_compile("spqr-w3g16"), tmp_path / "s", progress=lambda _: None)
    with pytest.raises(ExportError, match="smooth|SmoothQuant"):
        export_compressed_tensors(_compile("w8a8-smoothquant", arch="bert"), tmp_path / "b", progress=lambda _: None)
    assert not (tmp_path / "s").exists() and not (tmp_path / "b").exists()


def test_recipe_reference_page_is_current():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).parents[1]
    spec = importlib.util.spec_from_file_location("recipe_reference", root / "scripts" / "recipe_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (root / "docs" / "recipes.md").read_text() == module.page(), (
        "regenerate: python scripts/recipe_reference.py > docs/recipes.md"
    )


def test_example_recipe_files_parse():
    from pathlib import Path

    folder = Path(__file__).parents[1] / "examples" / "recipes"
    assert load_recipe_file(folder / "gptq-w4-act.yaml").passes == qc.get_recipe("gptq-w4g128-static").passes
    assert (
        load_recipe_file(folder / "w8a8-smoothquant-auto.toml").passes == qc.get_recipe("w8a8-smoothquant-auto").passes
    )


def test_exports_from_a_reloaded_artifact_keep_the_true_ignore_list(tmp_path):
    """A reloaded graph has no module-stack metadata; layer paths come from the weight names."""
    _compile("rtn-w4g128").save(tmp_path / "a")
    export_compressed_tensors(qc.load(tmp_path / "a"), tmp_path / "ct", progress=lambda _: None)
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    assert config["quantization_config"]["ignore"] == ["lm_head"]


@pytest.mark.parametrize("arch", [pytest.param("mistral", marks=pytest.mark.slow), "gemma2"])
def test_sliding_window_models_save_reload_and_generate_the_same(arch, tmp_path):
    """Their cache graph computes lengths with torch.sym_max / sym_min, which the artifact stores;
    past the window, generate gives transformers' own greedy tokens (the cache stops growing)."""
    import transformers
    from causal_lms import calibration, config, prompt

    cfg = config(arch)
    cfg.sliding_window = 8  # generation runs past the window
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    cm = qc.compile(model, {"input_ids": prompt()}, recipe="rtn-w4g128", calibration=calibration(), progress=False)
    assert any(n.target in (torch.sym_max, torch.sym_min) for n in cm.graph_module.graph.nodes)
    cm.save(tmp_path / "art")
    back = qc.load(tmp_path / "art")
    ids = prompt(1, 12)
    assert torch.equal(back(input_ids=ids).logits, cm(input_ids=ids).logits)
    assert torch.equal(back.generate(prompt(), 24), cm.generate(prompt(), 24))
    fp = qc.compile(model, {"input_ids": prompt()}, recipe="none", progress=False)
    reference = model.generate(prompt(), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert torch.equal(fp.generate(prompt(), 24), reference)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt()], 1)
    mask = (padded != 0).long()
    if arch == "gemma2":  # sliding and full layers at once: refused, not silently different
        with pytest.raises(ValueError, match="padded batch past the sliding window"):
            fp.generate(padded, 20, attention_mask=mask)
    else:
        reference = model.generate(padded, attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False)
        assert torch.equal(fp.generate(padded, 20, attention_mask=mask), reference)


@pytest.mark.parametrize("bits", [pytest.param(4, marks=pytest.mark.slow), 3])  # 3: halves inside packed words
def test_phi3s_fused_gate_up_is_written_as_two_exact_halves(bits, tmp_path):
    """The GPTQ export cuts Phi-3's gate_up_proj into gate_proj and up_proj (what GPTQModel loads):
    the halves dequantize to exactly the fused layer's rows."""
    from causal_lms import calibration, causal_lm, prompt
    from safetensors.torch import load_file

    from qcompiler.interop.checkpoint import layer_writers

    recipe = [qc.passes.GPTQ(bits=bits, group_size=32, sym=False)]
    cm = qc.compile(
        causal_lm("phi3"), {"input_ids": prompt()}, recipe=recipe, calibration=calibration(), progress=False
    )
    export_gptq(cm, tmp_path / "ckpt", zero_format="v2", progress=lambda _: None)
    stored = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    prefix = "model.layers.1.mlp."
    assert not any(k.startswith(prefix + "gate_up_proj") for k in stored)
    layer = next(
        write(cm.graph_module, a, path)
        for a, path, write in layer_writers(cm.graph_module, "gptq", "GPTQ")
        if path == prefix + "gate_up_proj"
    )
    fused = dequantize_gptq(*(layer.tensors[k] for k in ("qweight", "qzeros", "scales", "g_idx")), bits)
    halves = [
        dequantize_gptq(
            stored[f"{prefix}{part}.qweight"],
            stored[f"{prefix}{part}.qzeros"],
            stored[f"{prefix}{part}.scales"],
            stored[f"{prefix}{part}.g_idx"],
            bits,
        )
        for part in ("gate_proj", "up_proj")
    ]
    assert torch.equal(torch.cat(halves, 0), fused)
    back = qc.import_gptq(tmp_path / "ckpt")  # our importer joins them again: the same model
    assert torch.equal(back(input_ids=prompt(1, 9)).logits, cm(input_ids=prompt(1, 9)).logits)
