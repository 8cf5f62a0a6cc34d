"""Cutting a model's tensors into safetensors files of bounded size (checkpoint exports, artifacts)."""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_SHARD_BYTES", "plan_shards", "shard_names"]

DEFAULT_SHARD_BYTES = 5 * 1024**3  # the Hugging Face Hub's long-standing shard size


def plan_shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Names in order, cut into shards of at most ``max_bytes`` (a bigger tensor gets its own)."""
    if max_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_bytes}")
    shards, size = [[]], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def shard_names(stem: str, count: int) -> list[str]:
    """``{stem}.safetensors``, or ``{stem}-0000k-of-0000n.safetensors`` (the Hugging Face naming)."""
    if count == 1:
        return [f"{stem}.safetensors"]
    return [f"{stem}-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]
