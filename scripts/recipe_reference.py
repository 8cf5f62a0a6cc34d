"""Print docs/recipes.md from the code: built-in recipes and every pass's settings.

    python scripts/recipe_reference.py > docs/recipes.md

tests/test_artifacts_and_interop.py checks the committed page is current.
"""

from __future__ import annotations

import dataclasses
import typing

import qcompiler as qc


def _type_name(t) -> str:
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


def page() -> str:
    lines = [
        "# Recipe reference",
        "",
        'A recipe is an ordered list of passes. Use a built-in name (`recipe="gptq-w4g128"`, `--recipe gptq-w4g128`),',
        "a YAML/TOML file, or a Python list of pass instances.",
        "",
        "## Built-in recipes",
        "",
        "| name | what it does | passes |",
        "|---|---|---|",
    ]
    for r in qc.list_recipes():
        passes = ", ".join(f"`{p!r}`" for p in r.passes) or "-"
        lines.append(f"| `{r.name}` | {r.description} | {passes} |")
    auto = qc.get_recipe("auto:3.25")
    lines += [
        "",
        "## Automatic mixed precision: `auto:B`",
        "",
        '`recipe="auto:3.25"` (`--recipe auto:3.25`) runs '
        + ", ".join(f"`{p!r}`" for p in auto.passes)
        + ": every candidate is tried on every block linear alone (on `score_rows` sampled rows of it, the "
        "estimate scaled to the layer) and its effect on the model's final output "
        "measured on calibration samples; one candidate per layer is then chosen to fit B bits per parameter "
        "(every stored tensor counted, as the report counts them) with the least summed damage, and the "
        "plan is quantized as `MixedPrecision`. B is in (0, 16]; a B below the cheapest allocation of the "
        'candidates is an error naming both. `auto-signround:B` (`AutoBits(finish="signround")`, GPTQ '
        "candidates only) makes the same allocation and quantizes it with SignRound: every block's rounding "
        "tuned jointly, each layer at its planned bits and group size. `rotate-auto:B`, "
        "`rotate-auto-signround:B` and `rotate-auto-float:B` run the Rotate pass first. `auto-gguf:B` chooses among llama.cpp's block "
        "types (`GGUF_CANDIDATES`), `auto-float:B` among the floating-point formats GPUs serve (`FLOAT_CANDIDATES`: "
        "GPTQ on MXFP4, NVFP4 and FP8, one compressed-tensors config group per format); any `gptq-FORMAT` "
        "name (`gptq-nvfp4`, `gptq-fp8-block`, ...) is also a candidate beside the integer ones. "
        "To fix a plan by hand, use `MixedPrecision` "
        "(or `SignRound` with a `plan`) in a recipe file:",
        "",
        "```yaml",
        "name: mixed",
        "passes:",
        "  - pass: MixedPrecision",
        "    default: gptq-w4g128",
        "    plan: [[model.layers.0.mlp.down_proj, gptq-w8g128], [model.layers.1.self_attn.q_proj, gptq-w3g32]]",
        "```",
        "",
        "```yaml",
        "name: w4-act",
        "description: GPTQ 4-bit with act-order",
        "passes:",
        "  - pass: GPTQ",
        "    bits: 4",
        "    group_size: 128",
        "    act_order: true",
        "```",
        "",
        "TOML: the same keys, one `[[passes]]` table per pass. Unknown keys and passes are errors naming the",
        "entry and suggesting the nearest valid name; values are type-checked and then validated by the pass.",
        "",
        "Every pass takes `ignore`: module paths it leaves in full precision, as fnmatch globs over the whole",
        "path or, as llm-compressor writes them, `re:` and a regular expression searched in the path, e.g.",
        '`ignore: ["*.down_proj", "re:layers\\.0\\."]` (Python: `GPTQ(ignore=("*.down_proj",))`). Each ignored layer',
        "is noted in the report; a pattern that matches no layer is a warning (usually a typo). SmoothQuant",
        "leaves alone every producer group with an ignored layer.",
        "",
        "## Pass settings",
        "",
    ]
    for name in qc.passes.__all__:
        cls = getattr(qc.passes, name)
        hints = typing.get_type_hints(cls)
        lines += [
            f"### `{name}`",
            "",
            (cls.__doc__ or "").strip().splitlines()[0],
            "",
            "| key | type | default |",
            "|---|---|---|",
        ]
        lines += [
            f"| `{f.name}` | {_type_name(hints.get(f.name, f.type))} | `{f.default!r}` |"
            for f in sorted(dataclasses.fields(cls), key=lambda f: f.kw_only)  # the keyword-only base fields last
        ]
        lines.append("")
    lines.append("This page is generated from the code: `python scripts/recipe_reference.py > docs/recipes.md`.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(page(), end="")
