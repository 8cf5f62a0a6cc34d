"""The input Hessian ``XᵀX / n`` of one linear outside the blocks (a tied output head), gathered by
running the graph on the calibration up to that linear and no further.

The block walk (``calib/calibration.py``) collects Hessians block by block; a linear after the last
block — Gemma-3's head, which reads the embedding table — is reached by no walk. Running the whole
graph would compute the head too (on a 262k vocabulary the most expensive product of the model), so
the run stops when the linear's input is known. Positions an attention mask marks as padding are
left out, as the block walk leaves them out.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node
from torch.fx._pytree import tree_flatten_spec

from qcompiler.pipeline.sensitivity import StoredWeights

__all__ = ["input_hessian"]


class _Reached(Exception):
    """The linear's input was computed: the run stops here."""


class _UpTo(StoredWeights):
    def __init__(self, gm: GraphModule, stop: Node, source: Node):
        super().__init__(gm)
        self.stop, self.source, self.value = stop, source, None

    def run_node(self, n: Node):
        if n is self.stop:
            self.value = self.env[self.source]
            raise _Reached
        return super().run_node(n)


def input_hessian(
    gm: GraphModule, linear: Node, source: Node, batches: list, device: Optional[torch.device] = None
) -> tuple[torch.Tensor, int]:
    """``(H, rows)``: ``Σ x xᵀ / rows`` over the rows ``x`` that ``source`` (the linear's input) takes on
    the calibration ``batches`` (normalized ``(args, kwargs)``), in float32 on ``device``."""
    runner = _UpTo(gm, linear, source)
    H, rows = None, 0
    for batch in batches:
        try:
            runner.run(*tree_flatten_spec(batch, gm._in_spec))
        except _Reached:
            pass
        x = runner.value
        if x is None:
            raise RuntimeError(f"the graph's run on calibration never reached {linear.name}")
        x = x.detach().to(device or x.device, torch.float32).reshape(-1, x.shape[-1])
        mask = batch[1].get("attention_mask") if isinstance(batch[1], dict) else None
        if mask is not None and mask.numel() == x.shape[0]:
            x = x[mask.reshape(-1).to(x.device) != 0]
        H = x.T @ x if H is None else H.addmm_(x.T, x)
        rows += x.shape[0]
        runner.value = None
    return H / max(rows, 1), rows
