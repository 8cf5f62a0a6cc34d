"""The pass manager validates before running, lints after each pass, and blames the right pass."""

import re
from dataclasses import dataclass

import pytest
import torch
from tiny_models import example_inputs, make_model

import qcompiler as qc


@dataclass(frozen=True)
class Needs(qc.Pass):
    requires = frozenset({qc.GraphProperty.SMOOTHED})

    def run(self, gm, ctx):
        raise AssertionError("must not run: validation happens first")


@dataclass(frozen=True)
class Breaks(qc.Pass):
    """Leaves a node that reads an attribute that does not exist."""

    def run(self, gm, ctx):
        node = next(n for n in gm.graph.nodes if n.op == "get_attr")
        node.target = "no.such.weight"
        return True


@dataclass(frozen=True)
class Fails(qc.Pass):
    def run(self, gm, ctx):
        raise RuntimeError("boom at value 42")


@dataclass(frozen=True)
class Noop(qc.Pass):
    def run(self, gm, ctx):
        return False


@pytest.fixture(scope="module")
def llama():
    return make_model("llama")


def test_unmet_requirement_names_pass_and_provider(llama):
    with pytest.raises(qc.PipelineError) as info:
        qc.compile(llama, example_inputs("llama"), recipe=[Noop(), Needs()], progress=False)
    found = re.fullmatch(
        r"pass #2 Needs requires SMOOTHED, which no earlier pass in the pipeline provides; add (.+) before it",
        str(info.value),
    )
    assert found, str(info.value)
    # the providers come from the pass registry (a test's own pass providing SMOOTHED may join them)
    assert {"AWQ", "SmoothQuant"} <= set(found.group(1).split(" or "))


def test_missing_calibration_is_reported_before_running(llama):
    with pytest.raises(qc.PipelineError, match="GPTQ needs calibration data"):
        qc.compile(llama, example_inputs("llama"), recipe="gptq-w4g128", progress=False)


def test_invalid_graph_names_the_pass(llama):
    with pytest.raises(
        qc.GraphLintError,
        match=r"pass Breaks left an invalid graph: Node model_embed_tokens_weight target no.such.weight",
    ):
        qc.compile(llama, example_inputs("llama"), recipe=[Breaks()], progress=False)


def test_failing_pass_names_itself_and_earlier_passes(llama):
    with pytest.raises(qc.PassError, match=r"#2 Fails failed \(passes run before it: Noop\).*boom at value 42"):
        qc.compile(llama, example_inputs("llama"), recipe=[Noop(), Fails()], progress=False)


def test_report_records_each_pass_in_order(llama):
    cm = qc.compile(
        llama, example_inputs("llama"), recipe=[Noop(), qc.passes.RTN(bits=4, group_size=32)], progress=False
    )
    assert [p.name for p in cm.report.passes] == ["Noop", "RTN"]
    assert not cm.report.passes[0].modified and cm.report.passes[1].modified
    assert all(p.seconds >= 0 for p in cm.report.passes)
    assert len(cm.report.passes[1].layers) == 14
    assert "RTN" in str(cm.report) and "model.layers.1.mlp.down_proj" in str(cm.report)


def test_unknown_recipe_and_backend(llama):
    with pytest.raises(qc.RecipeError, match="unknown recipe 'gptq-w4g12'; did you mean 'gptq-w4g128'"):
        qc.compile(llama, example_inputs("llama"), recipe="gptq-w4g12", progress=False)
    with pytest.raises(qc.BackendError, match="unknown backend .tpu.; available: eager, onnxruntime"):
        qc.compile(llama, example_inputs("llama"), backend="tpu", progress=False)
    with pytest.raises(qc.PipelineError, match="not a qc.Pass"):
        qc.compile(llama, example_inputs("llama"), recipe=["gptq"], progress=False)


def test_capture_errors_explain_the_problem():
    class DataDependent(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    with pytest.raises(qc.CaptureError, match=r"DataDependent.*Hint: the module branches on"):
        qc.capture(DataDependent(), (torch.randn(2, 3),))
    lin = torch.nn.Linear(4, 3)
    with pytest.raises(qc.CaptureError, match=r"wrong feature size"):
        qc.capture(lin, (torch.randn(2, 5),))
    with pytest.raises(qc.CaptureError, match=r"do not match Linear.forward"):
        qc.capture(lin, {"y": torch.randn(2, 4)})
    with pytest.raises(qc.CaptureError, match=r"needs a torch.nn.Module"):
        qc.capture(lambda x: x, (torch.randn(2),))


def test_every_built_in_pass_declares_its_contract():
    """Each pass provides at least one graph property the manager can check orders against: a
    weight quantizer inherits QUANTIZED_WEIGHTS from ``WeightQuantizer`` (it may add more), every
    other pass says itself what it provides (never the empty default of ``Pass``)."""
    built_in = [getattr(qc.passes, name) for name in qc.passes.__all__]
    assert len(built_in) == 15
    for cls in built_in:
        assert issubclass(cls, qc.Pass)
        if issubclass(cls, qc.WeightQuantizer):
            assert qc.GraphProperty.QUANTIZED_WEIGHTS in cls.provides, cls.__name__
        else:
            assert "provides" in vars(cls), cls.__name__
        assert cls.provides and all(isinstance(p, qc.GraphProperty) for p in cls.provides | cls.requires)
