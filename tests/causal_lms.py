"""Small random-weight causal LMs of 13 transformers architectures, built from configs with their
default settings (``use_cache=True``), for the KV-cache capture and generation tests."""

from __future__ import annotations

import torch
import transformers as T

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

ARCHITECTURES = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "phi3",
    "gpt2",
    "opt",
    "gpt_neox",
    "falcon",
    "bloom",
    "mixtral",
    "qwen2_moe",
]


def config(name: str):
    if name == "gpt2":
        return T.GPT2Config(
            vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=1, eos_token_id=2
        )
    if name == "opt":
        return T.OPTConfig(
            vocab_size=128,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=128,
            word_embed_proj_dim=64,
            **_IDS,
        )
    if name == "gpt_neox":
        return T.GPTNeoXConfig(**{**_COMMON, "num_key_value_heads": None})
    if name == "falcon":
        return T.FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **_IDS)
    if name == "bloom":
        return T.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4, **_IDS)
    if name == "mixtral":
        return T.MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2)
    if name == "qwen2_moe":
        return T.Qwen2MoeConfig(
            **_COMMON,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
        )
    if name == "gemma3_text":  # not in ARCHITECTURES: QK-norm and two rotary bases, for the exporters' tests
        return T.Gemma3TextConfig(
            **_COMMON,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        )
    cls = {
        "llama": T.LlamaConfig,
        "mistral": T.MistralConfig,
        "qwen2": T.Qwen2Config,
        "qwen3": T.Qwen3Config,
        "gemma2": T.Gemma2Config,
        "phi3": T.Phi3Config,
    }[name]
    return cls(**_COMMON, **({"head_dim": 16} if name in ("qwen3", "gemma2") else {}))


def causal_lm(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(config(name)).eval()


def prompt(batch: int = 1, length: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def calibration(seed: int = 1) -> list[dict]:
    return [{"input_ids": torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(seed))}]


# Sizes every real client runs: vLLM's CPU attention needs head_dim >= 32; a 256-token vocabulary
# gets the byte tokenizer files the clients insist on loading.
_CLIENT_SIZES = dict(
    vocab_size=256,
    hidden_size=128,
    n_embd=128,
    intermediate_size=256,
    ffn_dim=256,
    word_embed_proj_dim=128,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    head_dim=32,
)


def client_sized_lm(name: str, *, tied: bool = False) -> torch.nn.Module:
    """``name``'s random-weight LM at sizes the real clients run (4 heads of 32, width 128, vocabulary
    256); ``tied``: the head shares the embedding table (GPT-2, OPT and Gemma-2 always do)."""
    cfg = config(name)
    for key, value in _CLIENT_SIZES.items():
        if key in cfg.to_dict() or key == "head_dim":
            setattr(cfg, key, value)
    cfg.tie_word_embeddings = tied or name in ("gpt2", "opt", "gemma2")
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(cfg).eval()
