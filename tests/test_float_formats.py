"""FP8, NVFP4 and MXFP4: the grids against compressed-tensors' own quantizer, GPTQ on them against
the paper's algorithm written plainly and against RTN, the layouts' bits, and the checkpoints
against the library's decompressor and transformers."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from tiny_models import example_inputs, make_model

import qcompiler as qc
from qcompiler.algorithms.float_grid import (
    FLOAT_FORMATS,
    dequantize,
    float_rtn,
    pack_e2m1,
    round_to_element,
    unpack_e2m1,
)
from qcompiler.algorithms.gptq_float import gptq_float_quantize, gptq_float_reference
from qcompiler.errors import QuantizationError
from qcompiler.interop import ExportError
from qcompiler.ir.model_size import model_size
from qcompiler.ir.op_registry import args_of, quantized_layer_path, spec_of
from qcompiler.layouts import UnpackableLayer
from qcompiler.layouts.float_result import check_float_width
from qcompiler.layouts.fp8 import dequantize_fp8
from qcompiler.layouts.mxfp4 import dequantize_mxfp4
from qcompiler.layouts.nvfp4 import dequantize_nvfp4

PRESETS = {"fp8": "FP8_DYNAMIC", "fp8-block": "FP8_BLOCK", "nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}
RECIPES = {"fp8": "rtn-fp8", "fp8-block": "gptq-fp8-block", "nvfp4": "gptq-nvfp4", "mxfp4": "rtn-mxfp4"}


def _weight(out=256, n=512, seed=0):
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(out, n, generator=gen) * 0.05
    W[3, 7] = 0.93  # an outlier: a non-round global amax, one clipped cell
    W[10, 32:64] = 0.0  # an all-zero cell
    return W


def _library_fake_quantize(W, grid):
    """compressed-tensors' own min-max scales and rounding of ``W`` for the preset of ``grid``."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = preset_name_to_scheme(PRESETS[grid], ["Linear"]).weights
    out, n = W.shape
    g = None
    if grid == "fp8":
        lo, hi = W.amin(1, keepdim=True), W.amax(1, keepdim=True)
    elif grid == "fp8-block":
        cells = W.reshape(out // 128, 128, n // 128, 128)
        lo, hi = cells.amin((1, 3)), cells.amax((1, 3))
    else:
        cells = W.reshape(out, n // args.group_size, args.group_size)
        lo, hi = cells.amin(2), cells.amax(2)
        g = generate_gparam(W.min(), W.max()) if grid == "nvfp4" else None
    scale, _ = calculate_qparams(lo, hi, args, global_scale=g)
    return fake_quantize(W, scale, None, args, global_scale=g).float()


@pytest.mark.parametrize("grid", list(FLOAT_FORMATS))
def test_rtn_is_compressed_tensors_own_quantization_bit_for_bit(grid):
    """Min-max scales and round-to-nearest on each grid equal what llm-compressor's RTN (compressed-
    tensors' observer and fake quantizer) makes of the same weight, and the stored elements and
    scales stand for exactly that weight."""
    W = _weight()
    res = float_rtn(W, FLOAT_FORMATS[grid])
    assert torch.equal(res.dequantized, _library_fake_quantize(W, grid))
    assert torch.equal(dequantize(res.elements, res.scales, FLOAT_FORMATS[grid], res.global_scale), res.dequantized)


def test_e2m1_rounds_ties_to_even_and_packs_as_the_library_does():
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8

    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75, -5.0])
    assert round_to_element(ties, "e2m1").tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -4.0]
    values = round_to_element(torch.randn(6, 40, generator=torch.Generator().manual_seed(1)) * 3, "e2m1")
    packed = pack_e2m1(values)
    assert torch.equal(packed, pack_fp4_to_uint8(values))
    assert torch.equal(unpack_e2m1(packed, 40), values)
    assert torch.equal(unpack_fp4_from_uint8(packed, 6, 40, dtype=torch.float32), values)


def _hessian(n=512, seed=2):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(4 * n, n, generator=gen) * torch.linspace(0.2, 3.0, n)
    X[:, :8] *= 10.0  # a few outlier channels, as transformers' activations have
    return X, 2 * X.t() @ X / X.shape[0]


