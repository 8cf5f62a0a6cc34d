"""Where a benchmark writes its JSON.

A full run writes ``results/NAME.json``, the file docs/results.md quotes and git keeps. A ``--quick``
run (a check that the script works, on toy shapes) writes ``results/quick/NAME.json``, which git
ignores, so checking a script never overwrites the committed figures.
"""

from __future__ import annotations

from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def results_file(name: str, quick: bool = False) -> Path:
    return RESULTS_DIR / "quick" / f"{name}.json" if quick else RESULTS_DIR / f"{name}.json"


def cpu_facts() -> dict:
    """The CPU a figure was measured on: its name, cores, and whether it has bf16 / AMX units (without
    them a bf16 checkpoint's products are emulated, or cast to float32: docs/results.md)."""
    import os
    import platform

    import torch

    name = platform.processor()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), name)
    except OSError:
        pass
    return {
        "name": name,
        "cores": os.cpu_count(),
        "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
        "amx": torch.cpu._is_amx_tile_supported(),
    }


def write_rows(name: str, rows: list, quick: bool = False, **meta) -> Path:
    """``{"meta": ..., "rows": rows}`` as results/NAME.json (atomically); meta gets the machine's facts."""
    import json
    import platform
    import time

    import torch

    from qcompiler.files.atomic import write_text_atomically

    meta = dict(
        meta,
        torch=torch.__version__,
        machine=platform.machine(),
        cpu=cpu_facts(),
        threads=torch.get_num_threads(),
        date=time.strftime("%Y-%m-%d"),
    )
    out = results_file(name, quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(out, json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return out


def merged_rows(name: str, rows: list, key=("model", "recipe")) -> list:
    """The committed results/NAME.json rows with those of ``rows``' keys replaced by ``rows`` (a
    partial rerun that keeps the other figures)."""
    import json

    fresh = {tuple(r[k] for k in key) for r in rows}
    kept = json.loads(results_file(name).read_text())["rows"]
    return [r for r in kept if tuple(r[k] for k in key) not in fresh] + rows
