"""``compile()``'s run settings are one ``CompileOptions`` (what the CLI's quantize and each rank
of a distributed run pass too): given as an object or as keywords, the same model; both, an
unknown keyword, or resume without a checkpoint folder are one-line errors before any work."""

import pytest
import torch
from tiny_models import example_inputs, make_model

import qcompiler as qc


def test_an_options_object_and_keywords_compile_the_same_model():
    model, x = make_model("llama"), example_inputs("llama")
    by_keywords = qc.compile(model, x, recipe="rtn-w4g128", device="cpu", progress=False)
    by_object = qc.compile(model, x, recipe="rtn-w4g128", options=qc.CompileOptions(device="cpu", progress=False))
    with torch.no_grad():
        assert torch.equal(by_keywords(**x).logits, by_object(**x).logits)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        (dict(options=qc.CompileOptions(), progress=False), TypeError, "not both"),
        (dict(progres=False), TypeError, "unknown keyword(s) ['progres']; its options are ['backend_options'"),
        (dict(resume=True), ValueError, "resume=True continues the run recorded in checkpoint=DIR"),
    ],
)
def test_wrong_options_are_one_line_before_any_work(kwargs, error, words):
    with pytest.raises(error) as info:
        qc.compile(make_model("llama"), example_inputs("llama"), recipe="rtn-w4g128", **kwargs)
    assert words in str(info.value) and "\n" not in str(info.value)
