"""Reading a GPTQ checkpoint folder (config + safetensors): what the import pass and the loader share.

Zero points: ``checkpoint_format: "gptq"`` (v1: AutoGPTQ, transformers, vLLM) stores ``zero − 1``
wrapped to ``bits`` bits; ``"gptq_v2"`` (GPTQModel) stores the real zero, as ``qc.quant_linear`` does.

Per-module settings: GPTQModel's ``dynamic`` (also read by vLLM) maps regular expressions, matched with
``re.match`` against a module's path in order, to the settings that override the base ``bits`` /
``group_size`` for it (``+:`` or no prefix); a ``-:`` pattern means the module is not quantized.

Fused projections (``SPLIT_PROJECTIONS``): GPTQModel's Phi-3 reads ``gate_proj`` / ``up_proj``
where transformers' model has one ``gate_up_proj``; exports write the halves and imports join them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from qcompiler.algorithms.packing import pack_cols, unpack_cols
from qcompiler.errors import ExportError
from qcompiler.layouts.gptq import GPTQ_TENSORS

__all__ = ["GPTQCheckpoint", "read_gptq_checkpoint", "zeros_to_v1", "zeros_from_v1", "SPLIT_PROJECTIONS"]

# model_type -> {fused module name: its parts along the output features, in order}
SPLIT_PROJECTIONS = {"phi3": {"gate_up_proj": ("gate_proj", "up_proj")}}


def zeros_to_v1(qzeros: torch.Tensor, bits: int, n_out: int) -> torch.Tensor:
    """GPTQ v1 zero points (stored zero - 1) from real ones."""
    z = unpack_cols(qzeros, bits, n_out)
    return pack_cols((z - 1) & ((1 << bits) - 1), bits)


def zeros_from_v1(qzeros: torch.Tensor, bits: int, n_out: int) -> torch.Tensor:
    """Real zero points from GPTQ v1 ones (stored zero - 1)."""
    z = unpack_cols(qzeros, bits, n_out)
    return pack_cols((z + 1) & ((1 << bits) - 1), bits)


class GPTQCheckpoint(NamedTuple):
    """A GPTQ checkpoint folder as read: its quantization config, settings and tensors."""

    folder: Path
    config: dict  # config.json without its quantization_config
    quant: dict  # the quantization_config
    bits: int
    group_size: int
    v1: bool  # zero points stored minus one
    layers: dict  # module path -> the safetensors file holding its packed tensors
    fused: dict  # a fused module path -> the stored parts it is joined from
    stored: dict  # every stored module path (parts included) -> its safetensors file

    def settings(self, path: str) -> tuple[int, int]:
        """``(bits, group_size)`` of module ``path``: the first ``dynamic`` pattern matching it, or the base."""
        if path in self.fused:
            found = {self.settings(part) for part in self.fused[path]}
            if len(found) != 1:
                raise ExportError(f"{self.folder}: the parts of {path} have different settings {sorted(found)}")
            return found.pop()
        for pattern, override in (self.quant.get("dynamic") or {}).items():
            if not pattern.startswith("-:") and re.match(pattern.removeprefix("+:"), path):
                return int(override.get("bits", self.bits)), int(override.get("group_size", self.group_size))
        return self.bits, self.group_size

    def packed(self, path: str) -> dict[str, torch.Tensor]:
        """``path``'s four tensors in ``qc.quant_linear``'s layout (v1 zero points converted)."""
        if path in self.fused:
            return _joined([self.packed(part) for part in self.fused[path]], self.settings(path)[0], path)
        with safe_open(str(self.stored[path]), framework="pt") as f:
            t = {name: f.get_tensor(f"{path}.{name}") for name in GPTQ_TENSORS}
        if self.v1:
            t["qzeros"] = zeros_from_v1(t["qzeros"], self.settings(path)[0], t["scales"].shape[1])
        return t

    def packed_keys(self) -> set[str]:
        """The checkpoint keys that hold packed layers."""
        paths = [p for path in self.layers for p in self.fused.get(path, (path,))]
        return {f"{path}.{name}" for path in paths for name in GPTQ_TENSORS}


def _joined(parts: list[dict], bits: int, path: str) -> dict[str, torch.Tensor]:
    """One layer's packed tensors from its parts' (stacked along the output features)."""
    if any(not torch.equal(p["g_idx"], parts[0]["g_idx"]) for p in parts):
        raise ExportError(f"the parts of {path} group their input features differently (g_idx); cannot join them")
    zeros = [unpack_cols(p["qzeros"], bits, p["scales"].shape[1]) for p in parts]
    return {
        "qweight": torch.cat([p["qweight"] for p in parts], 1),
        "qzeros": pack_cols(torch.cat(zeros, 1), bits),
        "scales": torch.cat([p["scales"] for p in parts], 1),
        "g_idx": parts[0]["g_idx"],
    }


def read_gptq_checkpoint(folder) -> GPTQCheckpoint:
    """The checkpoint's settings and where each quantized layer's tensors are; no tensor is read."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ExportError(f"{folder} has no config.json (not a Hugging Face checkpoint folder)")
    config = json.loads(config_file.read_text())
    quant = config.pop("quantization_config", None)
    if not quant or quant.get("quant_method") != "gptq":
        raise ExportError(f"{config_file} has no quantization_config with quant_method 'gptq'")
    try:
        bits, group_size = int(quant["bits"]), int(quant["group_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ExportError(f"{config_file}: quantization_config needs integer 'bits' and 'group_size' ({exc})") from exc
    layers = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            layers.update({key[: -len(".qweight")]: file for key in f.keys() if key.endswith(".qweight")})
    if not layers:
        raise ExportError(f"{folder} has no '*.qweight' tensors: not a GPTQ checkpoint")
    fused, stored = {}, dict(layers)
    for name, parts in SPLIT_PROJECTIONS.get(config.get("model_type"), {}).items():
        for path in [p.removesuffix("." + parts[0]) for p in layers if p.endswith("." + parts[0])]:
            members = tuple(f"{path}.{part}" for part in parts)
            if all(m in layers for m in members):
                fused[f"{path}.{name}"] = members
                layers[f"{path}.{name}"] = layers[members[0]]
                for m in members:
                    del layers[m]
    return GPTQCheckpoint(
        folder, config, quant, bits, group_size, quant.get("checkpoint_format", "gptq") == "gptq", layers, fused, stored
    )
