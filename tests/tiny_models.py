"""Tiny Hugging Face models of the four architecture families the passes must handle."""

from __future__ import annotations

import torch
from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
)


def make_model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "llama":
        cfg = LlamaConfig(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        return LlamaForCausalLM(cfg).eval()
    if arch == "opt":
        cfg = OPTConfig(
            vocab_size=96,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=64,
        )
        return OPTForCausalLM(cfg).eval()
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64)).eval()
    if arch == "bert":
        cfg = BertConfig(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
        )
        return BertModel(cfg).eval()
    raise ValueError(arch)


def example_inputs(arch: str, batch: int = 2, seq: int = 8, seed: int = 0) -> dict:
    ids = torch.randint(0, 96, (batch, seq), generator=torch.Generator().manual_seed(seed))
    if arch == "bert":
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return {"input_ids": ids, "use_cache": False}


def main_output(out) -> torch.Tensor:
    for name in ("logits", "last_hidden_state"):
        if hasattr(out, name):
            return getattr(out, name)
    return out[0] if isinstance(out, (tuple, list)) else out


ARCHS = ["llama", "opt", "gpt2", "bert"]


class Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.fc2 = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Stack(torch.nn.Module):
    """A plain (non-Hugging Face) model with transformer-style blocks at ``layers.N``."""

    def __init__(self, d: int = 32, depth: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(Block(d) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
