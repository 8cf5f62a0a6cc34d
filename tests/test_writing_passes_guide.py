"""The code of docs/writing-passes.md runs as written, and does what the guide says."""

import re
from pathlib import Path
from types import SimpleNamespace

import torch

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "writing-passes.md"


def _run_guide(tmp_path, monkeypatch) -> dict:
    """The guide's files (```python file=NAME) written where Python imports them, then its code
    blocks run in order in one namespace."""
    text = GUIDE.read_text()
    files = dict(re.findall(r"```python file=(\S+)\n(.*?)```", text, flags=re.S))
    assert sorted(files) == ["my_kernel.py", "my_layout.py"]
    for name, code in files.items():
        (tmp_path / name).write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 6
    ns: dict = {}
    exec(compile("\n".join(blocks), str(GUIDE), "exec"), ns)
    return ns


def test_guide_code_runs_and_its_pass_works(capsys, tmp_path, monkeypatch):
    ns = _run_guide(tmp_path, monkeypatch)
    out = capsys.readouterr().out
    assert "model.layers.0.input_layernorm" in out
    assert "requires QUANTIZED_WEIGHTS" in out and "GPTQ" in out and "RTN" in out
    cm = ns["qc"].compile(ns["model"], ns["example"], recipe=[ns["ClipWeights"](k=2.5)], progress=False)
    record = cm.report.passes[0]
    assert record.name == "ClipWeights" and len(record.layers) == 14
    assert all(fig["clipped"] > 0 for fig in record.layers.values())
    # The user's pass really changed the model, and only within ±k std.
    w = cm.graph_module.get_parameter("model.layers.0.mlp.up_proj.weight")
    orig = ns["model"].model.layers[0].mlp.up_proj.weight
    assert w.abs().max() <= 2.5 * orig.std() + 1e-6 < orig.abs().max()
    assert isinstance(ns["logits"], torch.Tensor) and ns["logits"].shape == (3, 11, 96)
    # The guide's weight quantizer: on the first block (same inputs in both runs) its clipping
    # search is never worse than plain RTN on the same grid, and the report carries its choice.
    qc = ns["qc"]
    rtn = (
        qc.compile(
            ns["model"],
            ns["example"],
            recipe=[qc.passes.RTN(bits=3, group_size=32)],
            calibration=ns["calibration"],
            progress=False,
        )
        .report.passes[0]
        .layers
    )
    clipped = ns["cm"].report.passes[0].layers
    assert set(clipped) == set(rtn) and len(clipped) == 14
    first = [p for p in clipped if p.startswith("model.layers.0.")]
    assert all(clipped[p]["rel_error"] <= rtn[p]["rel_error"] * (1 + 1e-6) for p in first)
    assert any(clipped[p]["clip_ratio"] < 1.0 and clipped[p]["rel_error"] < rtn[p]["rel_error"] for p in first)


def test_guide_layout_is_one_file_and_runs_everywhere_a_layout_does(tmp_path, monkeypatch):
    """The guide's new layout (one layout file, one kernel file, one line per target): every
    backend and exporter the registries name has its line; eager stays within int8 rounding of the
    FP model and the Triton kernel within float32 summation order of eager; the stored bits are
    exactly 8 per weight + 16 per row; an artifact holding it reloads bit-identically; rows solved
    apart join into the whole layer's tensors bit for bit."""
    import qcompiler as qc
    from qcompiler.backends import available_backends, backend_target
    from qcompiler.export_formats import export_format, export_format_names
    from qcompiler.ir.model_size import model_size
    from qcompiler.ir.op_registry import args_of, implementation
    from qcompiler.ir.tensors import get_tensor
    from qcompiler.pipeline.solved import SolvedLayer, join_rows

    ns = _run_guide(tmp_path, monkeypatch)
    targets = {backend_target(b) for b in available_backends()}
    targets |= {export_format(f).load_target() for f in export_format_names()}
    assert all(implementation(t, "row_int8_linear") is not None for t in targets), targets
    cm, ids, model = ns["int8_rows"], ns["ids"], ns["model"]
    nodes = [n for n in cm.graph_module.graph.nodes if n.target is torch.ops.qc.row_int8_linear.default]
    assert len(nodes) == 14
    weights = [get_tensor(cm.graph_module, args_of(n).codes.target) for n in nodes]
    size = model_size(cm.graph_module)
    assert size.quantized_bits == sum(w.numel() * 8 + w.shape[0] * 16 for w in weights)
    fast = cm.with_backend("triton")
    assert all(v == {"kernel": "row_int8_gemm"} for v in fast.report.passes[-1].layers.values())
    assert len(fast.report.passes[-1].layers) == 14
    with torch.no_grad():
        want, got = model(input_ids=ids, use_cache=False).logits, cm(input_ids=ids).logits
        torch.testing.assert_close(fast(input_ids=ids).logits, got, rtol=1e-4, atol=1e-5)
    assert (got - want).norm() / want.norm() < 0.02  # int8 per row: far below the logits' own size
    cm.save(tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(qc.load(tmp_path / "saved")(input_ids=ids).logits, got)
    # two ranks' row ranges of one layer join into the whole layer's tensors, bit for bit
    W, quantizer, cuts = torch.randn(48, 64), ns["RowInt8"](), ((0, 16), (16, 48))
    whole = quantizer.quantize_layer(None, W, None)
    parts = [
        SolvedLayer({}, h.tensors, h.rewrite) for h in (quantizer.quantize_layer(None, W[a:b], None) for a, b in cuts)
    ]
    pieces = [SimpleNamespace(start=a, stop=b, rank=r) for r, (a, b) in enumerate(cuts)]
    joined = join_rows(SimpleNamespace(path="x", transposed=False), parts, pieces, 64, None)
    assert all(torch.equal(joined.tensors[k], whole.tensors[k]) for k in ("codes", "scales"))
