"""The client matrix on a real model (release tier): Gemma-3 270M quantized by qcompiler, exported
in each client's format and run by the client — transformers (fp32, bf16), vLLM CPU, GPTQModel,
onnxruntime-genai, llama.cpp — each cell within its margin, or failing with the client's known limit
(`benchmarks/real_clients.py --check`: the margins and limits are its ``MARGIN``, ``W8A8_MARGIN`` and
``EXPECTED``; docs/results.md "The client matrix on Gemma-3 270M" quotes a run). About 25 minutes on
2 cores: four GPTQ / SmoothQuant compiles, an ONNX export of ~90 s per recipe, vLLM and GPTQModel
start-ups. Needs the venvs `.ci/client-venvs` makes and llama-cpp-python (`.ci/llama-cpp-python`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.release

ROOT = Path(__file__).resolve().parent.parent


def test_every_client_runs_our_real_model_exports_within_its_margin(tmp_path):
    missing = [v for v in ("QC_VLLM_PYTHON", "QC_GPTQMODEL_PYTHON") if not os.environ.get(v)]
    if missing:
        pytest.skip(f"set {', '.join(missing)} (.ci/client-venvs builds the venvs)")
    done = subprocess.run(
        [sys.executable, "benchmarks/real_clients.py", "--check", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=5400,
    )
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    assert done.returncode == 0, "\n".join(failed) or done.stderr[-3000:]
