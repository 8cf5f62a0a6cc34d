"""Online randomized Hadamard rotation ``x @ diag(s) · blockdiag(H_b/√b)`` (the ``qc.hadamard`` op).

Each program owns a tile of rows and a tile of output columns inside one Hadamard block and
walks that block's ``b`` input columns: ``H_b``'s entries are computed in registers
(``H[i, j] = (−1)^popcount(i & j)``, Sylvester's matrix), never loaded, so the kernel reads ``x``
and the signs once per column tile and writes ``y``. 16-bit activations multiply in their own
dtype (``±x`` is exact there) with fp32 accumulation; fp32 ones in IEEE fp32 (no TF32).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from qcompiler.kernels.tuning import Tunable, UnsupportedKernel, check_activation, dot_upcast

__all__ = ["hadamard"]


@triton.jit
def _hadamard_kernel(
    x_ptr,
    s_ptr,
    y_ptr,
    M,
    stride_xm,
    stride_ym,
    scale,
    B: tl.constexpr,
    LOG_B: tl.constexpr,
    NATIVE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    base = (pid_n * BLOCK_N // B) * B  # first column of this Hadamard block
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, B, BLOCK_K):
        rk = base + k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=rm[:, None] < M, other=0.0)
        s = tl.load(s_ptr + rk)
        bits = (rk - base)[:, None] & (rn - base)[None, :]
        parity = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.int32)
        for t in tl.static_range(LOG_B):
            parity = parity ^ ((bits >> t) & 1)
        if NATIVE:
            xs = x * s.to(x.dtype)[None, :]
            acc += tl.dot(xs, (1 - 2 * parity).to(x.dtype))
        else:
            xs = x.to(tl.float32) * s.to(tl.float32)[None, :]
            acc += tl.dot(xs, (1 - 2 * parity).to(tl.float32), input_precision="ieee")
    y = acc * scale
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=rm[:, None] < M)


_HADAMARD = Tunable(
    _hadamard_kernel,
    [triton.Config({"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4) for bm in (16, 64, 128)],
    key=["M", "B"],
    interpret_config={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16},
)


def hadamard(x: torch.Tensor, signs: torch.Tensor, block_size: int) -> torch.Tensor:
    """``qc.hadamard`` as a Triton kernel (same signature and result as the reference)."""
    check_activation("hadamard", x)
    width = x.shape[-1]
    if block_size < 64 or block_size & (block_size - 1) or width % block_size:
        raise UnsupportedKernel(f"hadamard: block {block_size} of width {width} (the kernel takes blocks of 64+)")
    x2 = x.reshape(-1, width).contiguous()
    M = x2.shape[0]
    y = torch.empty_like(x2)
    native = x.dtype in (torch.float16, torch.bfloat16) and not dot_upcast(x.dtype)
    _HADAMARD[lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), width // meta["BLOCK_N"])](
        x2,
        signs.to(device=x.device),
        y,
        M,
        x2.stride(0),
        y.stride(0),
        1.0 / math.sqrt(block_size),
        B=block_size,
        LOG_B=int(math.log2(block_size)),
        NATIVE=native,
    )
    return y.reshape(x.shape)
