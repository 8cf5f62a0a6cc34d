"""The kernels' weight layout (kernels/kernel_layout.py) and the kernels that read it.

The layout must stand for exactly the stored weight (bit-identical dequantization, in plain torch),
and the GEMV (one row), split-K GEMM (decode) and prefill GEMM on it must equal the ``qc`` reference
ops: every bit width, partial groups, act-order, per-channel, odd N and K, SpQR with its outliers,
MoE experts.
"""

import pytest
import torch
from kernel_problems import gptq_problem

from qcompiler.algorithms.spqr import spqr_quantize
from qcompiler.kernels import UnsupportedKernel
from qcompiler.kernels.decode_gemv import decode_gemv
from qcompiler.kernels.kernel_layout import (
    dequantize_layout,
    layout_from_gptq,
    layout_from_spqr,
    layout_linear_reference,
    outliers_from_csr,
    stack_experts,
)
from qcompiler.kernels.layout_dequant import dequantize_to_workspace
from qcompiler.kernels.layout_gemv import layout_gemv
from qcompiler.kernels.layout_linear import layout_experts_linear, layout_linear
from qcompiler.layouts.gptq import dequantize_gptq, quant_experts_linear, quant_linear
from qcompiler.layouts.spqr import dequantize_spqr_dense, pack_spqr, sparse_outlier_linear, spqr_dense_linear

FP32_TOL = dict(rtol=1e-5, atol=1e-4)
HALF_TOL = {torch.float16: dict(rtol=2e-2, atol=2e-2), torch.bfloat16: dict(rtol=5e-2, atol=1e-1)}

PROBLEMS = [  # bits, group, act_order, n_out, n_in
    (4, 128, False, 208, 352),  # 3 groups, the last partial
    (4, 32, True, 80, 96),  # act-order: rows sorted by group once
    (3, 48, False, 96, 160),  # 3-bit: 2-bit + 1-bit planes
    (3, 32, True, 96, 128),
    (2, 64, True, 48, 96),
    (8, -1, False, 40, 96),  # per-channel
    (4, 40, True, 72, 200),  # N and K off every block size (zeros pack along N: 8 per word)
    (8, 20, False, 36, 60),  # groups smaller than a tile; K = 60 pads to 64 rows
]


def _on(device, *tensors):
    return [t.to(device) if torch.is_tensor(t) else t for t in tensors]


@pytest.mark.parametrize("bits,group,act_order,n_out,n_in", PROBLEMS)
def test_layout_stands_for_exactly_the_stored_gptq_weight(bits, group, act_order, n_out, n_in):
    w, _ = gptq_problem(bits, group, act_order, n_out, n_in)
    layout = layout_from_gptq(w.qweight, w.qzeros, w.scales, w.g_idx, bits, group)
    assert torch.equal(dequantize_layout(layout), dequantize_gptq(w.qweight, w.qzeros, w.scales, w.g_idx, bits))
    assert (layout.perm is not None) == act_order
    words = layout.low.numel() + (layout.high.numel() if layout.high is not None else 0)
    assert words * 32 == -(-n_in // 32) * 32 * n_out * bits  # still ``bits`` per weight (rows padded to 32)


@pytest.mark.parametrize("bits,group,act_order,n_out,n_in", PROBLEMS)
@pytest.mark.parametrize("rows", [1, 7, 45, 70])  # GEMV, split-K GEMM, prefill GEMM, dequant + matmul
def test_layout_kernels_equal_quant_linear(bits, group, act_order, n_out, n_in, rows, kernel_device):
    w, bias = gptq_problem(bits, group, act_order, n_out, n_in)
    layout = layout_from_gptq(*_on(kernel_device, w.qweight, w.qzeros, w.scales, w.g_idx), bits, group)
    x = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(rows))
    want = quant_linear(x, w.qweight, w.qzeros, w.scales, w.g_idx, bias, bits, group)
    got = layout_linear(x.to(kernel_device), layout, bias.to(kernel_device))
    torch.testing.assert_close(got.cpu(), want, **FP32_TOL)


