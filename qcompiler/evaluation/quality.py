"""One judge per bundled model kind, shared by the main job, the CLI and the quality benchmark.

Causal LMs: perplexity on held-out standard-library modules (windows of 256 bytes).
Encoders: mean cosine between the model's sentence embeddings and the FP32 model's, over real
held-out sentences (docstrings of modules the calibration set never touches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from qcompiler.data import stdlib_sentences
from qcompiler.evaluation.eval import embedding_fidelity, mean_pooled_embeddings, perplexity
from qcompiler.models import LoadedModel

__all__ = ["QualityJudge"]


@dataclass
class QualityJudge:
    """Scores a model on held-out data the same way for every recipe (perplexity or embedding cosine)."""

    loaded: LoadedModel
    max_windows: int = 512  # held-out windows of 256 bytes for perplexity (131k tokens)
    sentences: int = 256  # held-out sentences for embedding fidelity
    _reference: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def metric(self) -> str:
        """The metric's name."""
        return "perplexity" if self.loaded.kind == "causal-lm" else "cosine"

    @property
    def higher_is_better(self) -> bool:
        """Whether a larger score is better (cosine) or worse (perplexity)."""
        return self.metric == "cosine"

    def _embed(self, model: Callable) -> torch.Tensor:
        return mean_pooled_embeddings(model, self.loaded.tokenizer, stdlib_sentences("heldout", self.sentences))

    def score(self, model: Callable) -> float:
        """Perplexity (lower is better) or cosine vs FP32 (1.0 is lossless)."""
        if self.metric == "perplexity":
            return perplexity(
                model,
                self.loaded.tokens("heldout"),
                window=min(256, self.loaded.max_length),
                max_windows=self.max_windows,
            )
        if self._reference is None:
            self._reference = self._embed(self.loaded.model)
        return embedding_fidelity(self._reference, self._embed(model))

    def loss(self, fp32: float, quantized: float) -> float:
        """Relative perplexity increase, or 1 − cosine: 0 means lossless, larger is worse."""
        return quantized / fp32 - 1.0 if self.metric == "perplexity" else fp32 - quantized
