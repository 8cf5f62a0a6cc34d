"""Recipes as YAML or TOML files, parsed into the same typed pass configs as the Python API.

    name: w4-careful
    description: GPTQ 4-bit with act-order
    passes:
      - pass: GPTQ
        bits: 4
        group_size: 128
        act_order: true

Each entry names a pass and sets its dataclass fields; the pass's own validation then checks the
values. A built-in pass is named by its class name (``GPTQ``), one of your own by its import path
(``pass: mypackage.passes:ClipWeights``: the module is imported; ``qcompiler/pipeline/pass_registry.py``).
Unknown passes or keys are errors that name the entry and suggest the nearest valid name. TOML:
the same structure, with ``[[passes]]`` tables.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
import typing
from pathlib import Path
from typing import Any

from qcompiler.errors import RecipeError
from qcompiler.files.regular_files import file_kind, read_regular_file
from qcompiler.pipeline.pass_base import GraphProperty, Pass
from qcompiler.pipeline.pass_registry import pass_name, resolve_pass
from qcompiler.pipeline.recipes import Recipe, get_recipe

__all__ = [
    "load_recipe_file",
    "recipe_from_dict",
    "recipe_to_dict",
    "resolve_recipe",
    "with_overrides",
    "with_embeddings",
    "EMBEDDING_SETTING",
]

_TOP_KEYS = ("name", "description", "passes")


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(sorted(options))}"


def _check_type(where: str, field: dataclasses.Field, value: Any, hints: dict) -> Any:
    """Values from a file arrive as YAML/TOML scalars; catch the mismatches the pass would not."""
    expected = hints.get(field.name, field.type)
    if typing.get_origin(expected) is tuple:
        inner = typing.get_args(expected)[0] if typing.get_args(expected) else str
        if typing.get_origin(inner) is tuple:  # a list of string pairs (MixedPrecision's plan)
            width = len(typing.get_args(inner))
            ok = isinstance(value, (list, tuple)) and all(
                isinstance(v, (list, tuple)) and len(v) == width and all(isinstance(s, str) for s in v) for v in value
            )
            if not ok:
                raise RecipeError(
                    f"{where}: {field.name}={value!r} must be a list of [{', '.join(['string'] * width)}]"
                )
            return tuple(tuple(v) for v in value)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):  # ignore patterns
            raise RecipeError(f"{where}: {field.name}={value!r} must be a list of strings")
        return tuple(value)
    allowed = typing.get_args(expected) or (expected,)
    allowed = tuple(typing.get_origin(a) or a for a in allowed)
    if isinstance(value, bool) and bool not in allowed:
        raise RecipeError(f"{where}: {field.name}={value!r} must be {_type_names(allowed)}, not a boolean")
    if isinstance(value, int) and not isinstance(value, bool) and int not in allowed and float in allowed:
        return float(value)
    if not isinstance(value, tuple(a for a in allowed if isinstance(a, type))):
        raise RecipeError(f"{where}: {field.name}={value!r} must be {_type_names(allowed)}")
    return value


def _type_names(types) -> str:
    return " or ".join("null" if t is type(None) else getattr(t, "__name__", str(t)) for t in types)


def recipe_from_dict(data: Any, source: str = "recipe", *, allow_import: bool = True) -> Recipe:
    """A :class:`Recipe` from parsed YAML/TOML (or a saved artifact's manifest: ``allow_import``
    False, only passes already imported resolve)."""
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: a recipe is a mapping with 'passes' (and optional 'name', 'description')")
    for key in data:
        if key not in _TOP_KEYS:
            raise RecipeError(f"{source}: unknown key {key!r}{_suggest(key, _TOP_KEYS)}")
    entries = data.get("passes")
    if not isinstance(entries, list):
        raise RecipeError(f"{source}: 'passes' must be a list of {{pass: Name, ...settings}} entries")
    built = []
    for i, entry in enumerate(entries):
        where = f"{source}: passes[{i}]"
        if not isinstance(entry, dict) or "pass" not in entry:
            raise RecipeError(
                f"{where}: each entry needs 'pass: <name>' (a built-in pass such as GPTQ, "
                f"or 'package.module:ClassName')"
            )
        name = entry["pass"]
        cls = resolve_pass(name, allow_import=allow_import, where=where)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        settings = {}
        for key, value in entry.items():
            if key == "pass":
                continue
            if key not in fields:
                raise RecipeError(f"{where} ({name}): unknown key {key!r}{_suggest(key, fields)}")
            settings[key] = _check_type(f"{where} ({name})", fields[key], value, hints)
        try:
            built.append(cls(**settings))
        except (ValueError, TypeError) as err:
            raise RecipeError(f"{where} ({name}): {err}") from None
    return Recipe(str(data.get("name", Path(source).stem)), tuple(built), str(data.get("description", "")))


def recipe_to_dict(recipe: Recipe) -> dict:
    """The inverse of :func:`recipe_from_dict`."""
    return {
        "name": recipe.name,
        "description": recipe.description,
        "passes": [{"pass": pass_name(type(p)), **p.config()} for p in recipe.passes],
    }


MAX_RECIPE_BYTES = 1 << 20  # a recipe is a few lines; a bigger file is a mistake or an attack


def _yaml_without_aliases(text: str):
    """YAML with anchors/aliases refused: their expansion is how a few hundred bytes become gigabytes."""
    import yaml

    class NoAliases(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise RecipeError(f"YAML aliases (*name) are not allowed in recipe files (line {mark.line + 1})")
            return super().compose_node(parent, index)

    return yaml.load(text, Loader=NoAliases)  # noqa: S506 - a SafeLoader subclass


def load_recipe_file(path) -> Recipe:
    """Parse a ``.yaml``/``.yml`` or ``.toml`` recipe file."""
    path = Path(path)
    if not path.exists():
        raise RecipeError(f"recipe file {path} does not exist")
    if not path.is_file():  # a device (/dev/zero), a FIFO or a folder, also behind a link: never opened
        raise RecipeError(f"recipe file {path} is not a regular file (it is a {file_kind(path)})")
    try:  # the link the user named resolved; the file read once, bounded, still regular when opened
        text = read_regular_file(path.resolve(), MAX_RECIPE_BYTES).decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError(f"recipe file {path} is not UTF-8 text (byte {e.start})") from None
    except ValueError:  # read_regular_file: over the bound
        raise RecipeError(
            f"recipe file {path} is larger than recipes are limited to ({MAX_RECIPE_BYTES} bytes)"
        ) from None
    except OSError as e:
        raise RecipeError(f"recipe file {path} cannot be read: {e.strerror}") from None
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = _yaml_without_aliases(text)
        else:
            raise RecipeError(f"recipe file {path}: use a .yaml, .yml or .toml file")
    except RecipeError:
        raise
    except Exception as err:  # yaml.YAMLError / tomllib.TOMLDecodeError: say where
        first = str(err).strip().splitlines()
        raise RecipeError(
            f"recipe file {path} is not valid {path.suffix[1:].upper()}: {' '.join(line.strip() for line in first[:3])}"
        ) from None
    return recipe_from_dict(data, source=str(path))


def resolve_recipe(recipe) -> Recipe:
    """A recipe name, a recipe file (.yaml/.toml), a Recipe, or a list of passes, as a Recipe."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str) and (
        recipe.endswith((".yaml", ".yml", ".toml")) or "/" in recipe or os.path.isfile(recipe)
    ):
        return load_recipe_file(recipe)
    if isinstance(recipe, str):
        return get_recipe(recipe)
    if isinstance(recipe, Pass):
        return Recipe("custom", (recipe,))
    if isinstance(recipe, (list, tuple)):
        return Recipe("custom", tuple(recipe))
    raise RecipeError(f"recipe must be a name, a qc.Recipe or a list of passes, got {type(recipe).__name__}")


