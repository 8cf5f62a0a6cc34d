"""The pass contract is checked, not trusted: what a pass provides must hold after it, passes are
frozen dataclasses, configs carry versions that artifacts check, and one registry names passes for
recipes, artifacts and the manager (a user pass runs from a YAML recipe through the CLI)."""

import json
import sys
import textwrap
from dataclasses import dataclass

import pytest
import torch
from tiny_models import example_inputs, make_model

import qcompiler as qc
from qcompiler.cli import main
from qcompiler.pipeline.pass_contract import PostconditionError, properties_of


@dataclass(frozen=True)
class ClaimsQuantized(qc.Pass):
    """Says it quantized weights and says it changed the graph, but rewrites nothing."""

    provides = frozenset({qc.GraphProperty.QUANTIZED_WEIGHTS})

    def run(self, gm, ctx):
        return True


@dataclass(frozen=True)
class ClaimsSmoothed(qc.Pass):
    provides = frozenset({qc.GraphProperty.SMOOTHED})

    def run(self, gm, ctx):
        return False


class NotADataclass(qc.Pass):
    def run(self, gm, ctx):
        return False


@dataclass
class MutableSettings(qc.Pass):
    k: int = 1

    def run(self, gm, ctx):
        return False


@dataclass(frozen=True)
class Rebuilds(qc.Pass):
    """Returns a new graph (a copy whose first linear is scaled by 0) instead of editing in place."""

    def run(self, gm, ctx):
        import copy

        from qcompiler.ir.graph import find_linears
        from qcompiler.ir.tensors import set_tensor

        new = copy.deepcopy(gm)
        layer = find_linears(new)[0]
        set_tensor(new, layer.weight_node.target, layer.weight(new) * 0)
        ctx.record.notes.append("zeroed " + layer.path)
        return qc.PassResult(new, True, ctx.record)


@pytest.fixture(scope="module")
def llama():
    return make_model("llama")


def test_a_pass_whose_claim_does_not_hold_fails_naming_itself(llama):
    with pytest.raises(
        PostconditionError,
        match=r"^pass #1 ClaimsQuantized provides QUANTIZED_WEIGHTS, but it "
        r"added no node of an op that establishes it \(still 0\)$",
    ):
        qc.compile(llama, example_inputs("llama"), recipe=[ClaimsQuantized()], progress=False)
    with pytest.raises(
        PostconditionError, match="pass #2 ClaimsSmoothed provides SMOOTHED, but it reported that it changed nothing"
    ):
        qc.compile(
            llama,
            example_inputs("llama"),
            recipe=[qc.passes.RTN(bits=4, group_size=32), ClaimsSmoothed()],
            progress=False,
        )
    # standalone, qc.run_pass runs one pass under the same contract
    gm = qc.capture(llama, example_inputs("llama"))
    with pytest.raises(PostconditionError, match="^pass ClaimsQuantized provides"):
        qc.run_pass(ClaimsQuantized(), gm, qc.PassContext(example_inputs=((), example_inputs("llama")), progress=False))


def test_passes_must_be_frozen_dataclasses(llama):
    with pytest.raises(
        qc.PipelineError,
        match="pipeline item #1 NotADataclass is not a frozen dataclass: "
        r"decorate NotADataclass with @dataclass\(frozen=True\)",
    ):
        qc.compile(llama, example_inputs("llama"), recipe=[NotADataclass()], progress=False)
    with pytest.raises(qc.PipelineError, match="pipeline item #2 MutableSettings is not a frozen dataclass"):
        qc.compile(llama, example_inputs("llama"), recipe=[qc.passes.RTN(), MutableSettings()], progress=False)


def test_properties_are_recorded_on_the_graph_and_in_the_artifact(llama, tmp_path):
    cm = qc.compile(
        llama,
        example_inputs("llama"),
        recipe="w8a8-smoothquant",
        calibration=[example_inputs("llama", 4, 16, seed=s) for s in range(2)],
        progress=False,
    )
    held = {qc.GraphProperty.CAPTURED, qc.GraphProperty.SMOOTHED, qc.GraphProperty.INT8_LOWERED}
    assert properties_of(cm.graph_module) == held
    cm.save(tmp_path / "a")
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["properties"] == sorted(p.value for p in held)
    assert properties_of(qc.load(tmp_path / "a").graph_module) == held


def test_a_pass_may_return_a_new_graph(llama):
    cm = qc.compile(llama, example_inputs("llama"), recipe=[Rebuilds()], progress=False)
    assert cm.report.passes[0].modified and cm.report.passes[0].notes == ["zeroed model.layers.0.self_attn.q_proj"]
    from qcompiler.ir.graph import find_linears

    assert not find_linears(cm.graph_module)[0].weight(cm.graph_module).any()
    assert llama.model.layers[0].self_attn.q_proj.weight.any()  # the user's model is untouched


def _bump_version(folder, version):
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["recipe"]["passes"][0]["config_version"] = version
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_an_artifact_from_another_config_version_is_refused_or_migrated(llama, tmp_path, monkeypatch):
    cm = qc.compile(llama, example_inputs("llama"), recipe="rtn-w4g128", progress=False)
    cm.save(tmp_path / "a")
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["recipe"]["passes"][0]["config_version"] == qc.passes.RTN.config_version == 1
    _bump_version(tmp_path / "a", 0)
    with pytest.raises(
        qc.QCompilerError,
        match=r"manifest.json: pass RTN: the artifact's settings are config "
        r"version 0, this qcompiler's RTN is version 1 and has no migration",
    ):
        qc.load(tmp_path / "a")
    # a pass that changed a field's meaning raises its version and says how to read the old one
    monkeypatch.setattr(qc.passes.RTN, "config_version", 2, raising=False)
    monkeypatch.setattr(
        qc.passes.RTN,
        "migrate_config",
        classmethod(lambda cls, config, version: {**config, "bits": 3} if version == 0 else None),
    )
    assert qc.load(tmp_path / "a").recipe.passes == (qc.passes.RTN(bits=3, group_size=128),)


