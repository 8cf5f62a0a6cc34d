"""What the tests that run our exports in other runtimes (GPTQModel, vLLM) share: the quantized
bundled LM, running a client script in the runtime's own venv, and judging its greedy tokens."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

import qcompiler as qc
from qcompiler.models import load


def quantized_tinylm():
    """The bundled LM and its gptq-w4g128 compile (8 x 128 calibration tokens)."""
    tinylm = load("tinylm")
    cm = qc.compile(tinylm.model, tinylm.example_inputs(), recipe="gptq-w4g128",
                    calibration=tinylm.calibration(8, 128), progress=False)
    return tinylm, cm


def run_client(python: str, script: str, folder: Path, *args: str, timeout: int) -> object:
    """Run ``script`` (written beside ``folder``: vLLM spawns processes that re-import it) with the
    runtime's ``python``; returns the JSON it printed after ``RESULT``."""
    path = folder.parent / "client.py"
    path.write_text(script)
    done = subprocess.run([python, str(path), str(folder), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=folder.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("RESULT", 1)[1].splitlines()[0])


def greedy_gaps(cm, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """For each token the runtime chose after ``prompt``: our fp32 model's top logit minus that
    token's logit, with the runtime's own tokens fed back (0 where it is our argmax)."""
    logits = cm(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    return logits.max(-1).values - logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
