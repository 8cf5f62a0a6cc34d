"""The FP8 and FP4 Triton kernels equal their ops' plain-torch references (CPU: under TRITON_INTERPRET=1).

FP8: the activations' rounding to e4m3 is bit-exact (codes × scales equal ``quantize_fp8_activations``),
and the GEMM equals ``qc.fp8_linear`` within fp32 rounding for every weight scale layout × activation
mode, decode (split-K) and prefill. FP4 (NVFP4 W4A16, MXFP4): the dequantized workspace is the
reference's weight bit for bit, and the GEMV / dequant+matmul paths equal the op within rounding.
NVFP4 W4A4 (emulated): the activations' rounding bit for bit, the product within rounding. The FP8
KV cache's rounding: bit for bit.
Shapes are small and not multiples of the tiles.
"""

import pytest
import torch

from qcompiler import kernels
from qcompiler.algorithms.float_grid import (
    FLOAT_FORMATS,
    effective_scales,
    fit_scales,
    global_scale,
    pack_e2m1,
    per_element,
    quantize_elements,
)
from qcompiler.ir.ops import fp8_kv_quant
from qcompiler.kernels.fp4_linear import FP4_GEMV_MAX_M, dequantize_fp4
from qcompiler.kernels.fp8_quant import quantize_fp8_rows
from qcompiler.kernels.nvfp4_quant import quantize_nvfp4_rows
from qcompiler.layouts.fp8 import fp8_linear, quantize_fp8_activations
from qcompiler.layouts.mxfp4 import dequantize_mxfp4, mxfp4_linear
from qcompiler.layouts.nvfp4 import dequantize_nvfp4, nvfp4_linear, quantize_nvfp4_activations

# max |kernel − reference| / max |reference|: fp32 differs in summation order only; bf16 by an
# output rounding (one bf16 step is 2^-8 of a value)
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


def _on(device, *tensors):
    return [t.to(device) if torch.is_tensor(t) else t for t in tensors]


def _gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float().cpu() - want.float()).abs().max() / want.float().abs().max()).item()


def _float_weight(name: str, n_out: int, n_in: int, seed: int = 0):
    """Elements and stored scales of a random weight on ``name``'s grid (min-max scales)."""
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(n_out, n_in, generator=gen) * torch.logspace(-2, 1, n_in)
    fmt = FLOAT_FORMATS[name]
    g = global_scale(W, fmt)
    stored = fit_scales(W, fmt, g)
    elements = quantize_elements(W, per_element(effective_scales(stored, fmt, g), fmt, W.shape), fmt.element)
    return elements, stored, g


@pytest.mark.parametrize("activations", ["token", "group", "static"])
def test_fp8_activation_rounding_is_bit_exact(activations, kernel_device):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 256, generator=gen) * torch.logspace(-3, 3, 256)
    x[2] = 0.0  # an all-zero row (and groups): scale 1, codes 0
    # carries into the next binade (the interpreter's own fp32 -> e4m3 cast drops them), a value
    # below e4m3's smallest subnormal, saturation, a tie
    x[3, :6] = torch.tensor([127.97, -127.97, 1e-9, 448.0 * 3, 15.99, 0.0])
    x[4, :2] = torch.tensor([448.0, 1.0 / 448 * 1.0625])
    scale = torch.tensor([0.01]) if activations == "static" else None
    codes, scales = quantize_fp8_rows(*_on(kernel_device, x), activations, *_on(kernel_device, scale))
    per_value = scales.cpu() if activations != "group" else scales.cpu().repeat_interleave(128, dim=1)
    assert codes.dtype == torch.float8_e4m3fn
    assert torch.equal(codes.cpu().float() * per_value, quantize_fp8_activations(x, activations, scale))


@pytest.mark.parametrize("block", [0, 128])
@pytest.mark.parametrize("activations", ["none", "token", "group", "static"])
@pytest.mark.parametrize("rows,dtype", [(1, torch.float32), (5, torch.bfloat16), (40, torch.float32)])
def test_fp8_gemm_equals_fp8_linear(block, activations, rows, dtype, kernel_device):
    """Decode (≤ 16 rows: split-K into fp32) and prefill tiles; K = 384 is three weight blocks and
    three activation groups, N = 200 a partial block."""
    elements, stored, _ = _float_weight("fp8-block" if block else "fp8", 200, 384, seed=rows)
    weight, w_scale = elements.to(torch.float8_e4m3fn), stored.float()
    gen = torch.Generator().manual_seed(7)
    bias = torch.randn(200, generator=gen)
    x = (torch.randn(rows, 384, generator=gen) * 2).to(dtype)
    input_scale = torch.tensor([0.02]) if activations == "static" else None
    args = (weight, w_scale, bias, block, activations, input_scale)
    want = fp8_linear(x, *args)
    got = kernels.fp8_linear(*_on(kernel_device, x, *args))
    assert got.dtype == dtype and got.shape == want.shape
    assert _gap(got, want) < TOLERANCE[dtype]


