"""Half-precision matrix products on a CPU without half-precision units, computed in float32.

A streamed checkpoint computes in its own dtype (bf16 / fp16). On a CPU without AVX512-BF16 / AMX
(most AVX2 machines), PyTorch's bf16 GEMM runs 5-7x slower than float32 and fp16 10x (2026-12-05,
AVX2 EPYC, one thread: a 1024 x 1536 x 4096 linear takes 2.3 s in bf16, 4.5 s in fp16, 0.47 s
cast to float32 and back), and the calibration forward of a bf16 block is 97 % GEMM. Casting the
operands up gives the same exact products (a bf16 or fp16 value is exact in float32), accumulated
in float32 as the native kernels do, and one rounding back to the operands' dtype: the result
differs from the native kernel's only by summation order (at most one unit in the last place,
tests/test_cpu_products.py). Where the CPU has the units the native kernel runs, unchanged.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

__all__ = ["Float32Products", "float32_product", "slow_half_dtypes"]

aten = torch.ops.aten
_PRODUCTS = {aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default}


@functools.cache
def slow_half_dtypes() -> frozenset[torch.dtype]:
    """The half dtypes this CPU has no matrix units for (their GEMM is emulated, and slow)."""
    slow = set()
    if not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()):
        slow.add(torch.bfloat16)
    if not torch.cpu._is_amx_fp16_supported():
        slow.add(torch.float16)
    return frozenset(slow)


def float32_product(target: Any, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """``target(*args, **kwargs)`` computed in float32 and rounded back when it is a matrix product
    of CPU tensors in a dtype this CPU computes slowly; None otherwise (run the node as it is)."""
    if target not in _PRODUCTS:
        return None
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return None
    dtype = tensors[0].dtype
    if dtype not in slow_half_dtypes() or any(t.dtype != dtype for t in tensors):
        return None
    up = tuple(a.float() if isinstance(a, torch.Tensor) else a for a in args)
    return target(*up, **{k: v.float() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}).to(dtype)


class Float32Products(torch.fx.Interpreter):
    """An interpreter whose slow half-precision products run through ``float32_product`` (the
    calibration engine's and the sensitivity runner's)."""

    def call_function(self, target, args, kwargs):
        """The node's value, its product taken in float32 where this CPU lacks the units."""
        product = float32_product(target, args, kwargs)
        return product if product is not None else super().call_function(target, args, kwargs)
