"""The built-in recipe table (``qcompiler recipes`` lists it; docs/recipes.md) and the recipe
families whose names carry an argument: ``auto:B``, ``auto-signround:B``, ``auto-gguf:B``,
``auto-float:B`` (AutoBits at B bits per parameter) and ``rotate-auto:B`` / ``rotate-auto-signround:B`` (the Rotate pass
first). Registered into ``qcompiler/pipeline/recipes.py`` when ``qcompiler.passes`` is imported.
"""

from __future__ import annotations

from qcompiler.algorithms.float_grid import FLOAT_FORMATS
from qcompiler.algorithms.gguf_grids import FORMATS, GRID_FALLBACK
from qcompiler.errors import RecipeError
from qcompiler.passes.auto_bits import FLOAT_CANDIDATES, GGUF_CANDIDATES, AutoBits
from qcompiler.passes.awq import AWQ
from qcompiler.passes.fp8_activations import FP8Activations
from qcompiler.passes.fp8_kv_cache import FP8KVCache
from qcompiler.passes.gptq import GPTQ
from qcompiler.passes.lower_int8 import LowerInt8
from qcompiler.passes.nvfp4_activations import NVFP4Activations
from qcompiler.passes.rotate import Rotate
from qcompiler.passes.rtn import RTN
from qcompiler.passes.signround import SignRound
from qcompiler.passes.smoothquant import SmoothQuant
from qcompiler.passes.spqr import SpQR
from qcompiler.pipeline.recipes import Recipe, get_recipe, register_recipe, register_recipe_family

__all__ = ["AUTO_PREFIX", "AUTO_SIGNROUND_PREFIX", "AUTO_GGUF_PREFIX", "AUTO_FLOAT_PREFIX", "ROTATE_PREFIX"]

AUTO_PREFIX = "auto:"  # auto:B — the AutoBits pass at a budget of B bits per parameter
AUTO_SIGNROUND_PREFIX = "auto-signround:"  # auto-signround:B — auto:B's allocation, quantized by SignRound
AUTO_GGUF_PREFIX = "auto-gguf:"  # auto-gguf:B — auto:B over llama.cpp's block types only (one GGUF file)
AUTO_FLOAT_PREFIX = "auto-float:"  # auto-float:B — auto:B over MXFP4 / NVFP4 / FP8 (what GPUs serve)
ROTATE_PREFIX = "rotate-"  # rotate-auto:B — the Rotate pass, then auto:B (rotate-auto-signround:B likewise)
_PASSES = {"RTN": RTN, "GPTQ": GPTQ}


# each auto family: the AutoBits settings beside the budget, and its description ({budget}: the budget)
_AUTO_FAMILIES = {
    AUTO_GGUF_PREFIX: (
        {"candidates": GGUF_CANDIDATES},
        "automatic mixed precision on llama.cpp's block types: per layer GPTQ on Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/Q8_0, "
        "chosen from each layer's measured effect on the output to fit {budget} bits per parameter; "
        "eager, ONNX Runtime and GGUF",
    ),
    AUTO_FLOAT_PREFIX: (
        {"candidates": FLOAT_CANDIDATES},
        "automatic mixed precision on the formats GPUs serve: per layer GPTQ on MXFP4/NVFP4/FP8, chosen "
        "from each layer's measured effect on the output to fit {budget} bits per parameter; eager and "
        "compressed-tensors (one config group per format: vLLM, transformers)",
    ),
    AUTO_SIGNROUND_PREFIX: (
        {"finish": "signround"},
        "automatic mixed precision by SignRound: per layer 2/3/4/8 bits x groups 32/64/128 chosen from each "
        "layer's measured effect on the output to fit {budget} bits per parameter, then every block's "
        "rounding tuned jointly at those bits",
    ),
    AUTO_PREFIX: (
        {},
        "automatic mixed precision: per layer GPTQ 2/3/4/8 bits x groups 32/64/128 or SpQR 3/4 bits, chosen from "
        "each layer's measured effect on the output to fit {budget} bits per parameter",
    ),
}


def _auto_recipe(name: str) -> Recipe:
    """``auto:B``, ``auto-signround:B``, ``auto-gguf:B``, ``auto-float:B``: AutoBits at a budget of B bits
    per parameter."""
    prefix, text = name.split(":", 1)
    try:
        budget = float(text)
    except ValueError:
        raise RecipeError(f"recipe {name!r}: {text!r} is not a number of bits per parameter (e.g. auto:3.25)") from None
    settings, description = _AUTO_FAMILIES[prefix + ":"]
    return Recipe(name, (AutoBits(budget=budget, **settings),), description.format(budget=f"{budget:g}"))


