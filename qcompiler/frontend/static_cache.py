"""Decoding over a preallocated KV cache, so that every decode step has the same shapes — and on a
GPU is captured once as a CUDA graph and replayed, instead of launching ~10 kernels per layer from
Python for each token.

The cache graph itself is unchanged (it concatenates ``past`` and the new keys/values): it is fed
``past`` tensors of a fixed ``slots`` positions, of which the first ``filled`` hold the tokens so
far and the rest are masked out (``attention_mask`` 0), and the new token's keys and values — the
last position of ``present`` — are copied into slot ``filled`` (``index_copy_`` with the slot as a
device tensor, so the copy is part of the captured graph). Masked slots get exactly zero attention
weight, so the step computes what the growing cache computes (up to the order of float sums over
a longer row). Positions are counted from the mask as before (left-padded batches work).
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from qcompiler.frontend.causal_lm import CacheLayout, positions_from_mask

__all__ = ["StaticCache"]


class StaticCache:
    """``prefill(inputs)`` once, then ``decode(token, mask)`` per new token; both return the logits.

    ``run(**inputs)`` calls the cache graph on ``device`` tensors and returns ``(logits, present)``.
    ``cuda_graph``: capture the decode step on the second call (the first one runs eagerly: Triton
    autotunes and allocates there) and replay it after; a step that cannot be captured (an op that
    reads a value back to the host, e.g. the experts' routing) warns once and runs eagerly.
    """

    def __init__(
        self, run: Callable, layout: CacheLayout, batch: int, slots: int, device: torch.device, cuda_graph: bool
    ):
        self.run, self.layout, self.slots, self.device = run, layout, slots, device
        self.past = tuple(t.to(device) for t in layout.empty_past(batch, slots))
        self.input_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.attention_mask = torch.zeros(batch, slots + 1, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.filled = 0
        self.cuda_graph = cuda_graph and device.type == "cuda"
        self.graph = None
        self.logits = None
        self.steps = 0

    def prefill(self, inputs: dict) -> torch.Tensor:
        """The prompt through the graph (its own shapes); its keys and values fill the first slots."""
        with torch.no_grad():
            return self._prefill(inputs)

    def _prefill(self, inputs: dict) -> torch.Tensor:
        on_device = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        on_device["past"] = tuple(t.to(self.device) for t in inputs["past"])
        logits, present = self.run(**on_device)
        length = present[0].shape[2]
        if any(t.shape[2] != length for t in present) or length > self.slots:
            raise ValueError(
                f"the prompt's cache ({[t.shape[2] for t in present]} positions per layer) does not fit "
                f"{self.slots} static slots (a sliding-window layer keeps fewer): use the dynamic cache"
            )
        for buffer, value in zip(self.past, present):
            buffer[:, :, :length].copy_(value)
        self.filled = length
        return logits

    def decode(self, token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits of ``token`` ``[B]`` given the mask of everything so far ``[B, filled + 1]`` (host)."""
        if self.filled >= self.slots:
            raise ValueError(f"the static cache holds {self.slots} positions; all are used")
        static_mask = torch.zeros(mask.shape[0], self.slots + 1, dtype=torch.long)
        static_mask[:, : self.filled] = mask[:, :-1]
        static_mask[:, -1] = mask[:, -1]
        self.input_ids.copy_(token.reshape(-1, 1))
        self.attention_mask.copy_(static_mask)
        self.position_ids.copy_(positions_from_mask(mask, 1))
        self.slot.fill_(self.filled)
        with torch.no_grad():
            self._dispatch()
        self.filled += 1
        self.steps += 1
        return self.logits

    def _dispatch(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        elif self.cuda_graph and self.steps == 1:
            self._capture()
        elif self.cuda_graph:  # the warm-up step, on a side stream as CUDA graph capture asks
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.logits = self._step()
            torch.cuda.current_stream(self.device).wait_stream(side)
        else:
            self.logits = self._step()

    def _step(self) -> torch.Tensor:
        inputs = {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "past": self.past}
        if self.layout.uses_position_ids:
            inputs["position_ids"] = self.position_ids
        logits, present = self.run(**inputs)
        for buffer, value in zip(self.past, present):
            buffer.index_copy_(2, self.slot, value[:, :, -1:])
        return logits

    def _capture(self) -> None:
        """Record one decode step (graph call + slot copy) as a CUDA graph, then replay it for this
        token; if recording fails, run this and every later step eagerly."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                logits = self._step()
        except Exception as err:  # noqa: BLE001 - any op that cannot be recorded
            torch.cuda.synchronize(self.device)
            warnings.warn(f"decode steps run without a CUDA graph: recording one failed ({err})", stacklevel=3)
            self.cuda_graph = False
            self.logits = self._step()
            return
        self.graph, self.logits = graph, logits
        graph.replay()
