"""The block-sequential calibration engine: exact statistics, padding excluded, sequential inputs."""

import pytest
import torch
from tiny_models import Stack, example_inputs, make_model

import qcompiler as qc
from qcompiler.calib.calibration import CalibrationEngine
from qcompiler.calib.layer_stats import LayerStats
from qcompiler.compiler import normalize_calibration
from qcompiler.ir.tensors import set_tensor


def reference_hessian(rows: torch.Tensor) -> torch.Tensor:
    rows = rows.double()
    return (2 * rows.T @ rows / rows.shape[0]).float()


def capture_inputs(module: torch.nn.Module, run) -> list[torch.Tensor]:
    seen = []
    handle = module.register_forward_hook(lambda m, args, out: seen.append(args[0].detach()))
    try:
        run()
    finally:
        handle.remove()
    return seen


def engine_for(model, example, batches):
    gm = qc.capture(model, example)
    return gm, CalibrationEngine(gm, normalize_calibration(batches, gm.meta["qcompiler"]))


@pytest.mark.parametrize("width", [512, 515, 1030])
def test_wide_hessians_accumulated_by_blocks_equal_the_float64_mean_and_are_symmetric(width):
    """Wide inputs accumulate only the upper blocks (uneven when the width is not a multiple of
    the block count), over batches of different sizes; reading gives the whole symmetric matrix,
    and the statistics take no rows after that."""
    gen = torch.Generator().manual_seed(width)
    batches = [torch.randn(n, width, generator=gen) * (1 + torch.rand(width, generator=gen)) for n in (7, 64, 1)]
    st = LayerStats(width)
    for x in batches:
        st.add(x)
    H = st.hessian
    assert torch.equal(H, H.T)
    assert torch.allclose(H, reference_hessian(torch.cat(batches)), rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="take no more rows"):
        st.add(batches[0])


@pytest.mark.parametrize("width", [96, 515])
def test_hessian_sums_do_not_depend_on_how_batches_are_split(width):
    """What makes a run over several ranks bit-identical to one process: each batch's product is
    added to a float64 sum, exactly, so sums over shards added later give the same bits as one sum
    over all batches (bf16 inputs, as streamed models give them, and float32)."""
    gen = torch.Generator().manual_seed(width)
    for dtype in (torch.bfloat16, torch.float32):
        batches = [(torch.randn(n, width, generator=gen) * 3).to(dtype) for n in (33, 64, 5, 128, 17)]
        whole = LayerStats(width)
        for x in batches:
            whole.add(x)
        shards = [LayerStats(width), LayerStats(width)]
        for k, x in enumerate(batches):
            shards[k >= 2].add(x)
        shards[0]._sum += shards[1]._sum  # what the ranks' all-reduce does
        shards[0].rows += shards[1].rows
        assert torch.equal(shards[0].hessian, whole.hessian)


@pytest.mark.parametrize("arch", ["llama", "bert", "gpt2"])  # no bias; linear biases; Conv1D (addmm)
def test_output_energy_of_each_linear_that_ran_equals_tr_w_h_wt(arch):
    """The report's error denominator comes from the collect's own FP outputs (padding excluded):
    it must equal the quadratic form tr(W H Wᵀ) it replaces. The collect's last linear does not run."""
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    batch["attention_mask"][1, 7:] = 0
    if arch == "llama":
        del batch["attention_mask"]
    gm, engine = engine_for(make_model(arch), example_inputs(arch), [batch, batch])
    seg = engine.segments[0]
    stats = engine.collect(seg, seg.linears)
    *ran, last = seg.linears
    assert stats[last.path].reference_energy(last.path) is None
    for layer in ran:
        W, H = layer.weight(gm).double(), stats[layer.path].hessian.double()
        expected = torch.trace(W @ H @ W.T).item()
        assert stats[layer.path].reference_energy(layer.path) == pytest.approx(expected, rel=1e-4), layer.path


def test_padding_rows_never_enter_statistics():
    model = make_model("bert")
    ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    mask[2, 3:] = 0
    gm, engine = engine_for(model, example_inputs("bert"), [{"input_ids": ids, "attention_mask": mask}])
    seg = engine.segments[0]
    query = next(l for l in seg.linears if l.path.endswith("self.query"))
    stats = engine.collect(seg, [query])[query.path]
    x = capture_inputs(model.encoder.layer[0].attention.self.query, lambda: model(input_ids=ids, attention_mask=mask))[
        0
    ]
    rows = x.reshape(-1, 64)[mask.reshape(-1).bool()]
    assert stats.rows == int(mask.sum())
    assert torch.allclose(stats.hessian, reference_hessian(rows), rtol=1e-4, atol=1e-5)
    assert torch.allclose(stats.absmax, rows.abs().amax(0))


def test_later_blocks_see_outputs_of_already_quantized_blocks():
    model = make_model("llama")
    batches = [
        {"input_ids": torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(s))} for s in range(2)
    ]
    gm, engine = engine_for(model, example_inputs("llama"), batches)
    seg0, seg1 = engine.segments
    assert (seg0.name, seg1.name) == ("model.layers.0", "model.layers.1")
    assert [len(g) for g in seg0.sibling_groups()] == [3, 1, 2, 1]
    engine.collect(seg0, seg0.linears)
    down0 = next(l for l in seg0.linears if l.path.endswith("down_proj"))
    halved = down0.weight(gm) * 0.5  # stands in for "block 0 was quantized"
    set_tensor(gm, down0.weight_node.target, halved)
    engine.advance(seg0)
    q1 = next(l for l in seg1.linears if l.path.endswith("q_proj"))
    stats = engine.collect(seg1, [q1])[q1.path]
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(0.5)
    rows = torch.cat(
        [
            x.reshape(-1, 64)
            for b in batches
            for x in capture_inputs(model.model.layers[1].self_attn.q_proj, lambda b=b: model(**b, use_cache=False))
        ]
    )
    assert torch.allclose(stats.hessian, reference_hessian(rows), rtol=1e-4, atol=1e-5)


def test_non_finite_activations_name_the_layer():
    model = Stack()
    x = torch.randn(2, 5, 32)
    x[0, 1, 3] = float("nan")
    with pytest.raises(qc.PassError, match=r"calibration activations reaching layers\.0\.(norm|fc1)|NaN"):
        qc.compile(model, (torch.randn(2, 5, 32),), recipe="gptq-w4g128", calibration=[(x,)], progress=False)


def test_empty_calibration_set_is_refused():
    with pytest.raises(qc.CalibrationError, match="calibration set is empty"):
        qc.compile(Stack(), (torch.randn(2, 5, 32),), recipe="gptq-w4g128", calibration=[], progress=False)