def _rotated(name: str) -> Recipe:
    """``rotate-auto:B``: the Rotate pass, then ``auto:B``'s passes."""
    auto = get_recipe(name[len(ROTATE_PREFIX) :])
    return Recipe(name, (Rotate(), *auto.passes), "randomized Hadamard rotations, then " + auto.description)


def _register_weight_only() -> None:
    """The GPTQ / RTN table, llama.cpp's grids, SpQR and AWQ."""
    register_recipe("none", "no passes: the captured FP graph (a baseline)", lambda: [])
    for name, (method, kw) in _WEIGHT_ONLY.items():
        cls = _PASSES[method]
        register_recipe(name, _describe(cls, kw), (lambda cls=cls, kw=kw: [cls(**kw)]))
    register_recipe(
        "spqr-w3g16",
        "SpQR: 3-bit weights in groups of 16, 3-bit statistics (beta2=16), "
        "act-order, outliers (relative tau 1.0) in fp16 CSR",
        lambda: [SpQR()],
    )
    register_recipe(
        "spqr-w4g16",
        "SpQR, higher quality: 4-bit weights in groups of 16, 3-bit statistics, outliers (relative tau 1.0)",
        lambda: [SpQR(bits=4)],
    )
    for bits in (4, 3):
        register_recipe(
            f"awq-w{bits}g128",
            f"AWQ activation-aware scales (searched for {bits}-bit g128), then round-to-nearest W{bits}A16 g128",
            (lambda bits=bits: [AWQ(bits=bits, group_size=128), RTN(bits=bits, group_size=128)]),
        )
        register_recipe(
            f"awq-gptq-w{bits}g128",
            f"AWQ activation-aware scales (searched for {bits}-bit g128), then GPTQ W{bits}A16 g128 (its defaults)",
            (lambda bits=bits: [AWQ(bits=bits, group_size=128), GPTQ(bits=bits, group_size=128)]),
        )
    for grid, group in (("nvfp4", 16), ("mxfp4", 32)):
        kw = dict(bits=4, group_size=group, grid=grid)
        for method, cls in (("", RTN), ("gptq-", GPTQ)):
            register_recipe(
                f"awq-{method}{grid}",
                f"AWQ activation-aware scales (searched on the {grid.upper()} grid), then {_describe(cls, kw)}",
                (lambda cls=cls, kw=kw: [AWQ(**kw), cls(**kw)]),
            )


def _register_rotated_and_signround() -> None:
    """Rotations before GPTQ, SignRound, RTN and W8A8; SignRound alone."""
    for bits in (4, 3):
        register_recipe(
            f"rotate-gptq-w{bits}g128",
            f"randomized Hadamard rotations (residual stream where the norms allow, heads, online before the "
            f"other linears), then GPTQ W{bits}A16 g128 (its defaults)",
            (lambda bits=bits: [Rotate(), GPTQ(bits=bits, group_size=128)]),
        )
    for bits in (4, 3, 2):
        register_recipe(
            f"signround-w{bits}g128",
            f"SignRound W{bits}A16 g128: rounding and clipping tuned per block against the block's output error "
            "(200 signed-gradient steps, searched starting grid), stored like GPTQ",
            (lambda bits=bits: [SignRound(bits=bits, group_size=128)]),
        )
    for bits in (4, 3):
        register_recipe(
            f"rotate-signround-w{bits}g128",
            f"randomized Hadamard rotations, then SignRound W{bits}A16 g128",
            (lambda bits=bits: [Rotate(), SignRound(bits=bits, group_size=128)]),
        )
    register_recipe(
        "rotate-rtn-w4g128",
        "randomized Hadamard rotations, then round-to-nearest W4A16 g128",
        lambda: [Rotate(), RTN(bits=4, group_size=128)],
    )
    register_recipe(
        "rotate-w8a8",
        "randomized Hadamard rotations, then W8A8 (per-token dynamic activations), no smoothing",
        lambda: [Rotate(), LowerInt8()],
    )


