"""Quality metrics: perplexity, embedding fidelity, per-layer output error.

Every metric takes a plain callable model (the original ``nn.Module`` or a compiled one) so the
same code scores FP32 and every backend.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from qcompiler.ir.model_size import model_size

__all__ = ["perplexity", "mean_pooled_embeddings", "embedding_fidelity", "relative_output_error"]


def _logits(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)):
        return output[0]
    raise TypeError(f"cannot find logits in model output of type {type(output).__name__}")


def window_count(tokens: int, window: int, max_windows: int | None = None, stride: int | None = None) -> int:
    """How many windows :func:`perplexity` scores in ``tokens`` tokens (so a figure can say it)."""
    count = len(range(0, tokens - window, window if stride is None else stride))
    return count if max_windows is None else min(count, max_windows)


@torch.no_grad()
def perplexity(
    model: Callable,
    tokens: torch.Tensor,
    *,
    window: int = 256,
    stride: int | None = None,
    batch_size: int = 16,
    max_windows: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> float:
    """exp(mean next-token NLL) over ``tokens`` read in windows of ``window`` with ``stride``.

    Each token is scored once: a window after the first scores only its last ``stride`` targets,
    using the overlap as context (the usual sliding-window evaluation). ``stride == window``
    means disjoint windows.
    """
    tokens = tokens.reshape(-1)
    stride = window if stride is None else stride
    if not 0 < stride <= window:
        raise ValueError(f"stride must be in (0, window={window}], got {stride}")
    if tokens.numel() < window + 1:
        raise ValueError(f"need more than {window} tokens to score a window, got {tokens.numel()}")
    starts = list(range(0, tokens.numel() - window, stride))
    if max_windows is not None:  # (window_count says this number without scoring)
        starts = starts[:max_windows]
    nll, count = 0.0, 0
    for b in range(0, len(starts), batch_size):
        batch_starts = starts[b : b + batch_size]
        x = torch.stack([tokens[s : s + window] for s in batch_starts])
        y = torch.stack([tokens[s + 1 : s + window + 1] for s in batch_starts])
        logp = F.log_softmax(_logits(model(input_ids=x)).float(), dim=-1)
        token_nll = -logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        for row, s in enumerate(batch_starts):
            first = 0 if s == 0 else window - stride  # targets already scored by the previous window
            nll += token_nll[row, first:].sum().item()
            count += window - first
        if progress is not None:
            progress(b + len(batch_starts), len(starts))
    return math.exp(nll / count)


@torch.no_grad()
def mean_pooled_embeddings(
    model: Callable, tokenizer, sentences: Sequence[str], *, batch_size: int = 32, max_length: int = 128
) -> torch.Tensor:
    """Sentence embeddings as sentence-transformers makes them: mask-aware mean of the last hidden state."""
    if len(sentences) == 0:
        raise ValueError("embedding fidelity needs at least one sentence, got an empty list")
    out = []
    for b in range(0, len(sentences), batch_size):
        enc = tokenizer(
            list(sentences[b : b + batch_size]),
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        result = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
        hidden = result.last_hidden_state if hasattr(result, "last_hidden_state") else _logits(result)
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        out.append((hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0))
    return torch.cat(out)


def embedding_fidelity(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """Mean cosine similarity between matching rows: 1.0 means the embeddings are unchanged."""
    if reference.shape != candidate.shape:
        raise ValueError(f"embedding shapes differ: {tuple(reference.shape)} vs {tuple(candidate.shape)}")
    return F.cosine_similarity(reference.double(), candidate.double(), dim=-1).mean().item()


def relative_output_error(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """‖WX − ŴX‖ / ‖WX‖ (Frobenius): how much a layer's output moved."""
    ref = reference.double()
    denom = ref.norm().item()
    diff = (ref - candidate.double()).norm().item()
    return diff / denom if denom > 0 else diff


def bits_per_parameter(gm) -> float:
    """Average stored bits per weight over the quantized linears, counted from the stored tensors.

    ``qc.quant_linear``: codes, zero points and scales (the GPTQ and SpQR papers' convention:
    4-bit g128 is 4 + (16 + 4)/128 = 4.156); ``g_idx`` and SpQR's ``perm`` are per input column,
    not per weight, and are excluded. ``qc.int8_linear``: int8 codes and per-channel scales.
    SpQR: dense codes, first- and second-level statistics, and the CSR outliers with row pointers.
    """
    size = model_size(gm)
    if size.bits_per_quantized_weight is None:
        raise ValueError("the graph has no quantized linear layers")
    return size.bits_per_quantized_weight
