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
