"""Train a bundled causal LM ("tinylm" or "longlm") on the CPython standard library sources.

Reproduce (each about an hour on one core of the 2-core reference machine; deterministic for a
given torch build and thread count):

    python scripts/train_tinylm.py --out qcompiler/models/tinylm
    python scripts/train_tinylm.py --preset longlm --out qcompiler/models/longlm

Byte-level LLaMAs (transformers ``LlamaForCausalLM``); dimensions are multiples of 128 so every
built-in group size applies. ``tinylm``: 4 layers, hidden 256, MLP 512, 4 heads, 2.75 M
parameters, 1,400 steps (~4 tokens per parameter: it barely notices 4-bit weights).
``longlm``: 4 layers, hidden 128, MLP 384, 4 heads, 0.92 M parameters, 3,600 steps (~32 tokens
per parameter, 2.6 passes over the training split): a model trained long packs more into each
weight, so 3- and 4-bit methods separate on it. Writes ``config.json``, ``model.safetensors``
and ``training.json`` (recipe, held-out perplexity, seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from qcompiler.data import ByteTokenizer, stdlib_tokens
from qcompiler.evaluation.eval import perplexity

PRESETS = {  # name: (hidden, MLP, layers, heads, default steps)
    "tinylm": (256, 512, 4, 4, 1400),
    "longlm": (128, 384, 4, 4, 3600),
}


def make_config(preset: str = "tinylm") -> LlamaConfig:
    hidden, mlp, layers, heads, _ = PRESETS[preset]
    return LlamaConfig(
        vocab_size=ByteTokenizer.vocab_size,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )  # the NUL byte: never in source text; what generate() pads with


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tinylm")
    ap.add_argument("--steps", type=int, default=None, help="default: the preset's")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.steps is None:
        args.steps = PRESETS[args.preset][4]

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train = stdlib_tokens("train")
    heldout = stdlib_tokens("heldout")
    model = LlamaForCausalLM(make_config(args.preset))
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    warmup = max(1, args.steps // 30)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.time()
    model.train()
    for step in range(args.steps):
        starts = torch.randint(0, train.numel() - args.seq - 1, (args.batch,), generator=gen)
        x = torch.stack([train[s : s + args.seq] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == args.steps - 1:
            print(
                f"step {step:5d}/{args.steps}  loss {loss.item():.4f}  lr {lr_at(step):.2e}  {time.time() - t0:7.0f}s",
                flush=True,
            )
    train_seconds = time.time() - t0
    model.eval()
    ppl = perplexity(model, heldout, window=256)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    record = {
        "command": f"python scripts/train_tinylm.py --preset {args.preset} --out qcompiler/models/{args.preset}",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "parameters": n_params,
        "train_tokens_seen": args.steps * args.batch * args.seq,
        "train_split_tokens": train.numel(),
        "heldout_tokens": heldout.numel(),
        "heldout_perplexity": ppl,
        "uniform_byte_perplexity": 256.0,
        "train_seconds": round(train_seconds),
        "torch": torch.__version__,
    }
    (args.out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
