"""Shared fixtures (helpers live in tiny_models.py, importable via pytest's pythonpath)."""

import os

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter; it must be chosen before they are
# imported (triton.jit decides at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:  # correctness with one fixed config per kernel (benchmarks/kernel_speed.py checks the autotuned ones)
    os.environ.setdefault("QC_TRITON_AUTOTUNE", "0")

# pytest-xdist runs one worker per core (pyproject addopts): each gets its share of the cores,
# so workers do not oversubscribe them with torch's intra-op threads.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# One torch.export per architecture and example shape per worker (tests/capture_memo.py).
import capture_memo  # noqa: E402  (after TRITON_INTERPRET: it imports qcompiler)

capture_memo.install()


@pytest.fixture(scope="session")
def minilm():
    from qcompiler.models import load

    return load("minilm")


@pytest.fixture(scope="session")
def kernel_device():
    """Where the Triton kernels run in tests: the GPU when there is one, else the CPU interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# Variants that repeat a property a sibling test already asserts in the default run (another
# recipe, bit width or model through the same path), and the longest end-to-end runs. `pytest`
# (the README's command) skips them; `pytest -m slow` (run by .ci/run) runs them.
SLOW_VARIANTS = (
    # SignRound through the online rotations: the gradient of qc.hadamard is test_rotate's twin
    "test_signround.py::test_the_pass_lowers_the_models_output_error_below_round_to_nearest[rotated]",
    "test_signround.py::test_step_zero_is_round_to_nearest_and_the_best_step_is_never_worse[True]",
    "test_triton_backend.py::test_triton_backend_matches_eager_on_bundled_models[tinylm-",
    "test_onnx_genai.py::test_cli_export_onnx_genai_from_an_artifact",
    *(
        f"test_onnx_backend.py::test_onnxruntime_matches_eager[{v}]"
        for v in (
            "llama-rtn-8bit-channel",
            "llama-w8a8",
            "llama-gptq-act",
            "llama-w8a8-static",
            "llama-rtn-2bit",
            "llama-gptq-w4g128",  # 4-bit MatMulNBits exactness: test_partial_groups, test_causal_lm (ORT tokens)
            "llama-gptq-w3g128",  # 3-bit MatMulNBits: llama-spqr-w3g16 (default run) exports 3-bit codes too
            "bert-spqr-w3g16",
            "bert-gptq-w3g128",
        )
    ),
    "test_onnx_backend.py::test_large_models_go_to_external_data",
    # metadata, checker and atomic write: test_partial_groups' export asserts them (at level 0)
    "test_onnx_backend.py::test_export_records_metadata_and_passes_checker",
    "test_onnx_backend.py::test_onnxruntime_matches_eager[llama-w8a8-smoothquant]",  # W8A8 in ORT: bert's case
    "test_onnx_backend.py::test_t5_encoder_exports_and_runs_in_ort_at_other_shapes",
    "test_streaming.py::test_streamed_compile_equals_full_load[w8a8-smoothquant]",
    "test_streaming.py::test_streamed_compile_equals_full_load[spqr-w3g16]",
    "test_streaming.py::test_moe_checkpoints_transformers_converts_stream_and_compile_like_a_full_load[",
    "test_bundled_models.py::test_gptq_beats_rtn_on_every_linear[minilm-4]",  # tinylm-4 asserts it by default
    "test_bundled_models.py::test_gptq_beats_rtn_on_every_linear[minilm-3]",
    "test_bundled_models.py::test_gptq_beats_rtn_on_every_linear[tinylm-3]",
    "test_cli.py::test_report_of_spqr_has_the_outlier_heat_map",
    "test_device.py::test_onloaded_compile_matches_in_place_compile[spqr-w3g16-cpu]",
    "test_device.py::test_onloaded_compile_matches_in_place_compile[w8a8-static-cpu]",
    "test_device.py::test_onloaded_compile_matches_in_place_compile[w8a8-smoothquant-auto-cpu]",
    "test_output_folders.py::test_kill_9_at_random_points_keeps_a_loadable_artifact[1]",
    "test_output_folders.py::test_kill_9_at_random_points_keeps_a_loadable_artifact[2]",
    "test_artifacts_and_interop.py::test_gptq_checkpoint_round_trip_is_bit_identical[gptq-w2g128-auto-False]",
    "test_artifacts_and_interop.py::test_gptq_checkpoint_round_trip_is_bit_identical[rtn-w3g128-v2-False]",
    # Q5_K is Q4_K's code with a fifth bit: its bytes (test_packed_bytes_are_llama_cpp_blocks) stay in the default run
    # Q6_K is Q3_K's code with other widths: its bytes (test_packed_bytes_are_llama_cpp_blocks) stay too
    *(
        f"test_gguf_grids.py::test_gptq_on_the_grid_is_the_straightforward_algorithm[{v}-{kind}]"
        for v in ("False-False", "True-True", "False-True")
        for kind in ("q5_k", "q6_k")
    ),
    *(
        f"test_gguf_grids.py::{test}[{kind}]"
        for test in (
            "test_every_layer_is_on_the_grid_at_its_exact_bits",
            "test_gguf_file_holds_the_graphs_weights_bit_for_bit",
        )
        for kind in ("q5_k", "q6_k", "q2_k")
    ),
    *(
        f"test_gguf_grids.py::test_artifact_round_trip_onnx_runtime_and_refusals_by_name[{kind}]"
        for kind in ("q5_k", "q6_k", "q3_k", "q2_k", "q4_1")
    ),
    "test_llama_cpp_runs_our_gguf.py::test_llama_cpp_runs_k_quants_as_the_graph_does[gptq-q5_k]",
    "test_llama_cpp_runs_our_gguf.py::test_llama_cpp_runs_k_quants_as_the_graph_does[gptq-q6_k]",
    "test_llama_cpp_runs_our_gguf.py::test_llama_cpp_runs_k_quants_as_the_graph_does[gptq-q2_k]",
)


# Repeats of a slow-tier property that only a release needs, each beside the sibling that keeps it in
# CI: `pytest -m release` (scripts/release_check.sh) runs them; `.ci/run`'s slow tier does not.
RELEASE_VARIANTS = (
    # every kernel these run has its plain-torch twin test in test_triton_kernels.py (SpQR dense,
    # CSR SpMM, 3-bit GEMM, W8A8 GEMM, MiniLM's LayerNorm path); tinylm's W4 and W8A8 stay end to end
    "test_triton_backend.py::test_triton_backend_matches_eager_on_bundled_models[minilm-",
    "test_triton_backend.py::test_triton_backend_matches_eager_on_bundled_models[tinylm-spqr-w3g16]",
    "test_triton_backend.py::test_triton_backend_matches_eager_on_bundled_models[tinylm-gptq-w3g128]",
    # plain 4-bit through vLLM: [tied] serves the same recipe (with the tied head) and the
    # conformance cover's llama / gptq-w4g128 / vllm cell
    "test_vllm_serves_our_export.py::test_vllm_generates_the_quantized_models_tokens[w4g128]",
    # plain 4-bit through GPTQModel: the cover's llama / gptq-w4g128 / gptqmodel cell and [mixed]
    "test_gptqmodel_loads_our_export.py::test_gptqmodel_loads_the_export_with_the_same_outputs[w4g128]",
)


# The longest files first (measured), whole files so module fixtures are built once per worker:
# xdist's work stealing then balances the short tests at the end instead of one worker waiting
# on a 30 s test the other started last.
LONGEST_FILES = (
    "test_client_conformance.py",  # slow run: ~5 min, one test (the cover)
    "test_cli.py",
    "test_onnx_backend.py",
    "test_causal_lm.py",
    "test_moe_experts.py",
    "test_streaming.py",
    "test_artifacts_and_interop.py",
    "test_bundled_models.py",
)


def _file_rank(item) -> int:
    name = item.path.name
    return LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(variant in item.nodeid for variant in RELEASE_VARIANTS):
            item.add_marker(pytest.mark.release)
        elif any(variant in item.nodeid for variant in SLOW_VARIANTS):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_file_rank)  # stable: the order within a file is kept
