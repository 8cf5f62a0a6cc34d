"""Text generation with the KV cache: one prefill call, then one graph call per new token.

Works with any runner that calls the cache graph (eager, triton, onnxruntime): ``step(inputs)``
takes the graph's keyword inputs and returns ``(logits, present)``. Batches of prompts are
left-padded (``attention_mask`` zeros on the left), as transformers does for decoder-only models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence, Union

import torch

from qcompiler.frontend.causal_lm import CacheLayout, graph_inputs, positions_from_mask

if TYPE_CHECKING:
    from qcompiler.frontend.static_cache import StaticCache

__all__ = ["SamplingConfig", "generate_tokens", "sample_next", "timed_generation"]


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen: greedy, or sampled with temperature / top-k / top-p (checked here)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut

    def __post_init__(self):
        if self.temperature <= 0 or self.temperature != self.temperature:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample_next(logits: torch.Tensor, config: SamplingConfig, generator: Optional[torch.Generator]) -> torch.Tensor:
    """The next token per row from last-position logits ``[B, V]``: argmax, or a sample after
    temperature, top-k and top-p (the smallest set of tokens whose probability reaches top_p)."""
    if not config.do_sample:
        return logits.argmax(-1)
    scores = logits.float() / config.temperature
    if config.top_k:
        kth = torch.topk(scores, min(config.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if config.top_p < 1:
        ordered, order = scores.sort(-1, descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative - ordered.softmax(-1) >= config.top_p  # keep the token that crosses top_p
        scores = scores.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return torch.multinomial(scores.softmax(-1), 1, generator=generator).squeeze(-1)


def _eos_set(eos_token_id: Union[None, int, Sequence[int]]) -> Optional[torch.Tensor]:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def generate_tokens(
    step: Callable[[dict], tuple],
    layout: CacheLayout,
    vocab_size: Optional[int],
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    attention_mask: Optional[torch.Tensor] = None,
    sampling: SamplingConfig = SamplingConfig(),
    eos_token_id=None,
    pad_token_id: Optional[int] = None,
    seed: Optional[int] = None,
    static_cache: Optional[Callable[[int, int], "StaticCache"]] = None,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row ``[B]`` per step; a finished row (EOS) yields ``pad_token_id``.

    ``static_cache(batch, slots)``, when given, makes the :class:`StaticCache` the decode steps run
    on (fixed shapes; a CUDA graph on a GPU) instead of feeding ``present`` back to ``step``; it may
    answer None (the dynamic cache, e.g. past a sliding window)."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"the prompt is empty or not a [batch, tokens] tensor (got {shape}); give at least one token")
    total = input_ids.shape[1] + max_new_tokens
    if total > layout.max_length:
        raise ValueError(
            f"prompt of {input_ids.shape[1]} tokens + max_new_tokens={max_new_tokens} = {total} exceeds "
            f"the model's context of {layout.max_length} positions"
        )
    eos = _eos_set(eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (int(eos[0]) if eos is not None else 0)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    inputs = graph_inputs(layout, input_ids, attention_mask)
    mask = inputs["attention_mask"]
    right = (mask[:, -1] == 0).nonzero().flatten().tolist()
    if right:  # its new tokens would follow padding: transformers warns, the output is silently wrong
        raise ValueError(
            f"prompt {right[0]} is right-padded (its last position is padding); generate needs prompts "
            "padded on the left (attention_mask zeros first)"
        )
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool)
    static = static_cache(input_ids.shape[0], total) if static_cache is not None and max_new_tokens else None
    token = input_ids[:, -1]  # the decode steps' input: each step's sampled token
    for i in range(max_new_tokens):
        if static is None:
            logits, present = step(inputs)
        else:
            logits = static.prefill(inputs) if i == 0 else static.decode(token, mask)
        token = sample_next(logits[:, -1, :vocab_size].cpu(), sampling, generator)
        token = token.masked_fill(finished, pad)
        yield token
        if eos is not None:
            finished |= torch.isin(token, eos)
            if bool(finished.all()):
                return
        mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype)], 1)
        if static is None:
            inputs = graph_inputs(layout, token[:, None], *_window(layout, mask, present), past=present)


def _window(layout: CacheLayout, mask: torch.Tensor, present) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(attention_mask, position_ids)`` of the next step. A sliding-window cache stops growing
    (it keeps the last ``window - 1`` positions): the mask covers what it holds plus the new token,
    and the positions still count every token so far (RoPE needs the absolute position)."""
    held = max(t.shape[2] for t in present) + 1  # Gemma-2: full-attention layers keep growing
    if held >= mask.shape[1]:
        if min(t.shape[2] for t in present) + 1 < held and not bool(mask.all()):
            raise ValueError(  # measured: Gemma-2's tokens then differ from transformers' own generate
                "a padded batch past the sliding window of a model mixing sliding and full attention "
                "(Gemma-2) is not supported; generate rows one at a time or within the window"
            )
        return mask, None
    if not layout.uses_position_ids:
        raise ValueError(
            f"the cache kept {held - 1} of {mask.shape[1] - 1} positions (a sliding window) and this graph "
            "takes no position ids to place the next token; generate at most the window"
        )
    return mask[:, -held:], positions_from_mask(mask, 1)


def timed_generation(cm, input_ids: torch.Tensor, max_new_tokens: int, **kwargs) -> dict:
    """Generate and time it: the prefill (prompt -> first token) apart from the decode steps."""
    import time

    tokens, stamps = [], [time.perf_counter()]
    for token in cm.stream(input_ids, max_new_tokens, **kwargs):
        tokens.append(token)
        stamps.append(time.perf_counter())
    decode_steps = len(tokens) - 1
    decode_seconds = stamps[-1] - stamps[1] if decode_steps > 0 else 0.0
    return {
        "tokens": torch.stack(tokens, 1) if tokens else input_ids[:, :0],
        "prefill_seconds": stamps[1] - stamps[0] if tokens else 0.0,
        "decode_tokens_per_second": decode_steps * input_ids.shape[0] / decode_seconds if decode_seconds else None,
    }
