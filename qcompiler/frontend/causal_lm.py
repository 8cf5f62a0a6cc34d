"""Causal LMs as users load them (``use_cache=True``): one graph with the KV cache as tensors.

The captured forward takes ``input_ids [B, S]``, ``attention_mask [B, P+S]``, ``position_ids [B, S]``
(when the model uses them) and ``past``: a flat tuple ``(k0, v0, k1, v1, ...)`` of ``[B, H, P, D]``
tensors, and returns ``(logits, present)`` with ``present`` the same tuple grown to ``P+S``.

Why one graph with a dynamic past length rather than a prefill graph, a decode graph and a static
cache: torch.export traces it cleanly (batch, sequence and past length all symbolic; checked for
P = 0, 1 and more, S = 1 and more, B = 1 and more), so the *same* graph — one set of quantized
weights, nothing duplicated — runs calibration and prefill (P = 0), decoding (S = 1) and chunked
prefill; it has exactly the past/present layout of onnxruntime-genai's models; and it needs no
in-place buffer mutation, which the safe artifact format does not store. What it costs: the cache
is concatenated per step (O(P) copy per token), which a static cache would avoid on a GPU.

torch.export's guard function assumes every symbolic size is >= 2 (its 0/1 specialization); the
graph itself does not depend on it, so the guard is dropped for these graphs.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from qcompiler.errors import CaptureError

__all__ = [
    "CacheLayout",
    "wants_cache",
    "cache_layout",
    "cache_forward",
    "graph_inputs",
    "wrap_output",
    "example_graph_inputs",
]


@dataclass(frozen=True)
class CacheLayout:
    """The shape of the KV cache: per layer, heads and head size of keys and values."""

    layers: int
    heads: tuple[int, ...]
    key_dims: tuple[int, ...]
    value_dims: tuple[int, ...]
    dtype: str
    max_length: int
    uses_position_ids: bool

    def to_dict(self) -> dict:
        """The layout as JSON-safe data (saved in the capture info)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CacheLayout":
        """The layout :meth:`to_dict` wrote."""
        return cls(
            int(data["layers"]),
            tuple(map(int, data["heads"])),
            tuple(map(int, data["key_dims"])),
            tuple(map(int, data["value_dims"])),
            str(data["dtype"]),
            int(data["max_length"]),
            bool(data["uses_position_ids"]),
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The cache tensors' dtype."""
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise CaptureError(f"unknown cache dtype {self.dtype!r}")
        return dtype

    def empty_past(self, batch: int, length: int = 0) -> tuple[torch.Tensor, ...]:
        """Zero cache tensors for ``batch`` rows and ``length`` past positions."""
        past = []
        for h, kd, vd in zip(self.heads, self.key_dims, self.value_dims):
            past += [
                torch.zeros(batch, h, length, kd, dtype=self.torch_dtype),
                torch.zeros(batch, h, length, vd, dtype=self.torch_dtype),
            ]
        return tuple(past)


def _cache_param(model) -> Optional[str]:
    params = inspect.signature(model.forward).parameters
    return next((p for p in ("cache", "past_key_values") if p in params), None)


def wants_cache(model: torch.nn.Module, kwargs: dict) -> bool:
    """A causal LM captured with its cache: when the example says ``use_cache=True``, or says nothing
    and the config asks for one (many fine-tuned checkpoints ship ``use_cache: false``, a training
    setting; pass ``use_cache=True`` to generate from them anyway)."""
    config = getattr(model, "config", None)
    explicit = kwargs.get("use_cache")
    if config is None or explicit is False or (explicit is None and not getattr(config, "use_cache", False)):
        return False
    can_generate = getattr(model, "can_generate", None)
    return (
        bool(callable(can_generate) and can_generate())
        and _cache_param(model) is not None
        and not getattr(config, "is_encoder_decoder", False)
    )


def _present(out) -> tuple[torch.Tensor, ...]:
    cache = getattr(out, "cache", None)
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise CaptureError(f"the model returned no KV cache layers (got {type(cache).__name__})")
    flat = []
    for layer in layers:
        flat += [layer.keys, layer.values]
    return tuple(flat)


@contextlib.contextmanager
def _experts_without_grouped_mm(model: torch.nn.Module):
    """transformers runs MoE experts eagerly through ``grouped_mm``, whose fake-tensor kernel
    accepts only bf16: a streamed (fake-weight) float32 MoE could not run the probe. Its
    ``batched_mm`` computes the same for the probe, which only reads the cache's shapes."""
    configs = [
        m.config
        for m in model.modules()
        if getattr(getattr(m, "config", None), "_experts_implementation", None) == "grouped_mm"
    ]
    for config in configs:
        config._experts_implementation = "batched_mm"
    try:
        yield
    finally:
        for config in configs:
            config._experts_implementation = "grouped_mm"


def cache_layout(model: torch.nn.Module) -> CacheLayout:
    """Read the cache shapes off one tiny forward pass of the real model."""
    ids = torch.zeros(1, 2, dtype=torch.long)
    with torch.no_grad(), _experts_without_grouped_mm(model):
        out = model(input_ids=ids, use_cache=True)
    present = _present(out)
    keys, values = present[0::2], present[1::2]
    if not keys or any(k.dim() != 4 for k in present):
        raise CaptureError(f"{type(model).__name__}'s cache is not a list of [batch, heads, length, dim] tensors")
    config = model.config
    return CacheLayout(
        len(keys),
        tuple(k.shape[1] for k in keys),
        tuple(k.shape[3] for k in keys),
        tuple(v.shape[3] for v in values),
        str(keys[0].dtype).removeprefix("torch."),
        int(getattr(config, "max_position_embeddings", 0) or getattr(config, "n_positions", 0) or 2048),
        "position_ids" in inspect.signature(model.forward).parameters,
    )


def cache_forward(model: torch.nn.Module, layout: CacheLayout):
    """A forward taking and returning the cache as tensors, for torch.export to trace."""
    from transformers import DynamicCache

    original = type(model).forward
    cache_name = _cache_param(model)

    def run(input_ids, attention_mask, position_ids, past):
        cache = DynamicCache(config=model.config)
        for i in range(layout.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        extra = {"position_ids": position_ids} if position_ids is not None else {}
        out = original(
            model, input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **{cache_name: cache}, **extra
        )
        return out.logits, _present(out)

    if layout.uses_position_ids:

        def forward(input_ids, attention_mask, position_ids, past):
            return run(input_ids, attention_mask, position_ids, past)
    else:

        def forward(input_ids, attention_mask, past):
            return run(input_ids, attention_mask, None, past)

    return forward


def positions_from_mask(mask: torch.Tensor, new: int) -> torch.Tensor:
    """Position ids of the last ``new`` tokens under a left-padded mask (transformers' convention)."""
    positions = mask.long().cumsum(-1) - 1
    return positions.masked_fill(mask == 0, 1)[:, -new:]


def check_mask_values(attention_mask: torch.Tensor) -> None:
    """A mask holds 0 (padding) and 1 (a token) only: a 2 or a 0.5 would count as a token (or as
    padding) without a word — for causal LMs and encoders alike."""
    odd = ((attention_mask != 0) & (attention_mask != 1)).nonzero()
    if len(odd):
        where = tuple(odd[0].tolist())
        raise ValueError(
            f"attention_mask holds {attention_mask[where].item():g} at {where}; it must be 0 (padding) or 1 (a token)"
        )


def graph_inputs(
    layout: CacheLayout,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    past=None,
) -> dict:
    """The graph's keyword inputs from what a user passes (missing mask: all ones; no past: empty)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a [batch, sequence] tensor of token ids, got {shape}")
    batch, new = input_ids.shape
    past = layout.empty_past(batch) if past is None else tuple(past)
    if len(past) != 2 * layout.layers:
        raise ValueError(
            f"past holds {len(past)} tensors; this model's cache has {2 * layout.layers} "
            f"({layout.layers} layers x key, value)"
        )
    length = max(t.shape[2] for t in past)  # sliding-window layers may hold fewer
    if attention_mask is None:
        attention_mask = torch.ones(batch, length + new, dtype=torch.long)
    if tuple(attention_mask.shape) != (batch, length + new):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}; with {length} cached and {new} "
            f"new tokens it must be ({batch}, {length + new})"
        )
    check_mask_values(attention_mask)
    attention_mask = attention_mask.long()
    empty = (~attention_mask.bool().any(-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"attention_mask masks every token of sequence {empty[0]}: each row needs at least one real token"
        )
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if layout.uses_position_ids:
        inputs["position_ids"] = positions_from_mask(attention_mask, new) if position_ids is None else position_ids
    inputs["past"] = past
    return inputs


def example_graph_inputs(
    layout: CacheLayout, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
) -> dict:
    """Inputs for tracing: sizes >= 2 everywhere so that export keeps them symbolic."""
    if input_ids.shape[0] < 2 or input_ids.shape[1] < 2:
        input_ids = torch.zeros(max(2, input_ids.shape[0]), max(2, input_ids.shape[1]), dtype=input_ids.dtype)
        attention_mask = None
    past = layout.empty_past(input_ids.shape[0], 2)
    if attention_mask is not None:
        attention_mask = torch.cat([torch.ones(input_ids.shape[0], 2, dtype=attention_mask.dtype), attention_mask], 1)
    return graph_inputs(layout, input_ids, attention_mask, past=past)


def dynamic_shapes(inputs: dict) -> dict:
    auto = torch.export.Dim.AUTO
    shapes = {k: {0: auto, 1: auto} for k in inputs if k != "past"}
    shapes["past"] = tuple({0: auto, 2: auto} for _ in inputs["past"])
    return shapes


def wrap_output(out):
    """``(logits, present)`` as transformers' output object: ``.logits`` and ``.past_key_values``."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    logits, present = out
    return CausalLMOutputWithPast(logits=logits, past_key_values=tuple(present))
