"""The few collectives a distributed run needs, on the default process group: exact sums and
maxima of statistics, rows gathered in rank order, and a rank's results sent to every rank.

Tensors travel as raw bytes described by a JSON header (names, dtypes from an allow-list, shapes):
no pickle crosses between processes. Under NCCL they travel through this rank's GPU.
"""

from __future__ import annotations

import json
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["all_sum", "sum_to", "all_max", "gather_rows", "broadcast_json", "broadcast_tensors"]

_DTYPES = {
    str(dt): dt
    for dt in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def _wire() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduced(t: torch.Tensor, op) -> torch.Tensor:
    buf = t.to(_wire())
    dist.all_reduce(buf, op=op)
    return buf.to(t.device)


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """The element-wise sum over ranks. For float64 sums of float32 products (the Hessians) every
    partial sum is exact in practice, so the order the backend adds in does not change a bit."""
    return _reduced(t, dist.ReduceOp.SUM)


def sum_to(t: torch.Tensor, dst: int) -> Optional[torch.Tensor]:
    """The element-wise sum over ranks on rank ``dst`` (exact as ``all_sum``); None elsewhere."""
    buf = t.to(_wire())
    dist.reduce(buf, dst, op=dist.ReduceOp.SUM)
    return buf.to(t.device) if dist.get_rank() == dst else None


def all_max(t: torch.Tensor) -> torch.Tensor:
    """The element-wise maximum over ranks (exact in any order)."""
    return _reduced(t, dist.ReduceOp.MAX)


def gather_rows(rows: torch.Tensor) -> torch.Tensor:
    """Every rank's ``rows`` ``[n_r, ...]`` concatenated in rank order (``n_r`` may differ)."""
    wire = _wire()
    counts = [torch.zeros(1, dtype=torch.int64, device=wire) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([rows.shape[0]], dtype=torch.int64, device=wire))
    counts = [int(c) for c in counts]
    padded = torch.zeros((max(counts), *rows.shape[1:]), dtype=rows.dtype, device=wire)
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, counts)]).to(rows.device)


def _broadcast_bytes(data: Optional[bytes], src: int) -> bytes:
    wire = _wire()
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=wire)
    dist.broadcast(size, src)
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(wire)
        if data is not None
        else torch.empty(int(size), dtype=torch.uint8, device=wire)
    )
    dist.broadcast(buf, src)
    return bytes(buf.cpu().numpy().tobytes())


def broadcast_json(obj, src: int):
    """``obj`` (JSON data: numbers, strings, lists, dicts; inf/nan allowed) from rank ``src``."""
    data = json.dumps(obj).encode() if dist.get_rank() == src else None
    return json.loads(_broadcast_bytes(data, src).decode())


def broadcast_tensors(tensors: Optional[dict[str, torch.Tensor]], src: int, device: torch.device) -> dict:
    """Rank ``src``'s named tensors on every rank (on ``device`` there); other ranks pass None."""
    header = None
    if dist.get_rank() == src:
        header = [[name, str(t.dtype), list(t.shape)] for name, t in tensors.items()]
    header = broadcast_json(header, src)
    wire, out = _wire(), {}
    for name, dtype, shape in header:
        if dtype not in _DTYPES:
            raise ValueError(f"rank {src} sent tensor {name!r} of unsupported dtype {dtype!r}")
        dtype = _DTYPES[dtype]
        if dist.get_rank() == src:
            t = tensors[name].detach().contiguous()
            buf = t.reshape(-1).view(torch.uint8).to(wire)
        else:
            numel = 1
            for d in shape:
                numel *= int(d)
            buf = torch.empty(numel * torch.empty((), dtype=dtype).element_size(), dtype=torch.uint8, device=wire)
        if buf.numel():
            dist.broadcast(buf, src)
        out[name] = tensors[name] if dist.get_rank() == src else buf.view(dtype).reshape(shape).to(device)
    return out