def _register_w8a8() -> None:
    """W8A8: dynamic and static activations, with and without SmoothQuant."""
    register_recipe(
        "w8a8", "int8 weights (per channel) and activations (per token, dynamic), no smoothing", lambda: [LowerInt8()]
    )
    register_recipe(
        "w8a8-static",
        "int8 weights (per channel), static per-tensor int8 activations",
        lambda: [LowerInt8(activations="static_per_tensor")],
    )
    register_recipe(
        "w8a8-smoothquant",
        "SmoothQuant alpha=0.5, then W8A8 (per-token dynamic activations)",
        lambda: [SmoothQuant(alpha=0.5), LowerInt8()],
    )
    register_recipe(
        "w8a8-smoothquant-a0.8", "SmoothQuant alpha=0.8, then W8A8", lambda: [SmoothQuant(alpha=0.8), LowerInt8()]
    )
    register_recipe(
        "w8a8-smoothquant-auto",
        "SmoothQuant with alpha searched per producer group, then W8A8",
        lambda: [SmoothQuant(alpha="auto"), LowerInt8()],
    )


def _register_float_formats() -> None:
    """The formats GPUs serve today: FP8 (per channel, per 128x128 block; with dynamic FP8
    activations: compressed-tensors' FP8-dynamic and FP8-block schemes), NVFP4 and MXFP4 (W4A16),
    by RTN (compressed-tensors' own min-max scales) or GPTQ (act-order, static scales searched)."""
    for method in ("RTN", "GPTQ"):
        lower = method.lower()
        for grid, fmt in FLOAT_FORMATS.items():
            kw = dict(bits=fmt.bits, group_size=fmt.group, grid=grid)
            cls = _PASSES[method]
            register_recipe(f"{lower}-{grid}", _describe(cls, kw), (lambda cls=cls, kw=kw: [cls(**kw)]))
        for grid, strategy, name in (("fp8", "token", "fp8-dynamic"), ("fp8-block", "group", "fp8-block-dynamic")):
            kw = dict(bits=8, group_size=FLOAT_FORMATS[grid].group, grid=grid)
            cls = _PASSES[method]
            register_recipe(
                f"{name}" if method == "RTN" else f"gptq-{name}",
                f"{_describe(cls, kw)}; inputs rounded to e4m3 at run time, a dynamic scale per "
                + ("token" if strategy == "token" else "token and 128 inputs"),
                (lambda cls=cls, kw=kw, strategy=strategy: [cls(**kw), FP8Activations(strategy)]),
            )
    register_recipe(
        "fp8-kv",
        "an FP8 KV cache alone: keys and values in e4m3 with a calibrated scale per attention (weights unchanged)",
        lambda: [FP8KVCache()],
    )
    register_recipe(
        "fp8-dynamic-kv",
        "FP8-dynamic (FP8 weights per channel, FP8 activations per token), and an FP8 KV cache",
        lambda: [RTN(bits=8, group_size=-1, grid="fp8"), FP8Activations("token"), FP8KVCache()],
    )
    register_recipe(
        "rotate-gptq-nvfp4",
        "randomized Hadamard rotations, then GPTQ on the NVFP4 grid",
        lambda: [Rotate(), GPTQ(bits=4, group_size=16, grid="nvfp4")],
    )
    _register_static_activations()


def _register_static_activations() -> None:
    """Activations with calibrated scales: FP8 static per tensor (compressed-tensors' FP8 scheme,
    with per-channel weights) and NVFP4 W4A4 (its NVFP4 scheme), by RTN or GPTQ, NVFP4 also rotated."""
    fp8 = dict(bits=8, group_size=-1, grid="fp8")
    static = "; inputs rounded to e4m3 with one static scale per tensor (the largest calibration input / 448)"
    for name, cls in (("fp8-static", RTN), ("gptq-fp8-static", GPTQ)):
        register_recipe(
            name,
            f"{_describe(cls, fp8)}{static}",
            (lambda cls=cls: [cls(**fp8), FP8Activations("static")]),
        )
    nvfp4 = dict(bits=4, group_size=16, grid="nvfp4")
    a4 = "; W4A4: inputs rounded to NVFP4 at run time (e4m3 scales per 16, a calibrated global scale per tensor)"
    for name, rotate, cls in (
        ("nvfp4-w4a4", False, RTN),
        ("gptq-nvfp4-w4a4", False, GPTQ),
        ("rotate-gptq-nvfp4-w4a4", True, GPTQ),
    ):
        first = "randomized Hadamard rotations, then " if rotate else ""
        register_recipe(
            name,
            f"{first}{_describe(cls, nvfp4)}{a4}",
            (lambda cls=cls, rotate=rotate: ([Rotate()] if rotate else []) + [cls(**nvfp4), NVFP4Activations()]),
        )


