"""Shared fixtures (helpers live in tiny_models.py, importable via pytest's pythonpath)."""
import pytest


@pytest.fixture(scope="session")
def minilm():
    from qcompiler.models import load
    return load("minilm")
