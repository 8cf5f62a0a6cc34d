"""Shared fixtures (helpers live in tiny_models.py, importable via pytest's pythonpath)."""
import os

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter; it must be chosen before they are
# imported (triton.jit decides at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:  # correctness with one fixed config per kernel (benchmarks/kernels.py checks the autotuned ones)
    os.environ.setdefault("QC_TRITON_AUTOTUNE", "0")


@pytest.fixture(scope="session")
def minilm():
    from qcompiler.models import load
    return load("minilm")


@pytest.fixture(scope="session")
def kernel_device():
    """Where the Triton kernels run in tests: the GPU when there is one, else the CPU interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