USER_PASS = '''
from dataclasses import dataclass
import qcompiler as qc
from qcompiler.ir.graph import block_of, find_linears


from qcompiler.ir.tensors import set_tensor
@dataclass(frozen=True)
class ClipWeights(qc.Pass):
    """Clips each block linear's weight to +-k standard deviations."""

    k: float = 3.0
    provides = frozenset()

    def run(self, gm, ctx):
        for layer in find_linears(gm):
            if block_of(layer.path) is not None:
                w = layer.weight(gm)
                set_tensor(gm, layer.weight_node.target, w.clamp(-self.k * w.std(), self.k * w.std()))
                ctx.record.layers[layer.path] = {"k": self.k}
        return True
'''


def test_a_user_pass_runs_from_a_yaml_recipe_through_the_cli_and_its_artifact_reloads(tmp_path, monkeypatch):
    (tmp_path / "my_passes.py").write_text(textwrap.dedent(USER_PASS))
    (tmp_path / "r.yaml").write_text(
        "name: clipped-w4\npasses:\n  - pass: my_passes:ClipWeights\n    k: 2.5\n"
        "  - pass: RTN\n    bits: 4\n    group_size: 64\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_passes", raising=False)
    out = tmp_path / "out"
    assert main(["quantize", "bundled:tinylm", "--recipe", str(tmp_path / "r.yaml"), "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert [p["pass"] for p in manifest["recipe"]["passes"]] == ["my_passes:ClipWeights", "RTN"]
    from my_passes import ClipWeights

    cm = qc.load(out)
    assert cm.recipe.passes == (ClipWeights(k=2.5), qc.passes.RTN(bits=4, group_size=64))
    assert len(cm.report.passes[0].layers) == 28 and cm.report.passes[0].layers["model.layers.0.mlp.up_proj"]
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(cm(input_ids=ids).logits).all()


def test_artifacts_never_import_and_recipe_files_name_what_failed(tmp_path, monkeypatch, llama):
    from qcompiler.pipeline.recipe_files import load_recipe_file

    (tmp_path / "missing.yaml").write_text("passes:\n  - pass: no_such_module_here:Pass\n")
    with pytest.raises(
        qc.RecipeError,
        match=r"passes\[0\]: cannot import module 'no_such_module_here' for pass "
        r"'no_such_module_here:Pass' \(ModuleNotFoundError",
    ):
        load_recipe_file(tmp_path / "missing.yaml")
    (tmp_path / "notpass.yaml").write_text("passes:\n  - pass: json:dumps\n")
    with pytest.raises(qc.RecipeError, match="'json:dumps' is function, not a qc.Pass subclass"):
        load_recipe_file(tmp_path / "notpass.yaml")
    (tmp_path / "typo.yaml").write_text("passes:\n  - pass: GTPQ\n")
    with pytest.raises(qc.RecipeError, match="unknown pass 'GTPQ'; did you mean 'GPTQ'"):
        load_recipe_file(tmp_path / "typo.yaml")
    # an artifact naming a module that is not imported: its graph loads, nothing is imported
    cm = qc.compile(llama, example_inputs("llama"), recipe="rtn-w4g128", progress=False)
    cm.save(tmp_path / "a")
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    manifest["recipe"]["passes"][0]["pass"] = "evil_module_never_imported:Pass"
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "evil_module_never_imported.py").write_text("raise SystemExit('imported!')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    loaded = qc.load(tmp_path / "a")
    assert (
        loaded.recipe.passes == ()
        and "not imported in this process: evil_module_never_imported:Pass" in loaded.recipe.description
    )
    assert "evil_module_never_imported" not in sys.modules


def test_weight_quantizers_take_the_base_fields_by_keyword_and_keep_their_own_positions():
    """``ignore``, ``true_sequential`` and ``lm_head`` are the base's keyword-only fields: every weight
    quantizer has them (no duck typing), positional construction still means the subclass's own
    fields, a pass that cannot quantize the head refuses ``lm_head=True``, and a subclass that
    redeclares a base field positionally is refused by name when built."""
    import dataclasses

    from qcompiler.errors import QuantizationError
    from qcompiler.passes import GPTQ, RTN, AutoBits, MixedPrecision, SignRound, SpQR
    from qcompiler.pipeline.weight_quantizer import WeightQuantizer

    for cls in (GPTQ, RTN, SpQR, SignRound, AutoBits, MixedPrecision):
        base = {f.name: f for f in dataclasses.fields(cls) if f.name in ("ignore", "true_sequential", "lm_head")}
        assert set(base) == {"ignore", "true_sequential", "lm_head"} and all(f.kw_only for f in base.values()), cls
    gptq = GPTQ(3, 64, ignore=("*.down_proj",), true_sequential=True)
    assert (gptq.bits, gptq.group_size, gptq.ignore, gptq.true_sequential) == (3, 64, ("*.down_proj",), True)
    assert SpQR().true_sequential and not GPTQ().true_sequential  # SpQR keeps its own default
    for cls in (SpQR, AutoBits, MixedPrecision):
        with pytest.raises(QuantizationError, match=f"{cls.__name__} does not quantize the output head"):
            cls(lm_head=True)
    assert GPTQ(lm_head=True).head_quantizer() is not None

    @dataclasses.dataclass(frozen=True)
    class Redeclared(WeightQuantizer):
        bits: int = 4
        ignore: tuple = ()

    with pytest.raises(TypeError, match="Redeclared redeclares 'ignore' as a positional field"):
        Redeclared()
