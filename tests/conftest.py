"""Shared fixtures (helpers live in tiny_models.py, importable via pytest's pythonpath)."""

import os

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter; it must be chosen before they are
# imported (triton.jit decides at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:  # correctness with one fixed config per kernel (benchmarks/kernel_speed.py checks the autotuned ones)
    os.environ.setdefault("QC_TRITON_AUTOTUNE", "0")

# pytest-xdist runs one worker per core (pyproject addopts): each gets its share of the cores,
# so workers do not oversubscribe them with torch's intra-op threads.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# One torch.export per architecture and example shape per worker (tests/capture_memo.py).
import capture_memo  # noqa: E402  (after TRITON_INTERPRET: it imports qcompiler)

capture_memo.install()


@pytest.fixture(scope="session")
def minilm():
    from qcompiler.models import load

    return load("minilm")


@pytest.fixture(scope="session")
def kernel_device():
    """Where the Triton kernels run in tests: the GPU when there is one, else the CPU interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# The longest files first (measured), whole files so module fixtures are built once per worker:
# xdist's work stealing then balances the short tests at the end instead of one worker waiting
# on a 30 s test the other started last.
LONGEST_FILES = (
    "test_client_conformance.py",  # slow run: ~5 min, one test (the cover)
    "test_distributed.py",  # 20 s of three processes in one test: started last it was the tail
    "test_cli.py",
    "test_docs_examples.py",  # the README's Python: 11 s in one test
    "test_llama_cpp_runs_our_gguf.py",
    "test_onnx_backend.py",
    "test_causal_lm.py",
    "test_moe_experts.py",
    "test_streaming.py",
    "test_artifacts_and_interop.py",
    "test_bundled_models.py",
    "test_gguf_grids.py",
    "test_rotate.py",
    "test_onnx_genai.py",
    "test_onnx_embeddings.py",
)


def _file_rank(item) -> int:
    name = item.path.name
    return LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)


def pytest_collection_modifyitems(config, items):
    """Tiers are marked on the tests themselves (``@pytest.mark.slow``, ``pytest.param(..., marks=...)``):
    a variant that repeats a property a sibling asserts in the default run is ``slow`` (CI's second
    tier), a repeat only a release needs is ``release``. Here the items are only ordered."""
    items.sort(key=_file_rank)  # stable: the order within a file is kept