def with_overrides(recipe: Recipe, **settings: Any) -> Recipe:
    """``recipe`` with each given setting (``bits=3``, ``group_size=64``, ``ignore=("lm_head",)``)
    applied to every pass that has that field: the command line's shortcuts for the common case.
    A setting no pass of the recipe has is an error naming both; each pass validates its values."""
    settings = {k: v for k, v in settings.items() if v is not None}
    if not settings:
        return recipe
    passes = list(recipe.passes)
    for key, value in settings.items():
        fields = [i for i, p in enumerate(passes) if dataclasses.is_dataclass(p) and key in _field_names(p)]
        if not fields:
            names = ", ".join(pass_name(type(p)) for p in passes) or "no passes"
            raise RecipeError(f"recipe {recipe.name} has no pass with a {key!r} setting ({names})")
        for i in fields:
            hints = typing.get_type_hints(type(passes[i]))
            field = next(f for f in dataclasses.fields(passes[i]) if f.name == key)
            checked = _check_type(f"--{key.replace('_', '-')}", field, value, hints)
            if key == "ignore":  # patterns add to the recipe's own
                checked = tuple(dict.fromkeys((*getattr(passes[i], key), *checked)))
            passes[i] = dataclasses.replace(passes[i], **{key: checked})
    label = ", ".join(f"{k}={v}" for k, v in settings.items())
    return Recipe(f"{recipe.name} ({label})", tuple(passes), recipe.description)


