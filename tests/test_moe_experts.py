"""Mixture-of-experts: 3-D expert parameters quantized per expert (qcompiler/ir/experts.py)."""

import warnings

import pytest
import torch
from causal_lms import calibration, causal_lm, prompt

import qcompiler as qc
from qcompiler.algorithms.gptq import rtn_quantize
from qcompiler.evaluation.eval import bits_per_parameter
from qcompiler.frontend.causal_lm import graph_inputs
from qcompiler.ir.experts import find_expert_linears
from qcompiler.layouts.gptq import pack_gptq

QEXPERTS = torch.ops.qc.quant_experts_linear.default


def _compile(model, recipe, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qc.compile(model, {"input_ids": prompt()}, recipe=recipe, progress=False, **kw)


def _expert_rows(cm):
    return {row["layer"]: row for row in cm.report.layer_table() if ".experts." in row["layer"]}


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_every_expert_parameter_is_found(arch):
    fp = _compile(causal_lm(arch), "none")
    found = find_expert_linears(fp.graph_module)
    assert [e.path for e in found] == [
        f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")
    ]
    assert all(e.num_experts == 4 for e in found)
    inter = 128 if arch == "mixtral" else 64
    assert (found[0].out_features, found[0].in_features) == (2 * inter, 64)
    assert (found[1].out_features, found[1].in_features) == (64, inter)


def test_quant_experts_linear_equals_each_expert_matmul():
    """The op against the straightforward reference: each expert's rows times its dequantized
    weight (from the RTN result, not from the packed tensors), an expert with no rows included."""
    torch.manual_seed(0)
    E, n_in, n_out, bits, group = 3, 64, 48, 4, 32
    weights = torch.randn(E, n_out, n_in)
    results = [rtn_quantize(w, bits=bits, group_size=group) for w in weights]
    packed = [pack_gptq(r.codes, r.scales, r.zeros, r.g_idx, bits, group) for r in results]
    stacked = [torch.stack([getattr(p, f) for p in packed]) for f in ("qweight", "qzeros", "scales", "g_idx")]
    counts = [5, 0, 3]
    x = torch.randn(sum(counts), n_in)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    got = QEXPERTS(x, offsets, *stacked, bits, group)
    want = torch.cat([x[:5] @ results[0].dequantized.t(), x[5:] @ results[2].dequantized.t()])
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)  # scales are stored in fp16


@pytest.mark.parametrize("act_order,group", [(False, 32), (True, 16)])
def test_onnx_experts_layout_equals_the_quantized_experts_op(act_order, group):
    """The MatMulNBits re-packing of quantized experts (what the ONNX export runs) against
    ``qc.quant_experts_linear``: act-order permutations per expert, an empty expert, and rows past
    the last offset (zero in both)."""
    from qcompiler.algorithms.gptq import gptq_quantize
    from qcompiler.backends.onnx_nbits import experts_matmul_nbits, gptq_to_nbits

    torch.manual_seed(2)
    E, n_in, n_out, bits = 3, 64, 32, 3
    results = []
    for w in torch.randn(E, n_out, n_in):
        X = torch.randn(256, n_in) * torch.linspace(0.1, 3, n_in)
        results.append(gptq_quantize(w, X.t() @ X, bits=bits, group_size=group, act_order=act_order))
    packed = [pack_gptq(r.codes, r.scales, r.zeros, r.g_idx, bits, group) for r in results]
    stacked = [torch.stack([getattr(p, f) for p in packed]) for f in ("qweight", "qzeros", "scales", "g_idx")]
    lowered = [gptq_to_nbits(*(s[e] for s in stacked), bits, group) for e in range(E)]
    assert all((lw[1] is not None) == act_order for lw in lowered)
    nbits = {name: torch.stack([lw[0][name] for lw in lowered]) for name in ("B", "scales", "zero_points")}
    perm = torch.stack([lw[1] for lw in lowered]) if act_order else None
    x = torch.randn(9, n_in)
    offsets = torch.tensor([4, 4, 7], dtype=torch.int32)  # expert 1 gets no rows; rows 7, 8 none
    got = experts_matmul_nbits(
        x, offsets, nbits["B"], nbits["scales"], nbits["zero_points"], perm, n_in, n_out, lowered[0][4], lowered[0][5]
    )
    torch.testing.assert_close(got, QEXPERTS(x, offsets, *stacked, bits, group), rtol=1e-4, atol=1e-4)
    assert not got[7:].any()


