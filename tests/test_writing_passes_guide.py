"""The code of docs/writing-passes.md runs as written, and does what the guide says."""

import re
from pathlib import Path

import torch

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "writing-passes.md"


def test_guide_code_runs_and_its_pass_works(capsys):
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert len(blocks) == 5
    ns: dict = {}
    exec(compile("\n".join(blocks), str(GUIDE), "exec"), ns)
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
