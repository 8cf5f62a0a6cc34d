"""``qcompiler generate``: continue prompts with the KV cache (one prompt streams its tokens)."""

from __future__ import annotations

import itertools
import sys
from typing import Optional

import typer

from qcompiler.cli.common import Backend, artifact_source, out, say, triton_runtime
from qcompiler.pipeline.heartbeat import heartbeat


def generate(
    target: str = typer.Argument(..., help="an artifact folder, or a model (bundled:NAME / folder) in FP"),
    prompt: list[str] = typer.Option(..., "--prompt", help="text to continue; repeat for a batch"),
    max_new_tokens: int = typer.Option(
        32, "--max-new-tokens", min=0, max=1_000_000, help="tokens to generate per prompt"
    ),
    backend: Backend = typer.Option("eager", help="backend to run the model on"),
    do_sample: bool = typer.Option(False, "--sample", help="sample instead of greedy decoding"),
    temperature: float = typer.Option(1.0, help="sampling temperature"),
    top_k: int = typer.Option(0, "--top-k", min=0, help="sample among the k most likely tokens (0: all)"),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0, help="nucleus sampling mass (1.0: all)"),
    seed: Optional[int] = typer.Option(None, help="random seed for sampling"),
):
    """Continue each --prompt with the KV cache; one prompt streams its tokens as they are made."""
    import torch

    import qcompiler as qc
    from qcompiler.generation import SamplingConfig
    from qcompiler.models import load, tokenizer_for

    if max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    SamplingConfig(do_sample, temperature, top_k, top_p)  # bad values fail before any loading
    if backend.value == "triton":
        triton_runtime()
    is_artifact, source = artifact_source(target, "so there is no tokenizer for it")
    with heartbeat(say, f"loading {target}"):
        if is_artifact:
            tokenizer, cm = tokenizer_for(source), qc.load(target, backend=backend.value)
        else:
            loaded = load(target)
            tokenizer = loaded.tokenizer
            cm = qc.compile(loaded.model, loaded.example_inputs(), recipe="none", backend=backend.value, progress=False)
    encoded = [list(map(int, tokenizer.encode(p))) for p in prompt]
    if any(not ids for ids in encoded):
        raise ValueError("a --prompt is empty: give at least one token of text")
    width = max(map(len, encoded))
    ids = torch.tensor([[0] * (width - len(e)) + e for e in encoded])  # left padding
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    options = dict(
        do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, attention_mask=mask
    )
    if len(prompt) == 1:
        made, shown = [], ""

        def write(text: str) -> None:  # plain stdout: no wrapping or markup, flushed token by token
            sys.stdout.write(text)
            sys.stdout.flush()

        tokens = cm.stream(ids, max_new_tokens, **options)
        with heartbeat(say, f"prefill of {ids.shape[1]} prompt tokens"):  # until the first token
            first = next(tokens, None)  # bad values raise before the first token
        for token in [] if first is None else itertools.chain([first], tokens):
            if not made:
                write(prompt[0])
            made.append(int(token[0]))
            text = tokenizer.decode(made)
            write(text[len(shown) :])
            shown = text
        write(("" if made else prompt[0]) + "\n")
        return
    result = cm.generate(ids, max_new_tokens, **options)
    for p, row in zip(prompt, result[:, width:]):
        out.print(
            f"{p!r} -> {tokenizer.decode([int(t) for t in row])!r}", markup=False, highlight=False, soft_wrap=True
        )
