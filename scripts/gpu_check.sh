#!/usr/bin/env bash
# The one script to run when a CUDA GPU is lent (e.g. through the device tool):
# kernel correctness on the GPU, the triton backend end to end, then the kernel benchmark.
# Figures land in benchmarks/results/kernels.json; quote them in docs/results.md with date and device.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.cuda.get_device_name())"
python -m pytest -q -x tests/test_triton_kernels.py tests/test_triton_backend.py
python benchmarks/kernels.py
