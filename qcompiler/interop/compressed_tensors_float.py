"""compressed-tensors' floating-point formats, written from the float layouts' tensors as they are:
FP8 → ``float-quantized`` (e4m3 ``weight``, fp32 ``weight_scale`` per channel ``[out, 1]`` or per
128 × 128 block; FP8 activations dynamic per token or per token-group of 128, or static per tensor
with an ``input_scale``), NVFP4 → ``nvfp4-pack-quantized`` (``weight_packed``, e4m3
``weight_scale``, ``weight_global_scale`` in compressed-tensors' own convention; W4A4 adds the
activations' ``input_global_scale``, their local scales ``dynamic: local``), MXFP4 →
``mxfp4-pack-quantized`` (``weight_packed``, e8m0 ``weight_scale`` as uint8). The schemes are the
ones compressed-tensors' presets FP8_DYNAMIC, FP8_BLOCK, NVFP4A16, NVFP4 and MXFP4A16 serialize to
(static FP8: its FP8 preset's activations); its decompressor reads our tensors back bit for bit
(tests/test_float_formats.py, tests/test_calibrated_activations.py).
"""

from __future__ import annotations

from qcompiler.interop.checkpoint import model_config_of
from qcompiler.interop.moe_checkpoint import block_path
from qcompiler.ir.op_registry import OpArgs, implement

__all__ = ["fp8_scheme"]


def _float_weights(num_bits: int, strategy: str, **extra) -> dict:
    return {"num_bits": num_bits, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy} | extra


def fp8_scheme(block: int, activations: str) -> dict:
    """The compressed-tensors scheme of a ``qc.fp8_linear`` with these constants."""
    if block:
        weights = _float_weights(8, "block", group_size=None, block_structure=[block, block])
    else:
        weights = _float_weights(8, "channel", group_size=None)
    acts = None
    if activations == "static":
        acts = _float_weights(8, "tensor", group_size=None)
    elif activations != "none":
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True}
        grouped = activations == "group"
        acts |= {"strategy": "group" if grouped else "token", "group_size": 128 if grouped else None}
    return {"format": "float-quantized", "weights": weights, "input_activations": acts}


def _module(gm, path: str) -> str:
    return block_path(path, model_config_of(gm).get("model_type"))


def _fp8_layer(gm, a: OpArgs, path: str) -> list[tuple[str, dict, dict]]:
    weight, scale = a.tensors(gm, "weight_fp8", "weight_scale")
    tensors = {"weight": weight, "weight_scale": scale.float()}
    if a.input_scale is not None:
        tensors["input_scale"] = a.tensor(gm, "input_scale").float().reshape(1)
    return [(_module(gm, path), tensors, fp8_scheme(int(a.block), a.activations))]


def _nvfp4_layer(gm, a: OpArgs, path: str) -> list[tuple[str, dict, dict]]:
    packed, scale, global_scale = a.tensors(gm, "weight_packed", "weight_scale", "weight_global_scale")
    tensors = {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": global_scale.float().reshape(1)}
    weights = _float_weights(4, "tensor_group", group_size=16, scale_dtype="torch.float8_e4m3fn")
    acts = None
    if a.input_global_scale is not None:
        tensors["input_global_scale"] = a.tensor(gm, "input_global_scale").float().reshape(1)
        acts = weights | {"dynamic": "local"}
    scheme = {"format": "nvfp4-pack-quantized", "weights": weights, "input_activations": acts}
    return [(_module(gm, path), tensors, scheme)]


def _mxfp4_layer(gm, a: OpArgs, path: str) -> list[tuple[str, dict, dict]]:
    packed, scale = a.tensors(gm, "weight_packed", "weight_scale")
    weights = _float_weights(4, "group", group_size=32, scale_dtype="torch.uint8")
    scheme = {"format": "mxfp4-pack-quantized", "weights": weights, "input_activations": None}
    return [(_module(gm, path), {"weight_packed": packed, "weight_scale": scale}, scheme)]


KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}


def _kv_scale(gm, a: OpArgs, path: str) -> list[tuple[str, dict, dict]]:
    """An FP8 KV cache's key or value scale, as the attention module's ``k_scale`` / ``v_scale``
    (the exporter puts ``kv_cache_scheme`` in the config instead of a config group)."""
    target = str(a.scale.target)
    module, _, name = target.rpartition(".")
    if name not in ("k_scale", "v_scale"):
        raise ValueError(f"{target}: an FP8 KV cache scale must be stored as <attention>.k_scale or .v_scale")
    return [
        (_module(gm, module), {name: a.tensor(gm, "scale").float().reshape(1)}, {"kv_cache_scheme": KV_CACHE_SCHEME})
    ]


implement("compressed-tensors", "fp8_kv_quant", _kv_scale, kind="writer", label="kv_cache_scheme k_scale / v_scale")
implement("compressed-tensors", "fp8_linear", _fp8_layer, kind="writer", label="float-quantized")
implement("compressed-tensors", "nvfp4_linear", _nvfp4_layer, kind="writer", label="nvfp4-pack-quantized")
implement("compressed-tensors", "mxfp4_linear", _mxfp4_layer, kind="writer", label="mxfp4-pack-quantized")
