#!/usr/bin/env bash
# The one script to run when a CUDA GPU is lent (e.g. through the device tool); at most ~7.7 minutes
# on one H100/H200, each step under its own time limit so one slow step cannot eat the others':
#   1. benchmarks/kernel_speed.py   every kernel the triton backend runs vs fp16 cuBLAS under CUDA
#                              graphs at M = 1, 16, 512, 4, 64 (4096x4096, 4096x11008, 11008x4096,
#                              8192x8192, 4096x14336; M-major, so a cut keeps the decode rows), GB/s
#                              and % of HBM (FP8 W8A8 and NVFP4/MXFP4 W4A16 included), the first
#                              GEMV and the fused GEMM beside the ones
#                              dispatched, checked vs the plain-torch references;
#   2. benchmarks/gpu_decode.py decode tokens/s of a 1.1 B LLaMA: transformers fp16, triton fp16,
#                              w4g128, w3g128, w8a8 (spqr-w3g16 if the time budget allows), static
#                              cache + CUDA graph;
#   3. the kernel, layout, backend and generate tests on the GPU (slow variants included).
# QC_GPU_CHECK_FULL=1 adds the GPTQ solver and whole-model calibration on the GPU, up to a Llama-3-70B-shaped
# block and the many-GPU projection from it (~8 more minutes).
# scripts/gpu_check.sh --smoke runs the same steps on CPU under TRITON_INTERPRET=1 with tiny shapes (a
# few minutes, no GPU): run it before spending device minutes.
# Figures land in $OUT (default /tmp/qc-gpu-out) and are copied to benchmarks/results/; quote them in
# docs/results.md with date and device. On a bare GPU image that already has torch/triton/
# transformers, qcompiler is installed without dependencies (nothing fetched; the image's torch stays).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/qc-gpu-out}; mkdir -p "$OUT"
if [ "${1:-}" = --smoke ]; then
    export TRITON_INTERPRET=1
    status=0
    timeout 300 python3 benchmarks/kernel_speed.py --smoke --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" || status=1
    timeout 300 python3 benchmarks/gpu_decode.py --smoke --out "$OUT/gpu_decode.json" 2>&1 | tee "$OUT/gpu_decode.log" || status=1
    timeout 600 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib -p no:benchmark" \
        tests/test_kernel_layout.py tests/test_triton_kernels.py tests/test_float_kernels.py 2>&1 | tee "$OUT/gpu_tests.log" || status=1
    echo "smoke: exit $status (timings under the interpreter mean nothing)"
    exit $status
fi
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.cuda.get_device_name(), torch.__version__)" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv 2>/dev/null | tee "$OUT/gpu.txt"
python3 -c "import qcompiler.passes" 2>/dev/null || \
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
status=0
timeout 230 python3 benchmarks/kernel_speed.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" || status=1
cp "$OUT/kernels.json" benchmarks/results/kernels.json 2>/dev/null || true
timeout 140 python3 benchmarks/gpu_decode.py --time-budget 70 --out "$OUT/gpu_decode.json" 2>&1 \
    | tee "$OUT/gpu_decode.log" || status=1
cp "$OUT/gpu_decode.json" benchmarks/results/gpu_decode.json 2>/dev/null || true
# addopts replaced: no xdist on the image perhaps, and the slow variants run too (kernels compile once)
QC_TRITON_AUTOTUNE=0 timeout 90 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
    tests/test_kernel_layout.py tests/test_triton_kernels.py tests/test_float_kernels.py tests/test_triton_backend.py tests/test_device.py \
    "tests/test_causal_lm.py::test_triton_backend_generates_the_eager_tokens" \
    2>&1 | tee "$OUT/gpu_tests.log" || status=1
if [ "${QC_GPU_CHECK_FULL:-0}" = 1 ]; then
    timeout 90 python3 benchmarks/gptq_speed.py --layer-only cuda 2>&1 | tee "$OUT/gptq_cuda.log" || status=1
    timeout 400 python3 benchmarks/device_calibration.py --cases llama-1024x4 llama7b-shape-x2 llama70b-block \
        --out "$OUT/device_calibration.json" 2>&1 | tee "$OUT/device_calibration.log" || status=1
fi
exit $status