EMBEDDING_SETTING = re.compile(r"w(\d+)g(-1|\d+)")  # an embedding table's "wBITSgGROUP" (--embeddings, AutoBits)


def with_embeddings(recipe: Recipe, spec: str | None) -> Recipe:
    """``recipe`` with ``QuantizeEmbeddings`` at ``spec`` — ``w8g128``: bits and group size — the command
    line's ``--embeddings`` (None: ``recipe`` unchanged). It runs just before the first pass that
    quantizes weights: after what folds into the table (rotations), and before the weight solves,
    so a tied table's GPTQ reads the FP model's hidden states and the blocks' solves see the
    quantized lookup (Gemma-3 270M, GPTQ w4g32 + w4g64 table: KL 0.218 this way, 0.223 after)."""
    if spec is None:
        return recipe
    if spec == "auto":  # the table as one more item of auto:B's budget
        return _with_table_in_budget(recipe)
    match = EMBEDDING_SETTING.fullmatch(spec)
    if match is None:
        raise RecipeError(f"--embeddings {spec!r} is not wBITSgGROUP (e.g. w8g128, w4g32) or auto")
    cls = resolve_pass("QuantizeEmbeddings", allow_import=False, where="--embeddings")
    quantize = cls(bits=int(match[1]), group_size=int(match[2]))
    passes = list(recipe.passes)
    at = next((i for i, p in enumerate(passes) if GraphProperty.QUANTIZED_WEIGHTS in p.provides), len(passes))
    passes.insert(at, quantize)
    return Recipe(f"{recipe.name} + embeddings {spec}", tuple(passes), recipe.description)


def _with_table_in_budget(recipe: Recipe) -> Recipe:
    """``--embeddings auto``: every pass that can put the table in its budget (one declaring
    ``TABLE_SETTINGS``: AutoBits) given those settings, so its budget counts the table too."""
    passes, changed = [], False
    for p in recipe.passes:
        settings = getattr(type(p), "TABLE_SETTINGS", None)
        if settings and not p.embeddings:
            p, changed = dataclasses.replace(p, embeddings=settings), True
        passes.append(p)
    if not changed:
        raise RecipeError(
            f"--embeddings auto puts the table in auto:B's budget, and recipe {recipe.name} has no auto pass: "
            "use an auto recipe (auto:4.5) or a setting such as --embeddings w4g64"
        )
    return Recipe(f"{recipe.name} + embeddings in its budget", tuple(passes), recipe.description)


def _field_names(p) -> set[str]:
    return {f.name for f in dataclasses.fields(p)}
