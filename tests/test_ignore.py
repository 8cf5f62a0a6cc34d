"""``ignore``: layers a pass leaves in full precision, by module-path glob or ``re:`` regex, in Python
and in recipe files; a pattern that matches nothing says so."""

import pytest
import torch
from tiny_models import example_inputs, make_model

import qcompiler as qc
from qcompiler.errors import QuantizationError
from qcompiler.ir.graph import find_linears
from qcompiler.ir.tensors import get_tensor
from qcompiler.pipeline.recipe_files import recipe_from_dict


def _calib():
    gen = torch.Generator().manual_seed(2)
    return [{"input_ids": torch.randint(0, 96, (2, 12), generator=gen)} for _ in range(2)]


def _fp_paths(cm) -> set[str]:
    return {layer.path for layer in find_linears(cm.graph_module)}


@pytest.mark.parametrize(
    "recipe",
    [
        [qc.passes.GPTQ(ignore=("*.down_proj", r"re:layers\.0\.self_attn"))],
        [qc.passes.RTN(ignore=["*.down_proj", r"re:layers\.0\.self_attn"])],
        [qc.passes.SpQR(ignore=("*.down_proj", r"re:layers\.0\.self_attn"))],
        [
            qc.passes.SmoothQuant(ignore=("*.down_proj", r"re:layers\.0\.self_attn")),
            qc.passes.LowerInt8(ignore=("*.down_proj", r"re:layers\.0\.self_attn")),
        ],
    ],
)
def test_ignored_layers_stay_in_full_precision(recipe):
    model = make_model("llama")
    cm = qc.compile(model, example_inputs("llama"), recipe=recipe, calibration=_calib(), progress=False, device=None)
    kept = _fp_paths(cm)
    blocks = {p for p in (n for n, _ in model.named_modules()) if ".layers." in p and p.endswith("_proj")}
    want = {p for p in blocks if p.endswith("down_proj") or ".layers.0.self_attn." in p}
    assert want <= kept, f"not kept in full precision: {sorted(want - kept)}"
    assert not (blocks - want) & kept, f"quantized nothing else: {sorted((blocks - want) & kept)}"
    state = dict(model.named_parameters())
    for path in want:  # untouched: not quantized, not rescaled by smoothing
        assert torch.equal(get_tensor(cm.graph_module, f"{path}.weight"), state[f"{path}.weight"]), f"{path} changed"
    notes = " ".join(n for p in cm.report.passes for n in p.notes)
    assert "ignored (matches '*.down_proj')" in notes


def test_a_pattern_that_matches_nothing_is_reported():
    with pytest.warns(UserWarning, match="matched no layer"):
        cm = qc.compile(
            make_model("llama"), example_inputs("llama"), recipe=[qc.passes.RTN(ignore=("*.downproj",))], progress=False
        )
    assert any("'*.downproj' matched no layer" in n for n in cm.report.passes[0].notes)


def test_bad_patterns_are_refused_by_name():
    with pytest.raises(QuantizationError, match=r"'re:\(' is not a valid regular expression"):
        qc.passes.GPTQ(ignore=("re:(",))
    with pytest.raises(QuantizationError, match="not a non-empty string"):
        qc.passes.RTN(ignore=("",))


def test_recipe_files_and_artifacts_keep_the_ignore_list(tmp_path):
    recipe = recipe_from_dict({"passes": [{"pass": "RTN", "ignore": ["*.down_proj"]}]}, "test.yaml")
    assert recipe.passes[0].ignore == ("*.down_proj",)
    cm = qc.compile(make_model("llama"), example_inputs("llama"), recipe=recipe, progress=False)
    cm.save(tmp_path / "a")
    again = qc.load(tmp_path / "a")
    assert again.recipe.passes[0].ignore == ("*.down_proj",)
    assert {p for p in _fp_paths(again) if p.endswith("down_proj")}