@pytest.mark.parametrize("rows", range(1, 18))  # the decode GEMV, then the split-K GEMM per M, then prefill
def test_every_decode_batch_size_equals_quant_linear(rows, kernel_device):
    w, bias = gptq_problem(3, 32, True, 96, 160, seed=7)
    layout = layout_from_gptq(*_on(kernel_device, w.qweight, w.qzeros, w.scales, w.g_idx), 3, 32)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    want = quant_linear(x, w.qweight, w.qzeros, w.scales, w.g_idx, bias, 3, 32)
    torch.testing.assert_close(
        layout_linear(x.to(kernel_device), layout, bias.to(kernel_device)).cpu(), want, **FP32_TOL
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 33, 64])
def test_layout_kernels_take_half_precision_activations(dtype, rows, kernel_device):
    w, bias = gptq_problem(3, 32, True, 96, 128)
    layout = layout_from_gptq(*_on(kernel_device, w.qweight, w.qzeros, w.scales, w.g_idx), 3, 32)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = quant_linear(x.float(), w.qweight, w.qzeros, w.scales, w.g_idx, bias, 3, 32)
    got = layout_linear(x.to(kernel_device), layout, bias.to(kernel_device, dtype))
    assert got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), want, **HALF_TOL[dtype])


def _spqr(n_out=160, n_in=160, seed=0):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(512, n_in, generator=gen) @ (torch.randn(n_in, n_in, generator=gen) * 0.3)
    W = torch.randn(n_out, n_in, generator=gen)
    W[3, 7], W[10, 50], W[40, 99] = 12.0, -9.0, 7.5
    t = pack_spqr(spqr_quantize(W, 2 * X.T @ X / X.shape[0], outlier_threshold=0.3), 3, 3)
    dense = [t[k] for k in ("codes", "scale_codes", "zero_codes", "scale_stats", "zero_stats", "perm")]
    return dense, (t["row_ptr"], t["col_idx"], t["values"])


@pytest.mark.parametrize("rows", [1, 9, 50, 64])  # one row: outliers fused into the GEMV
def test_spqr_layout_with_its_outliers_equals_dense_plus_sparse(rows, kernel_device):
    dense, sparse = _spqr()
    layout = layout_from_spqr(*_on(kernel_device, *dense), 3, 16, 3, 16)
    assert torch.equal(dequantize_layout(layout).cpu(), dequantize_spqr_dense(*dense, 3, 16, 3, 16))
    outliers = outliers_from_csr(*_on(kernel_device, *sparse), layout.perm, torch.float32)
    assert outliers.rows.numel() > 100  # the test problem has outliers to fuse
    bias = torch.randn(160)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    want = spqr_dense_linear(x, *dense, bias, 3, 16, 3, 16) + sparse_outlier_linear(x, *sparse, 160)
    got = layout_linear(x.to(kernel_device), layout, bias.to(kernel_device), outliers)
    torch.testing.assert_close(got.cpu(), want, **FP32_TOL)


@pytest.mark.parametrize("bits,group,act_order,n_out,n_in", PROBLEMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_gemv_in_half_precision_equals_the_plain_torch_twin(bits, group, act_order, n_out, n_in, dtype,
                                                                    kernel_device):  # fmt: skip
    """fp16: codes through the fp16 magic number, products in fp16, partial sums added in fp16;
    bf16: the fp32 magic. Within the half-precision tolerance of the fp32 twin, every bit width."""
    w, bias = gptq_problem(bits, group, act_order, n_out, n_in, seed=3)
    scales = w.scales.half()  # GPTQ's stored scales are fp16 (exact in the fp16 path)
    layout = layout_from_gptq(*_on(kernel_device, w.qweight, w.qzeros, scales, w.g_idx), bits, group)
    x = torch.randn(n_in, generator=torch.Generator().manual_seed(bits)).to(dtype)
    want = layout_linear_reference(x.float().to(kernel_device), layout, bias.to(kernel_device))
    got = decode_gemv(x.to(kernel_device), layout, bias.to(kernel_device, dtype))
    assert got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), want.cpu(), **HALF_TOL[dtype])


