"""Launch plumbing shared by the kernels: autotuning on a GPU, one fixed config under the interpreter."""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import triton

from qcompiler.errors import BackendError

__all__ = ["INTERPRET", "Tunable", "UnsupportedKernel", "runtime_problem", "check_activation", "dot_upcast"]

# triton.jit decides interpreted vs compiled when a kernel is decorated, i.e. at import time.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# QC_TRITON_AUTOTUNE=0: one fixed config on the GPU too (correctness tests: one compile per kernel
# instead of one per config and shape; the benchmark checks the tuned configs).
AUTOTUNE = os.environ.get("QC_TRITON_AUTOTUNE", "1") != "0"

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class UnsupportedKernel(BackendError):
    """A kernel was asked for a combination it does not implement; the message names it."""


def runtime_problem(device: torch.device) -> Optional[str]:
    """Why kernels cannot run on ``device`` here (None when they can)."""
    if device.type == "cuda":
        return None
    if device.type == "cpu" and INTERPRET:
        return None
    if device.type == "cpu":
        return (
            "Triton kernels need a CUDA GPU; on CPU set TRITON_INTERPRET=1 before importing "
            "qcompiler.kernels (slow, for correctness checks)"
        )
    return f"Triton kernels do not run on {device.type} tensors"


def check_activation(kernel: str, x: torch.Tensor) -> None:
    """Raise UnsupportedKernel when ``x``'s dtype or device is one ``kernel`` cannot take."""
    if x.dtype not in ACTIVATION_DTYPES:
        raise UnsupportedKernel(
            f"{kernel}: {x.dtype} activations are not supported (supported: float16, bfloat16, float32)"
        )
    problem = runtime_problem(x.device)
    if problem:
        raise UnsupportedKernel(f"{kernel}: {problem}")


class Tunable:
    """A jitted kernel launched with autotuned meta-parameters on a GPU, or ``interpret_config`` on CPU.

    Autotuning under the interpreter would time numpy, not a GPU, so it is skipped there.
    ``kernel[grid](...)`` as usual, where ``grid`` is a function of the meta-parameters.
    """

    def __init__(self, kernel, configs: list, key: list[str], interpret_config: dict, **autotune_options):
        self.kernel = kernel
        self.interpret_config = interpret_config
        self.tuned = (
            None if INTERPRET or not AUTOTUNE else triton.autotune(configs=configs, key=key, **autotune_options)(kernel)
        )

    def __getitem__(self, grid: Callable[[dict], tuple]):
        if self.tuned is not None:
            return self.tuned[grid]
        cfg = self.interpret_config
        # On a GPU (QC_TRITON_AUTOTUNE=0) without software pipelining: the fixed tiles then fit in
        # shared memory for every kernel (3 stages of the 16x128x128 decode tile did not on an H200).
        launch = {} if INTERPRET else {"num_stages": 1, "num_warps": 4}
        return lambda *args, **kwargs: self.kernel[grid(cfg)](*args, **kwargs, **cfg, **launch)


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether a kernel's ``tl.dot`` must run in fp32: the interpreter multiplies bf16 tiles wrongly
    (numpy has no bfloat16), so there — only there — bf16 tiles are widened first."""
    return INTERPRET and dtype == torch.bfloat16
