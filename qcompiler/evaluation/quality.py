"""One judge per bundled model kind, shared by the main job, the CLI and the quality benchmark.

Causal LMs: perplexity on held-out standard-library modules (windows of 256 bytes).
Encoders: mean cosine between the model's sentence embeddings and the FP32 model's, over real
held-out sentences (docstrings of modules the calibration set never touches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from qcompiler.calib.calibration_data import sentence_lines
from qcompiler.data import stdlib_sentences
from qcompiler.evaluation.eval import embedding_fidelity, mean_pooled_embeddings, perplexity, window_count
from qcompiler.models import LoadedModel

__all__ = ["QualityJudge", "REPORTED_WINDOWS"]

REPORTED_WINDOWS = 256  # what the main job and `qcompiler eval` score by default: one figure for both


@dataclass
class QualityJudge:
    """Scores a model on held-out data the same way for every recipe (perplexity or embedding cosine)."""

    loaded: LoadedModel
    max_windows: int = 512  # held-out windows of 256 bytes for perplexity (131k tokens)
    sentences: int = 256  # held-out sentences for embedding fidelity
    text: Optional[list[str]] = None  # the user's documents instead of the bundled held-out text
    window: int = 256  # tokens per perplexity window (capped by the model's context)
    _reference: Optional[torch.Tensor] = field(default=None, repr=False)
    _tokens: Optional[torch.Tensor] = field(default=None, repr=False)
    _batch_size: Optional[int] = field(default=None, repr=False)

    def _scored_tokens(self) -> torch.Tensor:
        if self._tokens is None:
            if self.text is None:
                self._tokens = self.loaded.tokens("heldout")
            else:  # documents joined as calibration joins them: one stream of windows
                self._tokens = torch.cat([self.loaded.tokenize(t).reshape(-1) for t in self.text])
        return self._tokens

    @property
    def _window(self) -> int:
        return min(self.window, self.loaded.max_length)

    def _batch(self) -> int:
        """Windows per forward: at most 16, fewer where a large vocabulary's logits would pass
        ~256 MB (Gemma-3's 262k tokens: one window at a time)."""
        if self._batch_size is None:
            vocab = getattr(getattr(self.loaded.model, "config", None), "vocab_size", None) or 256
            self._batch_size = max(1, min(16, (1 << 26) // (self._window * vocab)))
        return self._batch_size

    def release_model(self) -> None:
        """Keep what scoring needs from the FP model (its reference embeddings, the batch size) and
        drop the model itself, so the quantized one is scored without both resident (``eval``)."""
        self._batch()
        if self.metric == "cosine" and self._reference is None:
            self._reference = self._embed(self.loaded.model)
        self.loaded.model = None

    def describe(self) -> str:
        """What the score is computed over, e.g. "64 windows of 256 tokens of the bundled held-out text"."""
        source = "the bundled held-out text" if self.text is None else f"{len(self.text)} documents given"
        if self.metric == "perplexity":
            windows = window_count(self._scored_tokens().numel(), self._window, self.max_windows)
            return f"{windows} windows of {self._window} tokens of {source}"
        count = self.sentences if self.text is None else len(self._sentences())
        return f"{count} sentences of {source}"

    def _sentences(self) -> list[str]:
        if self.text is None:
            return stdlib_sentences("heldout", self.sentences)
        return sentence_lines(self.text)[: self.sentences]  # read as calibration reads an encoder's text

    @property
    def metric(self) -> str:
        """The metric's name."""
        return "perplexity" if self.loaded.kind == "causal-lm" else "cosine"

    @property
    def higher_is_better(self) -> bool:
        """Whether a larger score is better (cosine) or worse (perplexity)."""
        return self.metric == "cosine"

    def _embed(self, model: Callable) -> torch.Tensor:
        return mean_pooled_embeddings(model, self.loaded.tokenizer, self._sentences())

    def score(self, model: Callable, progress: Optional[Callable[[int, int], None]] = None) -> float:
        """Perplexity (lower is better) or cosine vs FP32 (1.0 is lossless); ``progress(done, total)``
        is called after each batch of perplexity windows."""
        if self.metric == "perplexity":
            return perplexity(
                model,
                self._scored_tokens(),
                window=self._window,
                max_windows=self.max_windows,
                batch_size=self._batch(),
                progress=progress,
            )
        if self._reference is None:
            self._reference = self._embed(self.loaded.model)
        return embedding_fidelity(self._reference, self._embed(model))

    def loss(self, fp32: float, quantized: float) -> float:
        """Relative perplexity increase, or 1 − cosine: 0 means lossless, larger is worse."""
        return quantized / fp32 - 1.0 if self.metric == "perplexity" else fp32 - quantized
