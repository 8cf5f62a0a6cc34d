"""Google's Gemma-3 270M — a real pretrained model — through the GGUF export and the real llama.cpp.

The folder is built once from the PyPI packages that ship the model (qcompiler.models.gemma3_270m;
cached under $QC_MODEL_CACHE). What a user of llama.cpp relies on: the file loads as llama.cpp's
``gemma3`` (QK-norm, sandwich norms, 5:1 sliding/global layers with their own rotary bases, the
tied 262k head), its logits are the graph's within the bounds below, and its tokenizer — written
from tokenizer.json alone, the only tokenizer file this folder has — splits held-out text into
exactly transformers' tokens.

Bounds over 128 held-out positions (measured 2026-12-06): mean next-token KL(graph || llama.cpp)
2.4e-6 nats with F16 weights (bound 1e-4) and 0.0024 with Q4_0 weights (bound 0.01: llama.cpp
rounds activations to 8-bit blocks before each Q4_0 product — 0.6 % of the 0.41 nats Q4_0 itself
costs against the FP model), 0.0041 with Q4_0 layers and Q8_0 token embeddings (``token_embedding``,
which re-rounds the tied head as well; bound 0.01); the largest logit difference 0.13 % of the largest logit with F16
(bound 0.3 %, as for the small models); the same next token at ≥ 95 % of positions (measured 100 %
and 98.4 %).
"""

import os

import numpy as np
import pytest
import torch

import qcompiler as qc
from qcompiler import models
from qcompiler.data import stdlib_text

pytestmark = pytest.mark.slow

if os.environ.get("QC_REQUIRE_LLAMA_CPP"):
    import llama_cpp
else:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (.ci/run installs it)")


@pytest.fixture(scope="module")
def gemma():
    from qcompiler.models.gemma3_270m import gemma3_270m_dir

    m = models.load(str(gemma3_270m_dir()))
    assert m.model.config.model_type == "gemma3_text"
    return m


def _llama(path):
    return llama_cpp.Llama(model_path=str(path), n_ctx=512, logits_all=True, verbose=False, n_threads=2, seed=0)


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    """Mean KL(p || q) of next-token distributions given as logits."""
    return (p.log_softmax(-1).exp() * (p.log_softmax(-1) - q.log_softmax(-1))).sum(-1).mean().item()


@pytest.mark.parametrize(
    "recipe,embedding,kl_bound", [("none", None, 1e-4), ("rtn-q4_0", None, 0.01), ("rtn-q4_0", "q8_0", 0.01)]
)
def test_llama_cpp_runs_our_gemma3_gguf_with_the_graphs_logits(gemma, recipe, embedding, kl_bound, tmp_path):
    cm = qc.compile(gemma.model, gemma.example_inputs(), recipe=recipe, backend="eager")
    said = []
    cm.export_gguf(tmp_path / "g.gguf", token_embedding=embedding, progress=said.append)
    assert said[0].startswith("GGUF (gemma3):")
    ids = gemma.encode(stdlib_text("heldout")[:600])[:, :128]
    want = cm(input_ids=ids).logits[0].detach().float()
    llm = _llama(tmp_path / "g.gguf")
    llm.eval(ids[0].tolist())
    got = torch.tensor(np.array(llm.scores[: ids.shape[1]]))
    print(f"{recipe} embeddings {embedding}: KL(graph || llama.cpp) {_kl(want, got):.2e}")
    assert _kl(want, got) < kl_bound
    if recipe == "none":
        assert (got - want).abs().max() / want.abs().max() < 0.003
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95  # next-token choices, 128 positions


def test_gemma3_tokenizer_from_tokenizer_json_splits_text_as_transformers(gemma, tmp_path):
    """Code, prose, runs of spaces and newlines, tabs, accents, CJK and emoji (byte fallback)."""
    cm = qc.compile(gemma.model, gemma.example_inputs(), recipe="none", backend="eager")
    cm.export_gguf(tmp_path / "g.gguf", progress=lambda s: None)
    llm = llama_cpp.Llama(model_path=str(tmp_path / "g.gguf"), vocab_only=True, verbose=False)
    texts = [
        stdlib_text("heldout")[:40_000],
        "Héllo wörld — 日本語のテキスト, emoji 🤖🎉, tabs\tand   multiple    spaces\n\n\n  indented",
        "  leading spaces, \u00a0no-break space and \r\n line ends",
    ]
    for text in texts:
        want = gemma.tokenizer.encode(text, add_special_tokens=False)
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == want
    turn = "<start_of_turn>user\nhi<end_of_turn>"  # control tokens: matched when special tokens are parsed
    assert llm.tokenize(turn.encode(), add_bos=False, special=True) == gemma.tokenizer.encode(
        turn, add_special_tokens=False
    )
    assert (llm.token_bos(), llm.token_eos()) == (2, 1) and llm.tokenize(b"hi") == gemma.tokenizer.encode("hi")