@pytest.mark.parametrize("grid", list(FLOAT_FORMATS))
def test_gptq_sweep_is_the_papers_algorithm_on_the_float_grid(grid):
    """Natural order, min-max scales fitted as the sweep reaches each group: the lazy-batch sweep
    equals the column-by-column algorithm (float64, explicit inverse) within float rounding — all
    but ties flipped by the last bit (< 0.1 % of the weights) — and with the same output error."""
    W = _weight(256, 512)
    X, H = _hessian()
    fast = gptq_float_quantize(W, H, FLOAT_FORMATS[grid], act_order=False, static_groups=False, kind="minmax")
    ref = gptq_float_reference(W, H, FLOAT_FORMATS[grid])
    close = torch.isclose(fast.dequantized, ref, rtol=1e-5, atol=1e-9)
    assert close.float().mean() > 0.999
    err = [((W - Q) @ X.t()).square().sum().item() for Q in (fast.dequantized, ref)]
    assert abs(err[0] - err[1]) <= 1e-3 * err[1]


@pytest.mark.parametrize(
    "grid,bound",
    # measured (this problem): fp8 0.77, fp8-block 0.81, nvfp4 0.73, mxfp4 0.82 of RTN's output error
    [("fp8", 0.85), ("fp8-block", 0.9), ("nvfp4", 0.8), ("mxfp4", 0.9)],
)
def test_gptq_cuts_the_output_error_of_rtn_on_the_same_grid(grid, bound):
    """GPTQ's defaults (act-order, static scales searched by 1/[H⁻¹]_jj) against RTN's min-max
    on one layer with outlier input channels: ‖(W − Q) X‖² at most ``bound`` × RTN's."""
    W = _weight(256, 512)
    X, H = _hessian()
    fmt = FLOAT_FORMATS[grid]
    error = {
        name: ((W - Q) @ X.t()).square().sum().item()
        for name, Q in (("rtn", float_rtn(W, fmt).dequantized), ("gptq", gptq_float_quantize(W, H, fmt).dequantized))
    }
    assert error["gptq"] <= bound * error["rtn"], error


def _compile(recipe, model=None):
    calib = [example_inputs("llama", 4, 16, seed=s) for s in range(1, 4)]
    model = make_model("llama") if model is None else model
    return qc.compile(model, example_inputs("llama"), recipe=recipe, calibration=calib, progress=False)


def _float_nodes(gm):
    return [
        n for n in gm.graph.nodes if (s := spec_of(n)) is not None and s.name.endswith(("fp8_linear", "fp4_linear"))
    ]


