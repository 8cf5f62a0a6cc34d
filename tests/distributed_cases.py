"""Run by tests/test_distributed.py as 1 and as 2 ranks (``run_ranks``): each case compiles a small
random-weight model with a recipe inside the process group; rank 0 saves each artifact under the
folder given, so the test can compare the tensors of the two runs bit for bit."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from causal_lms import causal_lm, prompt  # noqa: E402

import qcompiler as qc  # noqa: E402
from qcompiler.distributed.ranks import join_from_environment, leave  # noqa: E402

CASES = {  # name: (architecture, recipe)
    "llama-gptq": ("llama", "gptq-w4g128"),
    # o_proj and down_proj alone in their groups: their rows are split between the two ranks
    "llama-gptq-sequential": ("llama", [qc.passes.GPTQ(group_size=32, true_sequential=True)]),
    "llama-spqr": ("llama", "spqr-w3g16"),
    "llama-smoothquant-w8a8": ("llama", "w8a8-smoothquant-auto"),
    "qwen2-w8a8-static": ("qwen2", "w8a8-static"),
    "mixtral-gptq": ("mixtral", "gptq-w4g128"),
    "qwen2_moe-rtn": ("qwen2_moe", "rtn-w4g128"),
}


def calibration() -> list[dict]:
    """Five batches (shards of 3 and 2 on two ranks); the last one padded."""
    gen = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(3, 128, (2, 24), generator=gen)} for _ in range(5)]
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, 17:] = 0
    batches[-1]["attention_mask"] = mask
    return batches


def _die_at_block(block: int, note: Path) -> None:
    """This rank kills itself (SIGKILL: nothing of it unwinds) when the walk starts ``block``."""
    from qcompiler.pipeline import block_walk as weight_only

    solve, seen = weight_only._solve_block, [0]

    def dying(*args, **kwargs):
        if seen[0] == block:
            note.write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        seen[0] += 1
        return solve(*args, **kwargs)

    weight_only._solve_block = dying


class _Tee:
    """Rank 0's progress lines, also kept in a file the test reads."""

    def __init__(self, path: Path):
        self.file, self.stream = open(path, "w"), sys.stderr

    def write(self, text: str) -> int:
        self.file.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.file.flush()
        self.stream.flush()


def main(out: Path, cases: list[str]) -> None:
    """Each case in turn; a name ending in ``+rank1-dies`` makes rank 1 kill itself in block 2.
    Rank 0's progress lines go to ``{out}-progress.txt`` too. ``QC_CASES_CHECKPOINT=DIR`` records
    the run's progress in DIR (``QC_CASES_RESUME=1``: continue it), for one case per process."""
    ranks = join_from_environment(None, 120.0)
    if ranks.is_root:
        sys.stderr = _Tee(out.parent / f"{out.name}-progress.txt")
    try:
        for name in cases:
            name, dies = name.removesuffix("+rank1-dies"), name.endswith("+rank1-dies")
            if dies and ranks.rank == 1:
                _die_at_block(1, out.parent / "rank1-died-at")
            arch, recipe = CASES[name]
            cm = qc.compile(
                causal_lm(arch),
                {"input_ids": prompt()},
                recipe=recipe,
                calibration=calibration(),
                checkpoint=os.environ.get("QC_CASES_CHECKPOINT"),  # progress recorded there, kept
                resume=bool(os.environ.get("QC_CASES_RESUME")),
                keep_checkpoint=True,
            )
            if ranks.is_root:
                cm.save(out / name)
    finally:
        leave()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or list(CASES))
