"""The embedding table inside ``auto:B``'s budget (``AutoBits(embeddings=...)``, passes/auto_embeddings.py):
each setting measured by the output distance with the table rounded (the unit of the linears'
measure), one budget over the linears and the table met as the stored tensors count it, and the
chosen setting applied by ``QuantizeEmbeddings`` before the linears are solved."""

from __future__ import annotations

import pytest
import torch
from causal_lms import calibration, prompt
from test_quantized_embeddings import _llama

import qcompiler as qc
from qcompiler.compiler import normalize_calibration
from qcompiler.errors import QuantizationError
from qcompiler.ir.model_size import model_size
from qcompiler.ir.op_registry import spec_of
from qcompiler.passes.auto_embeddings import KEEP, measure_tables
from qcompiler.pipeline.pass_base import PassContext
from qcompiler.pipeline.sensitivity import output_distance

SMALL = ("gptq-w2g32", "gptq-w3g32", "gptq-w4g32", "gptq-w8g32")
TABLE = ("w8g32", "w4g32", "w2g32")


def test_a_tables_setting_is_measured_as_the_output_distance_with_the_table_rounded():
    """A setting's distance is the mean KL of the graph with the table (and the tied head reading it)
    rounded to nearest at that setting — what QuantizeEmbeddings(method="rtn", grid="minmax") alone
    gives —, its bits
    what that pass stores; "keep" is the stored float32 table at zero distance."""
    model = _llama(tied=True, vocab=512)
    ids = prompt(2, 12, seed=3) % 512
    fp = qc.compile(model, {"input_ids": ids}, recipe="none", progress=False)
    ctx = PassContext(fp.example_inputs, calibration=normalize_calibration([{"input_ids": ids}], fp.capture_info))
    (item,) = measure_tables(fp.graph_module, ctx, ("w4g32",), samples=2, kl=True)
    keep, w4 = item.options
    assert item.path == "model.embed_tokens" and item.weights == 512 * 64
    assert (keep.setting, keep.bits, keep.distance) == (KEEP, 512 * 64 * 32, 0.0)
    rtn = [qc.passes.QuantizeEmbeddings(bits=4, group_size=32, method="rtn", grid="minmax")]
    rounded = qc.compile(model, {"input_ids": ids}, recipe=rtn, progress=False)
    with torch.no_grad():
        want = output_distance(fp(input_ids=ids).logits, rounded(input_ids=ids).logits, None, True)
    assert w4.distance == pytest.approx(want, rel=2e-3)  # the quantized ops sum in their own order
    stored = rounded.report.passes[0].layers["model.embed_tokens"]["bits_per_weight"] * item.weights
    assert w4.bits == pytest.approx(stored)


@pytest.mark.parametrize("budget", [3.5, pytest.param(6.0, marks=pytest.mark.slow)])
def test_one_budget_over_the_linears_and_the_table_is_met_and_the_choice_applied(budget):
    """The plan's bits over the linears and the table together are within 0.05 below the budget; the
    table is stored at the chosen setting (a float32 table is 32 bits: a tight budget cannot keep
    it), the report names its choice, and the graph's properties say the embeddings are quantized."""
    model = _llama(tied=True, vocab=512)
    ids = prompt(2, 12, seed=3) % 512
    recipe = [qc.passes.AutoBits(budget=budget, candidates=SMALL, samples=4, embeddings=TABLE)]
    cm = qc.compile(model, {"input_ids": ids}, recipe=recipe, calibration=calibration(), progress=False)
    size = model_size(cm.graph_module)
    assert budget - 0.05 <= size.bits_per_quantized_weight <= budget, size
    assert size.quantized_parameters == 512 * 64 + sum(
        m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n
    )
    layers = cm.report.passes[0].layers
    assert layers["model.embed_tokens"]["candidate"] in {f"embeddings {s}" for s in TABLE}
    assert [spec_of(n).name for n in cm.graph_module.graph.nodes if spec_of(n) is not None].count(
        "quant_embedding"
    ) == 1
    assert "quantized_embeddings" in cm.graph_module.meta["qcompiler_properties"]


def test_a_malformed_table_setting_is_named():
    with pytest.raises(QuantizationError, match="auto: embeddings setting 'w4' is not wBITSgGROUP"):
        qc.passes.AutoBits(budget=4.0, embeddings=("w4",))
    with pytest.raises(QuantizationError, match="bits=5 is not supported"):
        qc.passes.AutoBits(budget=4.0, embeddings=("w5g32",))