def _register_families() -> None:
    """``auto:B`` and its kin: names that carry a budget."""
    for prefix in (AUTO_PREFIX, AUTO_SIGNROUND_PREFIX, AUTO_GGUF_PREFIX, AUTO_FLOAT_PREFIX):
        register_recipe_family(prefix, f"{prefix}B", _auto_recipe)
    for prefix in (AUTO_PREFIX, AUTO_SIGNROUND_PREFIX, AUTO_FLOAT_PREFIX):
        register_recipe_family(ROTATE_PREFIX + prefix, f"{ROTATE_PREFIX}{prefix}B", _rotated)


def _describe(cls: type, kw: dict) -> str:
    p = cls(**kw)  # the settings as they run: the recipe's, and the class defaults for the rest
    method = "GPTQ" if cls.__name__ == "GPTQ" else "round-to-nearest"
    group = "per channel" if p.group_size == -1 else f"groups of {p.group_size}"
    order = getattr(p, "act_order", False)
    extra = (
        (", act-order" + (" (static groups)" if p.static_groups and p.group_size != -1 else " (g_idx)"))
        if order
        else ""
    )
    extra += ", lm_head in 4 bits (RTN)" if p.lm_head else ""
    if p.grid in FORMATS:
        fmt = FORMATS[p.grid]
        if fmt.zero is not None:
            kind = f"signed {'8' if fmt.sc_range[0] == -128 else '6'}-bit scales per super-block of 256"
        elif fmt.super_block > fmt.sub_block:
            kind = f"{fmt.sc_range[1].bit_length()}-bit scales and minima per super-block of 256"
        else:
            kind = "an fp16 scale and a free fp16 minimum each"
        fallback = GRID_FALLBACK.get(p.grid)
        fallback = f"; a width not a multiple of 256 on {fallback.upper()}" if fallback else ""
        bpw = fmt.block_bytes * 8 / fmt.super_block
        return (
            f"{method} on llama.cpp's {fmt.name} grid ({fmt.bits}-bit codes in sub-blocks of {fmt.sub_block}, {kind}: "
            f"{bpw:g} bits per weight, searched{fallback}){extra}; eager, ONNX Runtime and GGUF"
        )
    if p.grid in FLOAT_FORMATS:
        fmt = FLOAT_FORMATS[p.grid]
        cell = (
            "per output channel"
            if fmt.group == -1
            else f"per {fmt.rows}x{fmt.group} block"
            if fmt.rows > 1
            else (f"per {fmt.group} inputs")
        )
        scale = {"fp32": "an fp32 scale", "e4m3": "an e4m3 scale", "e8m0": "a power-of-two (e8m0) scale"}[
            fmt.scale_dtype
        ]
        scales = "min-max scales" if method != "GPTQ" else "scales searched per cell"
        glob = " and an fp32 global scale" if fmt.has_global else ""
        return f"{method} on the {p.grid.upper()} grid: {fmt.element} weights, {scale} {cell}{glob}, {scales}{extra}"
    extra += ", searched (mse) grid" if p.grid == "mse" else ", min-max grid"
    return f"{method} W{p.bits}A16, {group}, {'symmetric' if p.sym else 'asymmetric'}{extra}"


