"""What the tests that run our exports in other runtimes (GPTQModel, vLLM, onnxruntime-genai) share:
the quantized bundled LM, running a client script in the runtime's own venv, greedy decoding in
onnxruntime-genai, and judging a client's greedy tokens."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

import qcompiler as qc
from qcompiler.models import load


def quantized_tinylm(recipe="gptq-w4g128", *, tied: bool = False):
    """The bundled LM and its compile with ``recipe`` (8 x 128 calibration tokens); ``tied``: its
    head replaced by its embedding table (what small LLaMA-3.2 / Qwen2.5 checkpoints do)."""
    tinylm = load("tinylm")
    if tied:
        tinylm.model.config.tie_word_embeddings = True
        tinylm.model.lm_head.weight = tinylm.model.get_input_embeddings().weight
    cm = qc.compile(
        tinylm.model,
        tinylm.example_inputs(),
        recipe=recipe,
        calibration=tinylm.calibration(8, 128),
        progress=False,
    )
    return tinylm, cm


def genai_tokens(folder, prompt: list[int], new: int) -> list[int]:
    """Greedy tokens onnxruntime-genai generates from the exported ``folder`` after ``prompt``."""
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    out = []
    while not generator.is_done() and len(out) < new:
        generator.generate_next_token()
        out.append(int(generator.get_next_tokens()[0]))
    return out


def run_client(python: str, script: str, folder: Path, *args: str, timeout: int) -> object:
    """Run ``script`` (written beside ``folder``: vLLM spawns processes that re-import it) with the
    runtime's ``python``; returns the JSON it printed after ``RESULT``."""
    path = folder.parent / "client.py"
    path.write_text(script)
    done = subprocess.run(
        [python, str(path), str(folder), *args], capture_output=True, text=True, timeout=timeout, cwd=folder.parent
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("RESULT", 1)[1].splitlines()[0])


def greedy_gaps(cm, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """For each token the runtime chose after ``prompt``: our fp32 model's top logit minus that
    token's logit, with the runtime's own tokens fed back (0 where it is our argmax)."""
    logits = cm(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return logits.max(-1).values - logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