@pytest.mark.parametrize("bits,group,act_order,n_out,n_in", PROBLEMS)
def test_prefill_workspace_is_the_twins_weight_bit_for_bit(bits, group, act_order, n_out, n_in, kernel_device):
    """The dequantized workspace cuBLAS reads from DEQUANT_MIN_M rows on: rows in layout order."""
    w, _ = gptq_problem(bits, group, act_order, n_out, n_in, seed=5)
    layout = layout_from_gptq(*_on(kernel_device, w.qweight, w.qzeros, w.scales, w.g_idx), bits, group)
    want = dequantize_layout(layout).t()
    if layout.perm is not None:
        want = want[layout.perm]
    assert torch.equal(dequantize_to_workspace(layout, torch.float32), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_gemv_adds_spqr_outliers_through_the_permutation(dtype, kernel_device):
    """Outliers' columns are layout rows: the kernel reads ``x[perm[col]]`` from column-order x."""
    dense, sparse = _spqr()
    layout = layout_from_spqr(*_on(kernel_device, *dense), 3, 16, 3, 16, stat_dtype=dtype)
    outliers = outliers_from_csr(*_on(kernel_device, *sparse), layout.perm, dtype)
    x = torch.randn(160, generator=torch.Generator().manual_seed(4))
    want = spqr_dense_linear(x[None], *dense, None, 3, 16, 3, 16) + sparse_outlier_linear(x[None], *sparse, 160)
    got = decode_gemv(x.to(kernel_device, dtype), layout, None, outliers)
    torch.testing.assert_close(got.float().cpu(), want[0], **(HALF_TOL[dtype] if dtype != torch.float32 else FP32_TOL))


@pytest.mark.parametrize("bits,group,act_order,n_out,n_in", PROBLEMS[:4])
def test_first_gemv_still_equals_the_twin(bits, group, act_order, n_out, n_in, kernel_device):
    """The K-loop GEMV the benchmark times beside the decode GEMV (x gathered into layout order first)."""
    w, bias = gptq_problem(bits, group, act_order, n_out, n_in)
    layout = layout_from_gptq(*_on(kernel_device, w.qweight, w.qzeros, w.scales, w.g_idx), bits, group)
    x = torch.randn(n_in, generator=torch.Generator().manual_seed(1)).to(kernel_device)
    rows = x if layout.perm is None else x.index_select(0, layout.perm)
    got = layout_gemv(rows.contiguous(), layout, bias.to(kernel_device))
    torch.testing.assert_close(got.cpu(), layout_linear_reference(x, layout, bias.to(kernel_device)).cpu(), **FP32_TOL)


@pytest.mark.parametrize("counts", [[1, 0, 1, 1], [5, 0, 3, 9]])  # GEMV per expert; GEMMs
def test_stacked_expert_layouts_equal_quant_experts_linear(counts, kernel_device):
    """Act-order in some experts only (the others get the identity permutation), an empty expert."""
    problems = [gptq_problem(4, 32, act, 48, 96, seed=e)[0] for e, act in enumerate((True, False, True, False))]
    stored = [torch.stack([getattr(p, f) for p in problems]) for f in ("qweight", "qzeros", "scales", "g_idx")]
    layout = stack_experts([layout_from_gptq(*_on(kernel_device, *tensors), 4, 32) for tensors in zip(*stored)])
    x = torch.randn(sum(counts), 96, generator=torch.Generator().manual_seed(5))
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    want = quant_experts_linear(x, offsets, *stored, 4, 32)
    got = layout_experts_linear(x.to(kernel_device), offsets.to(kernel_device), layout)
    torch.testing.assert_close(got.cpu(), want, **FP32_TOL)


def test_weights_the_layout_cannot_hold_are_refused_by_name():
    w, _ = gptq_problem(4, 20, False, 16, 40)  # 20 rows: not whole words of 8 codes
    with pytest.raises(UnsupportedKernel, match="groups of 20 rows are not a multiple of the 8 rows"):
        layout_from_gptq(w.qweight, w.qzeros, w.scales, w.g_idx, 4, 20)
    w, _ = gptq_problem(4, 32, False, 16, 96)
    uneven = w.g_idx.clone()
    uneven[:40] = 0  # group 0 holds 40 rows, group 1 only 24
    with pytest.raises(UnsupportedKernel, match="g_idx does not assign 32 rows to each group"):
        layout_from_gptq(w.qweight, w.qzeros, w.scales, uneven, 4, 32)
