"""Triton kernel speed against torch fp16 matmul (cuBLAS), with a correctness check at full size.

    python benchmarks/kernel_speed.py            # on a CUDA GPU: LLM shapes at M = 1, 4, 16, 64, 512
    python benchmarks/kernel_speed.py --smoke    # tiny shapes (CPU: under TRITON_INTERPRET=1); checks the script, not speed

For each layer shape (in × out) and M it times, with ``triton.testing.do_bench_cudagraph`` (median
of CUDA-graph replays: no Python or launch overhead on either side), fp16 ``F.linear`` and each
kernel the ``triton`` backend runs, on the same fp16 activations: W4A16 g128, W4A16 g128
act-order, W3A16 g128 (all on the kernel layout through ``kernels.layout_linear``: the decode GEMV
at M = 1, the fused dequantizing GEMM below ``DEQUANT_MIN_M`` rows, dequantize + cuBLAS from it),
W8A8 per-token (activation quantizer + ``int8_gemm``), FP8 W8A8 per channel × per token and per
128 × 128 block × per-128 group (e4m3 rounding kernel + ``fp8_gemm`` on fp8 tensor cores), NVFP4 and
MXFP4 W4A16 (``fp4_gemv`` up to 4 rows, dequantize + cuBLAS above), SpQR w3g16 with 1 % random outliers
(outliers fused into the GEMV), W4A16 g128 on the stored GPTQ layout (``gptq_gemm``, the fallback
kernel), and two rows that decide the dispatch: the first GEMV (``layout_gemv.py``, K loop) at
M = 1 and the fused GEMM at M ≥ 16 (the dequant + cuBLAS crossover). Speed-up = fp16 time /
kernel time, measured side by side in one run. Effective bandwidth counts the bytes a kernel must
read once (the tensors it reads — the repacked layout where there is one — activations, output);
TFLOP/s counts 2·M·K·N. Before timing, each kernel's output is compared with its plain-torch
reference on the GPU. Rows run M-major (every shape at M = 1 first), so a time limit keeps the
decode figures. Writes benchmarks/results/kernels.json. Without a GPU it says so and writes that
instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import date
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "kernels.json"
SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (8192, 8192), (4096, 14336)]  # (in_features, out_features)
ROWS = [1, 16, 512, 4, 64]  # the decode figures first
PEAKS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12), "A100": (2.0e12, 312e12)}  # HBM B/s, fp16 FLOP/s


def gptq_case(k, n, bits, act_order, gen):
    from qcompiler.layouts.gptq import pack_gptq

    groups = k // 128
    codes = torch.randint(0, 2**bits, (n, k), generator=gen)
    scales = torch.rand(groups, n, generator=gen) * 0.01 + 0.001
    zeros = torch.randint(0, 2**bits, (groups, n), generator=gen).float()
    g_idx = (torch.arange(k) // 128).int()
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    w = pack_gptq(codes, scales, zeros, g_idx, bits, 128)
    return (w.qweight, w.qzeros, w.scales, w.g_idx), (bits, 128)


def spqr_case(k, n, gen, outlier_fraction=0.01):
    from qcompiler.algorithms.packing import pack_cols, pack_rows
    from qcompiler.layouts.spqr import to_csr

    groups = k // 16

    def stats():
        return torch.stack(
            [torch.rand(groups, n // 16, generator=gen) * 1e-3, torch.rand(groups, n // 16, generator=gen) * 1e-3], -1
        ).half()

    dense = (
        pack_rows(torch.randint(0, 8, (k, n), generator=gen), 3),
        pack_cols(torch.randint(0, 8, (groups, n), generator=gen), 3),
        pack_cols(torch.randint(0, 8, (groups, n), generator=gen), 3),
        stats(),
        stats(),
        torch.randperm(k, generator=gen).int(),
    )
    mask = torch.rand(n, k, generator=gen) < outlier_fraction
    return dense, to_csr(torch.randn(n, k, generator=gen), mask)


def stored_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def bench(fn, smoke: bool) -> float:
    """Median milliseconds of ``fn()`` replayed from a CUDA graph (one call first: autotuning and
    allocation happen outside the capture)."""
    if smoke:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def shape_cases(k, n, device, gen) -> dict:
    """label -> (kernel, reference, stored tensors, rows it applies to) for one layer shape."""
    from qcompiler import kernels
    from qcompiler.kernels import kernel_layout
    from qcompiler.kernels.layout_gemm import layout_gemm
    from qcompiler.kernels.layout_gemv import layout_gemv
    from qcompiler.layouts.gptq import quant_linear
    from qcompiler.layouts.int8 import int8_linear
    from qcompiler.layouts.spqr import sparse_outlier_linear, spqr_dense_linear

    every = lambda m: True  # noqa: E731
    cases = {}
    for label, bits, act in (("w4a16-g128", 4, False), ("w4a16-g128-act", 4, True), ("w3a16-g128", 3, False)):
        packed, (b, g) = gptq_case(k, n, bits, act, gen)
        packed = tuple(t.to(device) for t in packed)
        layout = kernel_layout.layout_from_gptq(*packed, b, g)
        reference = lambda x, p=packed, b=b, g=g: quant_linear(x.float(), *p, None, b, g)  # noqa: E731
        stored = tuple(layout.tensors().values())
        cases[label] = (lambda x, lay=layout: kernels.layout_linear(x, lay, None), reference, stored, every)
        if label == "w4a16-g128":
            cases["w4a16-g128-stored-layout"] = (
                lambda x, p=packed, b=b, g=g: kernels.gptq_linear(x, *p, None, b, g),
                reference,
                packed,
                every,
            )
            cases["w4a16-g128-first-gemv"] = (
                lambda x, lay=layout: layout_gemv(x[0], lay, None)[None],
                reference,
                stored,
                lambda m: m == 1,
            )
            cases["w4a16-g128-fused-gemm"] = (
                lambda x, lay=layout: layout_gemm(x, lay, None),
                reference,
                stored,
                lambda m: m >= 16,
            )
    wq = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8).to(device)
    ws = (torch.rand(n, generator=gen) * 1e-3).to(device)
    cases["w8a8"] = (
        lambda x: kernels.int8_linear(x, wq, ws, None, None, None),
        lambda x: int8_linear(x.float(), wq, ws, None, None, None),
        (wq, ws),
        every,
    )
    cases.update(float_cases(k, n, device, gen, every))
    dense, sparse = spqr_case(k, n, gen)
    dense, sparse = tuple(t.to(device) for t in dense), tuple(t.to(device) for t in sparse)
    spqr_layout = kernel_layout.layout_from_spqr(*dense, 3, 16, 3, 16, stat_dtype=torch.float16)
    outliers = kernel_layout.outliers_from_csr(*sparse, spqr_layout.perm, torch.float16)

    def spqr_ref(x, d=dense, s=sparse):
        x = x.float()
        return spqr_dense_linear(x, *d, None, 3, 16, 3, 16) + sparse_outlier_linear(x, *s, n)

    cases["spqr-w3g16-1%"] = (
        lambda x, lay=spqr_layout, o=outliers: kernels.layout_linear(x, lay, None, o),
        spqr_ref,
        tuple(spqr_layout.tensors().values()) + tuple(outliers.tensors().values()),
        every,
    )
    return cases


def float_cases(k, n, device, gen, every) -> dict:
    """FP8 W8A8 (per channel x per token; 128 x 128 blocks x per-128 groups) and FP4 W4A16 (NVFP4,
    MXFP4) on random stored tensors, each against its ``qc`` op's plain-torch reference."""
    from qcompiler import kernels
    from qcompiler.layouts.fp8 import fp8_linear
    from qcompiler.layouts.mxfp4 import mxfp4_linear
    from qcompiler.layouts.nvfp4 import nvfp4_linear

    cases = {}
    w8 = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).to(device)
    for label, block, acts, scale in (
        ("fp8-w8a8", 0, "token", torch.rand(n, 1, generator=gen) * 1e-4),
        ("fp8-block-w8a8", 128, "group", torch.rand(-(-n // 128), -(-k // 128), generator=gen) * 1e-4),
    ):
        scale = scale.to(device)
        cases[label] = (
            lambda x, b=block, a=acts, s=scale: kernels.fp8_linear(x, w8, s, None, b, a),
            lambda x, b=block, a=acts, s=scale: fp8_linear(x.float(), w8, s, None, b, a),
            (w8, scale),
            every,
        )
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8).to(device)
    nv_scale = (torch.rand(n, k // 16, generator=gen) * 400 + 1).to(torch.float8_e4m3fn).to(device)
    nv_global = torch.tensor([448.0 * 6 / 0.1]).to(device)
    mx_scale = torch.randint(118, 124, (n, k // 32), generator=gen, dtype=torch.uint8).to(device)
    cases["nvfp4-w4a16"] = (
        lambda x: kernels.nvfp4_linear(x, packed, nv_scale, nv_global, None),
        lambda x: nvfp4_linear(x.float(), packed, nv_scale, nv_global, None),
        (packed, nv_scale),
        every,
    )
    cases["mxfp4-w4a16"] = (
        lambda x: kernels.mxfp4_linear(x, packed, mx_scale, None),
        lambda x: mxfp4_linear(x.float(), packed, mx_scale, None),
        (packed, mx_scale),
        every,
    )
    return cases


def run(shapes, rows, device, smoke: bool, partial=lambda rows: None) -> list[dict]:
    """Every (M, shape) row, M-major; ``partial(rows_so_far)`` after each (a time limit keeps what was
    measured)."""
    gen = torch.Generator().manual_seed(0)
    peak_bw, peak_flops = (
        next((v for k, v in PEAKS.items() if k in torch.cuda.get_device_name()), (None, None))
        if device.type == "cuda"
        else (None, None)
    )
    layers = [(k, n, (torch.randn(n, k, generator=gen) * 0.02).half().to(device), shape_cases(k, n, device, gen))
              for k, n in shapes]  # fmt: skip
    results = []
    for m in rows:
        for k, n, w16, cases in layers:
            x = torch.randn(m, k, generator=gen).half().to(device)
            base_ms = bench(lambda: torch.nn.functional.linear(x, w16), smoke)
            row = {"in": k, "out": n, "M": m, "fp16_ms": base_ms}
            for label, (kernel, reference, stored, applies) in cases.items():
                if not applies(m):
                    continue
                try:
                    got, want = kernel(x).float(), reference(x)
                except Exception as exc:  # one broken kernel must not hide the others' figures
                    row[label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                    print(f"{label} M={m}: FAILED {row[label]['error']}", flush=True)
                    continue
                err = ((got - want).abs().max() / want.abs().max().clamp(min=1e-12)).item()
                ms = bench(lambda: kernel(x), smoke)
                moved = stored_bytes(stored) + x.numel() * 2 + m * n * 2
                entry = {
                    "ms": ms,
                    "speedup_vs_fp16": base_ms / ms,
                    "max_rel_err_vs_reference": err,
                    "GB_per_s": moved / ms / 1e6,
                    "TFLOP_per_s": 2 * m * k * n / ms / 1e9,
                }
                if peak_bw:
                    entry["bandwidth_fraction_of_peak"] = moved / ms * 1e3 / peak_bw
                    entry["flops_fraction_of_fp16_peak"] = 2 * m * k * n / ms * 1e3 / peak_flops
                row[label] = entry
            results.append(row)
            partial(results)
            print(
                f"{k:>6}x{n:<6} M={m:<4} fp16 {base_ms:8.4f} ms | "
                + " | ".join(
                    f"{label} {entry['speedup_vs_fp16']:.2f}x {entry['GB_per_s']:.0f} GB/s"
                    + (f" ({entry['bandwidth_fraction_of_peak']:.0%} HBM)" if peak_bw else "")
                    + f" (err {entry['max_rel_err_vs_reference']:.1e})"
                    for label, entry in row.items()
                    if isinstance(entry, dict) and "error" not in entry
                ),
                flush=True,
            )
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes under TRITON_INTERPRET=1 (no GPU needed)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    from qcompiler.files.atomic import write_text_atomically

    if args.smoke:
        gpu = torch.cuda.is_available()
        if not gpu:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        rows = run([(256, 128)], [1, 4, 16, 64], torch.device("cuda" if gpu else "cpu"), smoke=True)
        record = {"mode": "smoke: tiny shapes, timings are meaningless", "rows": rows}
    elif not torch.cuda.is_available():
        message = (
            "no CUDA GPU is present: the kernel benchmark needs one (GPU figures pending). "
            "Kernel correctness on CPU is covered by tests/test_triton_kernels.py under TRITON_INTERPRET=1."
        )
        print(message)
        record = {"gpu": None, "message": message}
    else:
        name = torch.cuda.get_device_name()
        print(f"device: {name}, torch {torch.__version__}")

        def record_of(rows):
            return {"gpu": name, "date": date.today().isoformat(), "torch": torch.__version__, "rows": rows}

        rows = run(
            SHAPES,
            ROWS,
            torch.device("cuda"),
            smoke=False,
            partial=lambda rows: write_text_atomically(args.out, json.dumps(record_of(rows), indent=1)),
        )
        record = record_of(rows)
    write_text_atomically(args.out, json.dumps(record, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
