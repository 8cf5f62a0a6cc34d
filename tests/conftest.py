"""Shared fixtures (helpers live in tiny_models.py, importable via pytest's pythonpath)."""
import os

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter; it must be chosen before they are
# imported (triton.jit decides at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def minilm():
    from qcompiler.models import load
    return load("minilm")


@pytest.fixture(scope="session")
def kernel_device():
    """Where the Triton kernels run in tests: the GPU when there is one, else the CPU interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