def test_fp8_kernels_name_what_they_cannot_take(kernel_device):
    elements, stored, _ = _float_weight("fp8", 16, 96)
    x = torch.randn(2, 96, device=kernel_device)
    weight = elements.to(torch.float8_e4m3fn).to(kernel_device)
    with pytest.raises(kernels.UnsupportedKernel, match="multiples of 128, got 96"):
        kernels.fp8_linear(x, weight, stored.to(kernel_device), None, 0, "group")
    with pytest.raises(kernels.UnsupportedKernel, match="weight blocks of 64"):
        kernels.fp8_linear(x, weight, stored.to(kernel_device), None, 64, "token")
    with pytest.raises(kernels.UnsupportedKernel, match="torch.float64 activations"):
        kernels.fp8_linear(x.double(), weight, stored.to(kernel_device), None, 0, "token")


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp4_dequantization_is_the_references_weight_bit_for_bit(name, dtype, kernel_device):
    """In float32 and fp16 (bf16 is left to a GPU run: the interpreter truncates fp32 -> bf16 where
    a GPU rounds to nearest)."""
    elements, stored, g = _float_weight(name, 72, 320)
    packed = pack_e2m1(elements)
    want = dequantize_nvfp4(packed, stored, g) if name == "nvfp4" else dequantize_mxfp4(packed, stored)
    got = dequantize_fp4(*_on(kernel_device, packed, stored, g), dtype)
    assert torch.equal(got.cpu(), want.to(dtype))


def test_every_e4m3_scale_byte_decodes_as_the_reference(kernel_device):
    """NVFP4's scales are decoded from their bytes in arithmetic (no fp8 type: any GPU): all 254
    finite e4m3 values — subnormals, zero, negatives — against the reference's dequantization."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # the two NaNs
    stored = codes.view(torch.float8_e4m3fn).reshape(16, 16)
    packed = torch.randint(0, 256, (16, 128), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    g = torch.tensor([3.0])
    got = dequantize_fp4(*_on(kernel_device, packed, stored, g), torch.float32)
    assert torch.equal(got.cpu(), dequantize_nvfp4(packed, stored, g))


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("rows,dtype", [(1, torch.float32), (3, torch.bfloat16), (18, torch.float32)])
def test_fp4_linear_equals_the_op(name, rows, dtype, kernel_device):
    """The GEMV up to FP4_GEMV_MAX_M rows (split-K into fp32), dequantize + matmul above."""
    assert (rows <= FP4_GEMV_MAX_M) == (rows < 4)
    elements, stored, g = _float_weight(name, 72, 320, seed=rows)
    packed = pack_e2m1(elements)
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(72, generator=gen)
    x = torch.randn(rows, 320, generator=gen).to(dtype)
    if name == "nvfp4":
        want = nvfp4_linear(x, packed, stored, g, bias)
        got = kernels.nvfp4_linear(*_on(kernel_device, x, packed, stored, g, bias))
    else:
        want = mxfp4_linear(x, packed, stored, bias)
        got = kernels.mxfp4_linear(*_on(kernel_device, x, packed, stored, bias))
    assert got.dtype == dtype and got.shape == want.shape
    assert _gap(got, want) < TOLERANCE[dtype]


def test_nvfp4_activation_rounding_is_bit_exact(kernel_device):
    """Groups of 16 at every magnitude, an all-zero group, a group whose e4m3 scale saturates at 448
    (inputs beyond the calibrated range: e2m1 saturates at 6) and one whose scale rounds to 0."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 320, generator=gen) * torch.logspace(-4, 2, 320)
    x[1, :16] = 0.0
    x[2, 16:32] *= 1e4
    x[3, 32:48] = 1e-12
    g = torch.tensor([448.0 * 6 / 50.0])
    got = quantize_nvfp4_rows(*_on(kernel_device, x, g))
    assert got.dtype == torch.float32 and torch.equal(got.cpu(), quantize_nvfp4_activations(x, g))


@pytest.mark.parametrize("rows,dtype", [(2, torch.float32), (9, torch.bfloat16)])
def test_nvfp4_w4a4_equals_the_op(rows, dtype, kernel_device):
    elements, stored, g = _float_weight("nvfp4", 40, 96)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, 96, generator=gen).to(dtype), torch.randn(40, generator=gen)
    args = (pack_e2m1(elements), stored, g, bias, torch.tensor([448.0 * 6 / 3.0]))
    want = nvfp4_linear(x, *args)
    got = kernels.nvfp4_linear(*_on(kernel_device, x, *args))
    assert got.dtype == dtype and _gap(got, want) < TOLERANCE[dtype]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
)
def test_fp8_kv_rounding_is_bit_exact(dtype, kernel_device):
    """Keys at every magnitude, beyond the calibrated range (saturating) and exact zeros (bf16 on a
    GPU only: the interpreter truncates fp32 -> bf16 where a GPU rounds to nearest)."""
    gen = torch.Generator().manual_seed(4)
    k = (torch.randn(2, 3, 37, 16, generator=gen) * torch.logspace(-3, 2, 16)).to(dtype)
    k[0, 0, 0] = 0.0
    scale = torch.tensor([0.05])
    got = kernels.fp8_kv_quant(*_on(kernel_device, k, scale))
    assert got.dtype == dtype and torch.equal(got.cpu(), fp8_kv_quant(k, scale))
