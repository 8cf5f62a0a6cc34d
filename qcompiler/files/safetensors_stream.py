"""A safetensors file written one tensor at a time.

``safetensors.torch.save_file`` takes every tensor at once, so saving a model whose quantized blocks
wait on disk (``spill.py``) or in a streamed checkpoint would first read all of them back: the whole
packed model resident at the end of a run that held one block at a time, the out-of-memory at save
time that costs users hours (llm-compressor issue 1718). The format is a little-endian u64 header
length, a JSON header (dtype, shape and byte range of each tensor, optional string metadata), then
the tensors' bytes; the header needs only shapes and dtypes, so each tensor is read just before its
bytes are written and dropped after. Files read back with ``safe_open`` / ``load_file`` like any.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from typing import BinaryIO, Callable, NamedTuple, Optional

import torch

__all__ = ["StreamedTensor", "write_streamed"]

_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


class StreamedTensor(NamedTuple):
    """One tensor to write: its dtype and shape up front, its values from ``read()`` when written."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]


def write_streamed(f: BinaryIO, tensors: dict[str, StreamedTensor], metadata: Optional[dict[str, str]] = None) -> None:
    """Write ``tensors`` (in their order) to the open binary file ``f`` as safetensors; at most one
    tensor's values are held at a time. A tensor whose ``read()`` disagrees with its announced dtype
    or shape is refused by name (the header is already written: callers write to a temporary file)."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors files are little-endian; this machine is not")
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor {name}: safetensors has no dtype {t.dtype}")
        size = math.prod(int(d) for d in t.shape) * t.dtype.itemsize
        header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the reference writer does
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for name, t in tensors.items():
        value = t.read()
        if value.dtype != t.dtype or tuple(value.shape) != tuple(t.shape):
            raise ValueError(
                f"tensor {name}: read {value.dtype} {list(value.shape)}, announced {t.dtype} {list(t.shape)}"
            )
        if value.numel():
            f.write(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        del value
