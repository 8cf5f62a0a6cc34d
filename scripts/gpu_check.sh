#!/usr/bin/env bash
# The one script to run when a CUDA GPU is lent (e.g. through the device tool):
# kernel correctness on the GPU, the triton backend end to end, device onloading, the kernel benchmark,
# the GPTQ solver on the GPU, then whole-model calibration on cuda vs cpu. Figures land in $OUT
# (default /tmp/qc-gpu-out; kernels.json is also copied to benchmarks/results/); quote them in
# docs/results.md with date and device.
# On a bare GPU image that already has torch/triton/transformers, qcompiler is installed without
# dependencies (nothing is fetched; the image's torch is never replaced).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/qc-gpu-out}; mkdir -p "$OUT"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.cuda.get_device_name(), torch.__version__)" || exit 1
python3 -c "import qcompiler.passes" 2>/dev/null || \
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
status=0
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_triton_backend.py tests/test_device.py \
    2>&1 | tee "$OUT/gpu_tests.log" || status=1
timeout 200 python3 benchmarks/kernels.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" || status=1
cp "$OUT/kernels.json" benchmarks/results/kernels.json 2>/dev/null || true
timeout 90 python3 benchmarks/gptq_speed.py --layer-only cuda 2>&1 | tee "$OUT/gptq_cuda.log" || status=1
timeout 240 python3 benchmarks/device_calibration.py --out "$OUT/device_calibration.json" 2>&1 \
    | tee "$OUT/device_calibration.log" || status=1
exit $status