BITS = {  # a layer's stored bits from its shape: elements + scales (+ NVFP4's global scale)
    "fp8": lambda out, n: 8 * out * n + 32 * out,
    "fp8-block": lambda out, n: 8 * out * n + 32 * -(-out // 128) * -(-n // 128),
    "nvfp4": lambda out, n: 4 * out * n + 8 * out * n // 16 + 32,
    "mxfp4": lambda out, n: 4 * out * n + 8 * out * n // 32,
}


@pytest.mark.parametrize("grid", list(FLOAT_FORMATS))
def test_each_layer_stores_exactly_its_formats_bits_and_the_artifact_reloads(grid, tmp_path):
    cm = _compile(RECIPES[grid])
    gm = cm.graph_module
    nodes = _float_nodes(gm)
    assert len(nodes) == 14
    size = model_size(gm)
    want = 0
    for node in nodes:
        a = args_of(node)
        stored = [a.stored_like(gm, name) for name in a.spec.storage]
        out = stored[0].shape[0]
        n = stored[0].shape[1] * (2 if grid in ("nvfp4", "mxfp4") else 1)
        want += BITS[grid](out, n)
    assert size.quantized_bits == want
    cm.save(tmp_path / "a")
    ids = example_inputs("llama", 1, 7, seed=5)
    assert torch.equal(cm(**ids).logits, qc.load(tmp_path / "a")(**ids).logits)


def _library_weights(folder):
    """Each layer's weight as compressed-tensors' decompressor reads our checkpoint."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    state = load_file(str(folder / "model.safetensors"))
    out = {}
    for name, scheme in QuantizationConfig.model_validate(config).config_groups.items():
        compressor = BaseCompressor.load_from_registry(config["config_groups"][name]["format"])
        for path in scheme.targets:
            local = {k[len(path) + 1 :]: v for k, v in state.items() if k.startswith(path + ".")}
            out[path] = compressor.decompress(local, scheme)["weight"]
    return out


def _ours(gm, node):
    a = args_of(node)
    if a.spec.name == "fp8_linear":
        return dequantize_fp8(*a.tensors(gm, "weight_fp8", "weight_scale"), a.block)
    if a.spec.name == "nvfp4_linear":
        return dequantize_nvfp4(*a.tensors(gm, "weight_packed", "weight_scale", "weight_global_scale"))
    return dequantize_mxfp4(*a.tensors(gm, "weight_packed", "weight_scale"))


@pytest.mark.parametrize("grid", list(FLOAT_FORMATS))
def test_the_checkpoint_decompresses_to_our_weights_bit_for_bit(grid, tmp_path):
    """The library's decompression of our file is our op's weight: exactly for FP8 and MXFP4 (float32
    and power-of-two products); for NVFP4 compressed-tensors decompresses to bfloat16, and it is our
    float32 weight rounded to bfloat16, bit for bit."""
    cm = _compile(RECIPES[grid])
    cm.export("compressed-tensors", tmp_path / "ct")
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert config["format"] == {"fp8": "float-quantized", "fp8-block": "float-quantized"}.get(
        grid, f"{grid}-pack-quantized"
    )
    theirs = _library_weights(tmp_path / "ct")
    gm = cm.graph_module
    for node in _float_nodes(gm):
        ours = _ours(gm, node)
        lib = theirs[quantized_layer_path(args_of(node))]
        assert torch.equal(ours.to(lib.dtype) if grid == "nvfp4" else ours, lib.float() if grid != "nvfp4" else lib)


@pytest.mark.parametrize(
    "recipe", ["fp8-dynamic", "gptq-fp8-dynamic", "rtn-fp8-block", "fp8-static", "rtn-nvfp4", "gptq-mxfp4"]
)
def test_transformers_runs_the_checkpoint_like_the_graph(recipe, tmp_path):
    """transformers (compressed-tensors installed) loads the export on CPU and its logits are the
    graph's: FP8 in float32 exactly, dynamic FP8 activations included; the FP4 formats, which the
    library decompresses to bfloat16, from a bfloat16 model within two bfloat16 steps of the largest
    logit (measured: one to two)."""
    import transformers

    fp4 = "fp4" in recipe
    model = make_model("llama").to(torch.bfloat16) if fp4 else make_model("llama")
    cm = _compile(recipe, model)
    cm.export("compressed-tensors", tmp_path / "ct")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=model.dtype).eval()
    ids = {k: v for k, v in example_inputs("llama", 2, 9, seed=4).items() if k != "use_cache"}
    with torch.no_grad():
        ours, theirs = cm(**ids).logits.float(), loaded(**ids).logits.float()
    if fp4:
        assert (ours - theirs).abs().max() <= 2**-7 * ours.abs().max()
    else:
        assert torch.equal(ours, theirs)


def test_widths_and_settings_a_format_cannot_hold_are_refused_by_name(tmp_path):
    with pytest.raises(
        QuantizationError, match=r"grid='nvfp4' stores 4-bit e2m1 elements .* needs bits=4 and group_size=16"
    ):
        qc.passes.GPTQ(bits=4, group_size=128, grid="nvfp4")
    with pytest.raises(QuantizationError, match=r"grid='fp8'.*RTN's and GPTQ's"):
        qc.passes.SignRound(bits=4, group_size=128, start="fp8")
    with pytest.raises(QuantizationError, match=r"act-order needs static groups"):
        gptq_float_quantize(_weight(32, 64), _hessian(64)[1], FLOAT_FORMATS["nvfp4"], static_groups=False)
    with pytest.raises(UnpackableLayer, match=r"layer model\.layers\.3\.mlp: in_features=24 is not a multiple of 16"):
        check_float_width(SimpleNamespace(path="model.layers.3.mlp"), torch.zeros(8, 24), "nvfp4")
    with pytest.raises(Exception, match=r"FP8Activations found no FP8 linear"):
        _compile([qc.passes.RTN(), qc.passes.FP8Activations()])
    with pytest.raises(
        Exception, match=r"model\.layers\.0\.self_attn\.q_proj: in_features=64 is not a multiple of 128"
    ):
        _compile("fp8-block-dynamic")
    cm = _compile("gptq-nvfp4")
    with pytest.raises(ExportError, match=r"layer model\.layers\.0\.\S+ .*floating-point grid .*compressed-tensors"):
        cm.export("gptq", tmp_path / "g")
    with pytest.raises(Exception, match=r"ONNX Runtime has no NVFP4"):
        cm.export("onnx", tmp_path / "m.onnx")
    assert not (tmp_path / "g").exists() and not (tmp_path / "m.onnx").exists()


def test_mxfp4_goes_to_gguf_code_for_code_and_the_other_formats_are_refused(tmp_path):
    """The GGUF file's MXFP4 blocks, dequantized by the gguf package (llama.cpp's reference), are our
    op's weights bit for bit; FP8 and NVFP4 are refused by name (llama.cpp runs the file:
    tests/test_llama_cpp_runs_our_gguf.py)."""
    import gguf

    cm = _compile("gptq-mxfp4")
    cm.export_gguf(tmp_path / "m.gguf", progress=lambda _: None)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    written = {t.name: t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.MXFP4}
    gm = cm.graph_module
    nodes = _float_nodes(gm)
    assert len(written) == len(nodes) == 14
    ours = sorted(tuple(_ours(gm, n).shape) + (float(_ours(gm, n).abs().sum()),) for n in nodes)
    theirs = []
    for t in written.values():
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        theirs.append(tuple(w.shape) + (float(w.abs().sum()),))
    assert sorted(theirs) == ours  # every layer's weight, whatever llama.cpp's row order for q/k
    q = args_of(next(n for n in nodes if quantized_layer_path(args_of(n)).endswith("layers.0.mlp.down_proj")))
    down = torch.from_numpy(
        gguf.quants.dequantize(written["blk.0.ffn_down.weight"].data, gguf.GGMLQuantizationType.MXFP4).copy()
    )
    assert torch.equal(down, dequantize_mxfp4(*q.tensors(gm, "weight_packed", "weight_scale")))
    for recipe, what in (("rtn-fp8", "FP8"), ("rtn-nvfp4", "NVFP4")):
        with pytest.raises(ExportError, match=rf"layer model\.layers\.0\.\S+ .*{what}"):
            _compile(recipe).export_gguf(tmp_path / f"{recipe}.gguf", progress=lambda _: None)


def test_the_layers_vllm_fuses_share_one_nvfp4_global_scale():
    """vLLM serves q/k/v as one qkv_proj and gate/up as one gate_up_proj with a single global scale
    (the largest of theirs): each such group stores one ``weight_global_scale``, ``448 · 6 / max|W|``
    over the group's FP weights, and the other layers their own."""
    model = make_model("llama")
    fp = {name: p.detach().abs().amax().item() for name, p in model.named_parameters()}
    gm = _compile("gptq-nvfp4", model).graph_module
    scale = {
        quantized_layer_path(a): a.tensor(gm, "weight_global_scale").item()
        for a in (args_of(n) for n in _float_nodes(gm))
    }
    for block in ("model.layers.0", "model.layers.1"):
        for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            amax = max(fp[f"{block}.{name}.weight"] for name in group)
            shared = {scale[f"{block}.{name}"] for name in group}
            assert len(shared) == 1 and shared.pop() == pytest.approx(448 * 6 / amax, rel=1e-6)
        for alone in ("self_attn.o_proj", "mlp.down_proj"):
            assert scale[f"{block}.{alone}"] == pytest.approx(448 * 6 / fp[f"{block}.{alone}.weight"], rel=1e-6)
