"""The code of docs/writing-passes.md runs as written, and does what the guide says."""
import re
from pathlib import Path

import torch

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "writing-passes.md"


def test_guide_code_runs_and_its_pass_works(capsys):
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert len(blocks) == 4
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