def test_triton_experts_kernel_equals_the_reference_op(kernel_device):
    from qcompiler.kernels import gptq_experts_linear

    torch.manual_seed(1)
    E, n_in, n_out, bits, group = 3, 64, 32, 4, 32
    packed = [
        pack_gptq(r.codes, r.scales, r.zeros, r.g_idx, bits, group)
        for r in (rtn_quantize(w, bits=bits, group_size=group) for w in torch.randn(E, n_out, n_in))
    ]
    stacked = [
        torch.stack([getattr(p, f) for p in packed]).to(kernel_device) for f in ("qweight", "qzeros", "scales", "g_idx")
    ]
    x = torch.randn(6, n_in, device=kernel_device)
    offsets = torch.tensor([2, 2, 6], dtype=torch.int32, device=kernel_device)
    want = QEXPERTS(x, offsets, *stacked, bits, group)
    torch.testing.assert_close(gptq_experts_linear(x, offsets, *stacked, bits, group), want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def mixtral():
    return causal_lm("mixtral")


@pytest.fixture(scope="module")
def mixtral_gptq(mixtral):
    return _compile(mixtral, "gptq-w4g128", calibration=calibration())


def test_gptq_quantizes_every_expert_from_its_routed_tokens(mixtral, mixtral_gptq):
    rows = _expert_rows(mixtral_gptq)
    assert len(rows) == 2 * 2 * 4  # layers x (gate_up, down) x experts: every expert matrix reported
    gm = mixtral_gptq.graph_module
    assert sum(n.target is QEXPERTS for n in gm.graph.nodes) == 4
    assert not find_expert_linears(gm)  # no FP expert weight is left
    tokens, top_k = 4 * 32, 2
    for layer in (0, 1):
        routed = [rows[f"model.layers.{layer}.mlp.experts.gate_up_proj.{e}"]["calib_rows"] for e in range(4)]
        assert sum(routed) == tokens * top_k  # each token reaches exactly top_k experts
    # GPTQ's guarantee is a lower Hessian-weighted error than rounding, expert by expert on average.
    rtn = _expert_rows(_compile(mixtral, "rtn-w4g128", calibration=calibration()))
    gptq_err = sum(r["rel_error"] for r in rows.values())
    rtn_err = sum(r["rel_error"] for r in rtn.values())
    assert gptq_err < 0.9 * rtn_err, (gptq_err, rtn_err)
    fp = _compile(mixtral, "none")
    ids = prompt()
    ref = fp(input_ids=ids).logits
    rel = ((mixtral_gptq(input_ids=ids).logits - ref).norm() / ref.norm()).item()
    assert 1e-4 < rel < 0.3, rel
    # Bits per parameter count the experts: 4-bit codes + an fp16 scale and a 4-bit zero per group
    # of <= 128 input columns, over attention projections and expert matrices (routers stay FP).
    mats = []  # (count, out, in)
    for name, p in mixtral.named_parameters():
        if name.endswith("_proj.weight"):
            mats.append((1, *p.shape))
        elif ".experts." in name:
            mats.append(tuple(p.shape))  # [E, out, in]
    bits = sum(n * o * (4 * i + 20 * -(-i // 128)) for n, o, i in mats)
    weights = sum(n * o * i for n, o, i in mats)
    assert bits_per_parameter(gm) == pytest.approx(bits / weights, rel=1e-9)


def test_expert_without_calibration_tokens_falls_back_to_rtn_with_a_note(mixtral):
    one_token = [{"input_ids": torch.tensor([[5]])}]  # routed to 2 of the 4 experts in each layer
    cm = _compile(mixtral, "gptq-w4g128", calibration=one_token)
    rows = _expert_rows(cm)
    assert len(rows) == 16
    empty = [path for path, row in rows.items() if row["calib_rows"] == 0]
    assert len(empty) == 2 * 2 * 2, empty  # per layer and parameter, the two experts the token skipped
    notes = " ".join(cm.report.passes[0].notes)
    for path in empty:
        assert f"{path}: received no calibration tokens, quantized with RTN" in notes
        assert rows[path]["fallback"] == "RTN"


def test_ignore_keeps_experts_in_full_precision(mixtral):
    cm = _compile(mixtral, [qc.passes.RTN(ignore=("*.experts.*",))])
    assert not _expert_rows(cm)
    assert len(find_expert_linears(cm.graph_module)) == 4
    assert any(".self_attn.q_proj" in row["layer"] for row in cm.report.layer_table())


def _spqr_experts(E=3, n_in=64, n_out=64, seed=3):
    """Three experts' SpQR results (outliers at a low threshold) and their stacked op tensors
    (64 outputs: four statistic groups of 16, so a wrong output width shows)."""
    from qcompiler.algorithms.spqr import spqr_quantize
    from qcompiler.layouts import LayerQuant, LayerRewrite
    from qcompiler.layouts.spqr import SPQR, pack_spqr

    torch.manual_seed(seed)
    results = []
    for w in torch.randn(E, n_out, n_in):
        X = torch.randn(256, n_in) * torch.linspace(0.1, 3, n_in)
        results.append(
            spqr_quantize(w, X.t() @ X, bits=3, group_size=16, stat_bits=3, stat_group_size=16, outlier_threshold=0.3)
        )
    rewrite = LayerRewrite("spqr", dict(bits=3, group_size=16, stat_bits=3, stat_group_size=16, out_features=n_out))
    op, tensors, constants = SPQR.experts_stack([LayerQuant(None, {}, pack_spqr(r, 3, 3), rewrite) for r in results])
    assert op == "spqr_experts_linear" and all(r.outliers.any() for r in results)
    return results, tensors, constants


def test_spqr_experts_linear_equals_each_expert_dense_plus_outliers():
    """The op against the straightforward reference: each expert's rows times its SpQR weight
    (dense branch + its own outliers, from the algorithm's result, not from the packed tensors)."""
    results, tensors, constants = _spqr_experts()
    counts = [5, 0, 3]
    x = torch.randn(sum(counts), 64)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    got = torch.ops.qc.spqr_experts_linear(x, offsets, **tensors, **constants)
    want = torch.cat([x[:5] @ results[0].dequantized.t(), x[5:] @ results[2].dequantized.t()])
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)  # statistics and outliers are stored in fp16


def test_triton_spqr_experts_kernel_equals_the_reference_op(kernel_device):
    from qcompiler.kernels import spqr_experts_linear

    _, tensors, constants = _spqr_experts(n_in=32)
    tensors = {k: v.to(kernel_device) for k, v in tensors.items()}
    x = torch.randn(6, 32, device=kernel_device)
    offsets = torch.tensor([2, 2, 6], dtype=torch.int32, device=kernel_device)
    want = torch.ops.qc.spqr_experts_linear(x, offsets, **tensors, **constants)
    torch.testing.assert_close(spqr_experts_linear(x, offsets, **tensors, **constants), want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def mixtral_spqr(mixtral):
    return _compile(mixtral, "spqr-w3g16", calibration=calibration())


def test_spqr_quantizes_every_expert_with_its_own_outliers(mixtral, mixtral_spqr, tmp_path):
    rows = _expert_rows(mixtral_spqr)
    assert len(rows) == 16 and all(0 < r["outlier_fraction"] < 0.05 for r in rows.values())
    gm = mixtral_spqr.graph_module
    assert sum(n.target is torch.ops.qc.spqr_experts_linear.default for n in gm.graph.nodes) == 4
    assert not find_expert_linears(gm)
    # SpQR's Hessian-aware 3-bit experts beat rounding each expert to the same grid
    rtn = _expert_rows(_compile(mixtral, [qc.passes.RTN(bits=3, group_size=16)], calibration=calibration()))
    assert sum(r["rel_error"] for r in rows.values()) < 0.9 * sum(r["rel_error"] for r in rtn.values())
    # bit accounting: the stacked op stores exactly what each expert reported
    shapes = dict(mixtral.named_parameters())
    per_row = []  # (bits per weight, weights) of every quantized matrix
    for row in mixtral_spqr.report.layer_table():
        path = row["layer"]
        if ".experts." in path:
            out, inp = shapes[path.rsplit(".", 1)[0]].shape[1:]
        else:
            out, inp = shapes[f"{path}.weight"].shape
        per_row.append((row["bits_per_weight"], out * inp))
    expected = sum(b * n for b, n in per_row) / sum(n for _, n in per_row)
    assert bits_per_parameter(gm) == pytest.approx(expected, rel=1e-9)
    # the ONNX re-packing (MatMulNBits per expert + gathered outlier blocks) computes the same logits
    from qcompiler.backends.onnx_layout import lower_for_onnx

    ids = prompt(batch=2)
    lowered, _ = lower_for_onnx(gm)
    targets = {n.target for n in lowered.graph.nodes}
    assert torch.ops.qc.experts_gathered_outlier_linear.default in targets
    assert torch.ops.qc.spqr_experts_linear.default not in targets
    inputs = graph_inputs(mixtral_spqr.cache_layout, ids)
    torch.testing.assert_close(lowered(**inputs)[0], gm(**inputs)[0], rtol=1e-4, atol=1e-4)
    mixtral_spqr.save(tmp_path / "art")
    assert torch.equal(qc.load(tmp_path / "art")(input_ids=ids).logits, mixtral_spqr(input_ids=ids).logits)


def test_spqr_expert_without_calibration_tokens_uses_an_identity_hessian(mixtral):
    cm = _compile(mixtral, "spqr-w3g16", calibration=[{"input_ids": torch.tensor([[5]])}])
    empty = [path for path, row in _expert_rows(cm).items() if row["calib_rows"] == 0]
    assert len(empty) == 8
    notes = " ".join(cm.report.passes[0].notes)
    for path in empty:
        assert f"{path}: received no calibration tokens, quantized with SpQR on an identity Hessian" in notes


@pytest.mark.slow  # the default run is at its time budget; CI's slow run has it
def test_spqr_experts_run_on_the_triton_backend_with_the_eager_outputs(mixtral_spqr):
    """Stacked expert layouts with each expert's outliers (its row of the shared CSR): one row through
    the GEMV with the outliers fused, five through the GEMM + CSR kernel."""
    on_triton = mixtral_spqr.with_backend("triton")
    kernels = {v["kernel"] for v in on_triton.report.passes[-1].layers.values()}
    assert "layout_gemv/gemm per expert + outliers" in kernels
    for ids in (prompt(1, 1), prompt(1, 5)):
        with torch.no_grad():
            torch.testing.assert_close(
                on_triton(input_ids=ids).logits, mixtral_spqr(input_ids=ids).logits, rtol=1e-4, atol=1e-4
            )


@pytest.mark.slow
def test_spqr_experts_run_in_onnxruntime_with_the_eager_tokens(mixtral_spqr):
    ids = prompt(batch=2)
    ort = mixtral_spqr.with_backend("onnxruntime", accuracy_level=0)
    torch.testing.assert_close(ort(input_ids=ids).logits, mixtral_spqr(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(ort.generate(ids, 8), mixtral_spqr.generate(ids, 8))


def test_quantized_experts_run_in_onnxruntime_with_the_eager_tokens(mixtral_gptq):
    """One MatMulNBits per expert on its rows (qcompiler/backends/onnx_layout.py), decoding with the KV cache."""
    ids = prompt(batch=2)
    ort = mixtral_gptq.with_backend("onnxruntime", accuracy_level=0)
    torch.testing.assert_close(ort(input_ids=ids).logits, mixtral_gptq(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(ort.generate(ids, 8), mixtral_gptq.generate(ids, 8))


def test_quantized_experts_save_load_and_export_one_gptq_layer_per_expert(mixtral_gptq, tmp_path):
    """GPTQ checkpoints hold one matrix per expert under the names GPTQModel reads
    (``mlp.experts.{e}.gate_proj / up_proj / down_proj``), cut bit-exactly from the stacked op tensors."""
    from safetensors.torch import load_file

    from qcompiler.algorithms.packing import unpack_cols
    from qcompiler.interop.gptq_checkpoint import export_gptq
    from qcompiler.ir.op_registry import args_of

    ids = prompt()
    mixtral_gptq.save(tmp_path / "art")
    back = qc.load(tmp_path / "art")
    assert torch.equal(back(input_ids=ids).logits, mixtral_gptq(input_ids=ids).logits)
    assert torch.equal(back.generate(ids, 4), mixtral_gptq.generate(ids, 4))
    export_gptq(mixtral_gptq, tmp_path / "gptq", zero_format="v2", progress=lambda _m: None)
    stored = load_file(tmp_path / "gptq" / "model.safetensors")
    assert "model.layers.0.mlp.gate.weight" in stored and not [n for n in stored if "experts.gate_up" in n]
    gm = mixtral_gptq.graph_module
    nodes = [n for n in gm.graph.nodes if n.target is QEXPERTS]
    gate_up, down = (args_of(n) for n in nodes[:2])  # layer 0
    half = gate_up.tensor(gm, "scales").shape[-1] // 2
    for e in range(4):
        for name, op, cols in (
            ("gate_proj", gate_up, slice(0, half)),
            ("up_proj", gate_up, slice(half, None)),
            ("down_proj", down, slice(None)),
        ):
            prefix = f"model.layers.0.mlp.experts.{e}.{name}"
            n_out = op.tensor(gm, "scales").shape[-1]
            assert torch.equal(stored[f"{prefix}.qweight"], op.tensor(gm, "qweight")[e][:, cols])
            assert torch.equal(stored[f"{prefix}.scales"], op.tensor(gm, "scales")[e][:, cols])
            assert torch.equal(stored[f"{prefix}.g_idx"], op.tensor(gm, "g_idx")[e])
            zeros = unpack_cols(op.tensor(gm, "qzeros")[e], 4, n_out)[:, cols]
            width = stored[f"{prefix}.scales"].shape[1]
            assert torch.equal(unpack_cols(stored[f"{prefix}.qzeros"], 4, width), zeros)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_transformers_runs_the_compressed_tensors_experts_like_the_graph(arch, tmp_path):
    """transformers reads the per-expert checkpoint back into its fused experts (symmetric grid: its
    compressed-tensors loader cannot size asymmetric zero points, docs/formats.md)."""
    import transformers

    from qcompiler.interop import export_compressed_tensors

    cm = _compile(causal_lm(arch), "rtn-w4g128-sym")
    export_compressed_tensors(cm, tmp_path / "ct", progress=lambda _m: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32).eval()
    ids = prompt(1, 12)
    ours, theirs = cm(input_ids=ids).logits, hf(input_ids=ids).logits
    assert (ours - theirs).norm() / ours.norm() < 1e-3  # measured 1.3e-4 / 5e-5: the fused grouped matmul
    assert torch.equal(hf.generate(ids, max_new_tokens=8, do_sample=False), cm.generate(ids, 8))
