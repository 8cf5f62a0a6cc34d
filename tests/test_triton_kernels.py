"""Every Triton kernel equals its plain-torch reference op (CPU: under TRITON_INTERPRET=1).

Shapes are small and deliberately not multiples of the block sizes; act-order permutations, odd
group counts, decode (split-K) and prefill variants, and fp16/bf16 activations are covered.
"""

import pytest
import torch
from kernel_problems import gptq_problem

from qcompiler import kernels
from qcompiler.algorithms.hadamard import random_signs
from qcompiler.algorithms.int8 import quantize_per_token
from qcompiler.algorithms.spqr import spqr_quantize
from qcompiler.ir.ops import hadamard
from qcompiler.layouts.gptq import quant_linear
from qcompiler.layouts.int8 import int8_linear
from qcompiler.layouts.spqr import pack_spqr, sparse_outlier_linear, spqr_dense_linear, to_csr

FP32_TOL = dict(rtol=1e-5, atol=1e-4)
HALF_TOL = {torch.float16: dict(rtol=2e-2, atol=2e-2), torch.bfloat16: dict(rtol=5e-2, atol=1e-1)}


@pytest.mark.parametrize(
    "bits,group,act_order,n_out,n_in",
    [
        (4, 128, False, 208, 352),  # 3 groups, the last one partial; several N and K tiles, partial
        (4, 32, True, 80, 96),  # act-order: groups scattered over the columns
        (3, 48, False, 96, 160),  # 3-bit codes straddle words; 4 groups, the last partial
        pytest.param(3, 32, True, 96, 128, marks=pytest.mark.slow),
        pytest.param(2, 64, True, 48, 96, marks=pytest.mark.slow),
        pytest.param(8, -1, False, 40, 96, marks=pytest.mark.slow),  # per-channel
    ],
)  # the stored-layout kernel is now the fallback; tests/test_kernel_layout.py covers every case on the layout
@pytest.mark.parametrize("rows", [1, 7, 45])  # decode (split-K) and prefill variants
def test_gptq_gemm_equals_quant_linear(bits, group, act_order, n_out, n_in, rows, kernel_device):
    w, bias = gptq_problem(bits, group, act_order, n_out, n_in)
    x = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(rows))
    args = (w.qweight, w.qzeros, w.scales, w.g_idx, bias, bits, group)
    ref = quant_linear(x, *args)
    got = kernels.gptq_linear(x.to(kernel_device), *[a.to(kernel_device) if torch.is_tensor(a) else a for a in args])
    torch.testing.assert_close(got.cpu(), ref, **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 33])
def test_gptq_gemm_half_precision_activations(dtype, rows, kernel_device):
    w, bias = gptq_problem(4, 32, True, 80, 96)
    x = torch.randn(2, rows, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    args = (w.qweight, w.qzeros, w.scales, w.g_idx, bias, 4, 32)
    ref = quant_linear(x.float(), *args)
    got = kernels.gptq_linear(x.to(kernel_device), *[a.to(kernel_device) if torch.is_tensor(a) else a for a in args])
    assert got.dtype == dtype and got.shape == (2, rows, 80)
    torch.testing.assert_close(got.float().cpu(), ref, **HALF_TOL[dtype])


def spqr_tensors(n_out=160, n_in=160, seed=0):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(512, n_in, generator=gen) @ (torch.randn(n_in, n_in, generator=gen) * 0.3)
    W = torch.randn(n_out, n_in, generator=gen)
    W[3, 7], W[10, 50], W[40, 99] = 12.0, -9.0, 7.5
    return pack_spqr(spqr_quantize(W, 2 * X.T @ X / X.shape[0], outlier_threshold=0.3), 3, 3)


@pytest.mark.parametrize("rows", [1, 9, 50])
def test_spqr_dense_gemm_equals_reference(rows, kernel_device):
    t = spqr_tensors()
    dense = (t["codes"], t["scale_codes"], t["zero_codes"], t["scale_stats"], t["zero_stats"], t["perm"])
    bias = torch.randn(160)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    ref = spqr_dense_linear(x, *dense, bias, 3, 16, 3, 16)
    got = kernels.spqr_dense_linear(
        x.to(kernel_device), *[a.to(kernel_device) for a in dense], bias.to(kernel_device), 3, 16, 3, 16
    )
    torch.testing.assert_close(got.cpu(), ref, **FP32_TOL)


@pytest.mark.parametrize("rows", [1, 37])
def test_csr_spmm_equals_reference_and_accumulates(rows, kernel_device):
    gen = torch.Generator().manual_seed(rows)
    values = torch.randn(70, 90, generator=gen)
    mask = torch.rand(70, 90, generator=gen) < 0.05
    mask[5] = False  # empty rows
    mask[6, :40] = True  # one long row
    row_ptr, col_idx, vals = to_csr(values, mask)
    x = torch.randn(rows, 90, generator=gen)
    ref = sparse_outlier_linear(x, row_ptr, col_idx, vals, 70)
    dev = [a.to(kernel_device) for a in (x, row_ptr, col_idx, vals)]
    torch.testing.assert_close(kernels.csr_linear(*dev, 70).cpu(), ref, **FP32_TOL)
    base = torch.randn(rows, 70, generator=gen)
    out = base.clone().to(kernel_device)
    kernels.csr_linear(*dev, 70, out=out)
    torch.testing.assert_close(out.cpu(), base + ref, **FP32_TOL)


@pytest.mark.parametrize("rows,cols", [(1, 300), (13, 77)])
def test_activation_quantizer_is_bit_exact(rows, cols, kernel_device):
    x = torch.randn(rows, cols) * torch.linspace(0.1, 20, cols)
    smooth = torch.rand(cols) + 0.5
    q, s = kernels.quantize_rows(x.to(kernel_device), smooth.to(kernel_device))
    q_ref, s_ref = quantize_per_token(x * smooth)
    assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)
    static = torch.tensor([0.05])
    q, _ = kernels.quantize_rows(x.to(kernel_device), None, static.to(kernel_device))
    assert torch.equal(q.cpu(), torch.clamp(torch.round(x / 0.05), -127, 127).to(torch.int8))


