"""Decode speed as the decode benchmarks count it: tokens/s from the time each new token appeared."""

from __future__ import annotations

import time

__all__ = ["rate", "HFEngine"]


def rate(stamps: list[float]) -> float:
    """Decode tokens/s from the time each new token appeared (the first one ends the prefill)."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


class HFEngine:
    """transformers ``generate`` (on the model's device); a streamer stamps each token as it is produced."""

    def __init__(self, model):
        self.model = model

    def run(self, ids, new) -> tuple[float, list[int]]:
        """(decode tokens/s, the new tokens of row 0)."""
        from transformers.generation.streamers import BaseStreamer

        stamps = []

        class Clock(BaseStreamer):
            def put(self, value):
                stamps.append(time.perf_counter())

            def end(self):
                pass

        device = next(self.model.parameters()).device
        out = self.model.generate(
            ids.to(device), max_new_tokens=new, min_new_tokens=new, do_sample=False, streamer=Clock()
        )
        return rate(stamps[1:]), out[0, ids.shape[1] :].tolist()  # the first put() is the prompt

    def decode_rate(self, ids, new) -> float:
        return self.run(ids, new)[0]