# name -> (pass class, its settings). Asymmetric grids: measured clearly better
# than symmetric on MiniLM (docs/methods/gptq.md).
_WEIGHT_ONLY = {
    "rtn-w4g128": ("RTN", dict(bits=4, group_size=128, sym=False)),
    "rtn-w3g128": ("RTN", dict(bits=3, group_size=128, sym=False)),
    "rtn-w2g128": ("RTN", dict(bits=2, group_size=128, sym=False)),
    "rtn-w3": ("RTN", dict(bits=3, group_size=-1, sym=False)),
    "gptq-w4g128": ("GPTQ", dict(bits=4, group_size=128, sym=False)),
    "gptq-w3g128": ("GPTQ", dict(bits=3, group_size=128, sym=False)),
    "gptq-w2g128": ("GPTQ", dict(bits=2, group_size=128, sym=False)),
    "gptq-w3": ("GPTQ", dict(bits=3, group_size=-1, sym=False)),
    "gptq-w3-act": ("GPTQ", dict(bits=3, group_size=-1, sym=False, act_order=True, static_groups=False)),
    # act-order with groups along the processing order (a g_idx gather at run time)
    "gptq-w4g128-act": ("GPTQ", dict(bits=4, group_size=128, sym=False, act_order=True, static_groups=False)),
    "gptq-w3g128-act": ("GPTQ", dict(bits=3, group_size=128, sym=False, act_order=True, static_groups=False)),
    "gptq-w2g128-act": ("GPTQ", dict(bits=2, group_size=128, sym=False, act_order=True, static_groups=False)),
    "gptq-w4g128-static": ("GPTQ", dict(bits=4, group_size=128, sym=False, act_order=True, static_groups=True)),
    # the 2022 paper's settings (natural column order, min-max grids): the baseline the defaults are measured on
    "gptq-w4g128-plain": (
        "GPTQ",
        dict(bits=4, group_size=128, sym=False, act_order=False, static_groups=False, grid="minmax"),
    ),
    "gptq-w3g128-plain": (
        "GPTQ",
        dict(bits=3, group_size=128, sym=False, act_order=False, static_groups=False, grid="minmax"),
    ),
    # symmetric grids, for clients that take no zero points (vLLM's CPU and Marlin GPTQ kernels)
    "rtn-w4g128-sym": ("RTN", dict(bits=4, group_size=128, sym=True)),
    "gptq-w4g128-sym": ("GPTQ", dict(bits=4, group_size=128, sym=True)),
    "gptq-w3g128-sym": ("GPTQ", dict(bits=3, group_size=128, sym=True)),
    # llama.cpp's Q4_0 / Q8_0 blocks (32 weights, one fp16 scale, symmetric): written to GGUF code for code
    "rtn-q4_0": ("RTN", dict(bits=4, group_size=32, sym=True)),
    "gptq-q4_0": ("GPTQ", dict(bits=4, group_size=32, sym=True)),
    "rtn-q8_0": ("RTN", dict(bits=8, group_size=32, sym=True)),
    "gptq-q8_0": ("GPTQ", dict(bits=8, group_size=32, sym=True)),
    # llama.cpp's grids, stored as their own bytes (qc.gguf_linear): run in eager, ONNX Runtime (MatMulNBits)
    # and llama.cpp. Q4_1 / Q5_1 (fp16 scale and minimum per 32, 5.0 / 6.0 bits per weight) on their own grid:
    # longlm perplexity +0.30 % vs +0.79 % for an integer zero point (asymmetric groups of 32, written as Q4_1 too).
    # Q4_K / Q5_K (super-blocks of 256: 6-bit scales and minima per 32, 4.5 / 5.5 bits per weight).
    "rtn-q4_1": ("RTN", dict(bits=4, group_size=32, grid="q4_1")),
    "gptq-q4_1": ("GPTQ", dict(bits=4, group_size=32, grid="q4_1")),
    "rtn-q5_1": ("RTN", dict(bits=5, group_size=32, grid="q5_1")),
    "gptq-q5_1": ("GPTQ", dict(bits=5, group_size=32, grid="q5_1")),
    "rtn-q4_k": ("RTN", dict(bits=4, group_size=32, grid="q4_k")),
    "gptq-q4_k": ("GPTQ", dict(bits=4, group_size=32, grid="q4_k")),
    "rtn-q5_k": ("RTN", dict(bits=5, group_size=32, grid="q5_k")),
    "gptq-q5_k": ("GPTQ", dict(bits=5, group_size=32, grid="q5_k")),
    # Q6_K / Q3_K: symmetric, 6- / 3-bit codes per 16 with signed integer scales (6.5625 / 3.4375 bits per weight)
    "rtn-q6_k": ("RTN", dict(bits=6, group_size=16, grid="q6_k")),
    "gptq-q6_k": ("GPTQ", dict(bits=6, group_size=16, grid="q6_k")),
    "rtn-q3_k": ("RTN", dict(bits=3, group_size=16, grid="q3_k")),
    "gptq-q3_k": ("GPTQ", dict(bits=3, group_size=16, grid="q3_k")),
    # Q2_K: 2-bit codes per 16 with 4-bit scales and minima (2.625 bits per weight)
    "rtn-q2_k": ("RTN", dict(bits=2, group_size=16, grid="q2_k")),
    "gptq-q2_k": ("GPTQ", dict(bits=2, group_size=16, grid="q2_k")),
    # the output head in 4 bits too (RTN), as onnxruntime-genai's int4 builder: faster decoding
    "rtn-w4g128-head": ("RTN", dict(bits=4, group_size=128, sym=False, lm_head=True)),
    "gptq-w4g128-head": ("GPTQ", dict(bits=4, group_size=128, sym=False, lm_head=True)),
}


_register_weight_only()
_register_rotated_and_signround()
_register_w8a8()
_register_float_formats()
_register_families()