@pytest.mark.parametrize(
    "rows,width,block,dtype", [(1, 64, 64, torch.float32), (21, 192, 64, torch.float32), (5, 128, 128, torch.float16)]
)
def test_hadamard_kernel_equals_the_reference_op(rows, width, block, dtype, kernel_device):
    x = (torch.randn(rows, width) * torch.linspace(0.1, 30, width)).to(dtype)
    signs = random_signs(width, 3)
    got = kernels.hadamard(x.to(kernel_device), signs.to(kernel_device), block).cpu()
    torch.testing.assert_close(
        got, hadamard(x, signs, block), **(FP32_TOL if dtype == torch.float32 else HALF_TOL[dtype])
    )


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("rows", [1, 40])
def test_int8_gemm_equals_int8_linear(static, rows, kernel_device):
    gen = torch.Generator().manual_seed(rows)
    n_out, n_in = 72, 136
    weight = torch.randint(-127, 128, (n_out, n_in), generator=gen, dtype=torch.int8)
    w_scale, bias = torch.rand(n_out, generator=gen) * 0.01, torch.randn(n_out, generator=gen)
    act_scale = torch.tensor([0.03]) if static else None
    smooth = None if static else torch.rand(n_in, generator=gen) + 0.5
    x = torch.randn(2, rows, n_in, generator=gen)
    args = (weight, w_scale, bias, act_scale, smooth)
    ref = int8_linear(x, *args)
    got = kernels.int8_linear(x.to(kernel_device), *[a.to(kernel_device) if a is not None else None for a in args])
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-6, atol=1e-5)


def test_unsupported_combination_is_named(kernel_device):
    w, bias = gptq_problem(4, 32, False, 80, 96)
    x = torch.randn(3, 96, dtype=torch.float64, device=kernel_device)
    with pytest.raises(kernels.UnsupportedKernel, match="gptq_gemm: torch.float64 activations"):
        kernels.gptq_linear(x, *[a.to(kernel_device) for a in (w.qweight, w.qzeros, w.scales, w.g_idx)], None, 4, 32)
    with pytest.raises(kernels.UnsupportedKernel, match="5-bit weights"):
        kernels.gptq_linear(
            x.float(), *[a.to(kernel_device) for a in (w.qweight, w.qzeros, w.scales, w.g_idx)], None, 5, 32
        )


@pytest.mark.slow  # 15 s of interpreter; each kernel it times has its own default-tier twin test above
def test_kernel_benchmark_runs_and_checks_correctness(tmp_path):
    """benchmarks/kernel_speed.py --smoke: the GPU benchmark's code path on tiny shapes (timings meaningless)."""
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "kernels_bench", Path(__file__).parents[1] / "benchmarks" / "kernel_speed.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "kernels.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    labels = ["w4a16-g128", "w4a16-g128-stored-layout", "w4a16-g128-act", "w3a16-g128", "w8a8", "spqr-w3g16-1%"]
    labels += ["fp8-w8a8", "fp8-block-w8a8", "nvfp4-w4a16", "mxfp4-w4a16"]
    assert [r["M"] for r in rows] == [1, 4, 16, 64]  # decode GEMV, split-K GEMM (2), dequant + matmul
    assert all(r[label]["max_rel_err_vs_reference"] < 1e-2 for r in rows for label in labels)  # fp16 activations
    assert [r["M"] for r in rows if "w4a16-g128-first-gemv" in r] == [1]  # the dispatch-deciding rows
    assert [r["M"] for r in rows if "w4a16-g128-fused-gemm" in r] == [16, 64]
    assert all(r[label]["max_rel_err_vs_reference"] < 1e-2 for r in rows for label in r if label.endswith("gemm"))


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
)
@pytest.mark.parametrize("variant", ["dynamic", "smooth", "static"])
def test_rmsnorm_quantizer_equals_the_graphs_norm_then_the_quantizer(dtype, variant, kernel_device):
    """The fused RMSNorm + int8 quantizer against the captured norm's ops and ``int8_linear``'s
    quantizer in plain torch: only the sum of squares adds in another order, so a code may move by
    one at a rounding boundary (bound: 0.5 % of codes; measured under the interpreter: none). bf16
    only on a GPU: the interpreter rounds bf16 casts its own way."""
    from qcompiler.kernels.norm_quant import rmsnorm_quantize_reference

    g = torch.Generator().manual_seed(3)
    h = (torch.randn(7, 300, generator=g) * 3).to(dtype)
    w = (torch.rand(300, generator=g) + 0.5).to(dtype)
    smooth = torch.rand(300, generator=g) + 0.5 if variant == "smooth" else None
    static = torch.tensor([0.05]) if variant == "static" else None
    args = (1e-6, dtype, dtype)
    want_q, want_s = rmsnorm_quantize_reference(h, w, *args, smooth, static)
    on = [t.to(kernel_device) if t is not None else None for t in (h, w, smooth, static)]
    got_q, got_s = kernels.rmsnorm_quantize_rows(on[0], on[1], *args, on[2], on[3])
    moved = (got_q.cpu().int() - want_q.reshape(got_q.shape).int()).abs()
    assert int(moved.max()) <= 1 and float((moved > 0).float().mean()) <= 0.005
    torch.testing.assert_close(got_s.cpu().reshape(-1), want_s.reshape(-1), rtol=1e-6, atol=0)
