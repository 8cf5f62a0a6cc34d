"""``cm.report``: what each pass did, per layer, printable and JSON-serializable."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from qcompiler.pipeline.pass_base import PassRecord

__all__ = ["Report"]


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


@dataclass
class Report:
    """What every pass did, in order (``cm.report``)."""

    passes: list[PassRecord] = field(default_factory=list)

    def to_dict(self) -> dict:
        """The report as JSON-safe data (saved in artifacts)."""
        return {"passes": [asdict(p) for p in self.passes]}

    def layer_table(self, pass_name: str | None = None) -> list[dict]:
        """One row per (pass, layer) with that layer's figures."""
        return [
            {"pass": p.name, "layer": path, **figures}
            for p in self.passes
            if pass_name in (None, p.name)
            for path, figures in p.layers.items()
        ]

    def __str__(self) -> str:
        if not self.passes:
            return "no passes applied"
        lines = []
        for p in self.passes:
            lines.append(
                f"{p.name}: {p.seconds:.2f}s, {'modified' if p.modified else 'unchanged'}, {len(p.layers)} layers"
            )
            keys = sorted({k for figures in p.layers.values() for k, v in figures.items() if not isinstance(v, list)})
            if keys:
                lines.append("  " + " | ".join(["layer"] + keys))
                for path, figures in p.layers.items():
                    lines.append("  " + " | ".join([path] + [_fmt(figures.get(k, "")) for k in keys]))
            lines.extend(f"  note: {n}" for n in p.notes)
        return "\n".join(lines)
