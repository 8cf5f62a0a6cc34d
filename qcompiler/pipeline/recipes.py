"""Recipes: named, ordered lists of passes, and the registry ``compile(recipe=NAME)`` looks names up in.

A recipe is data: a name, a description and the passes it runs. ``compile()`` accepts a recipe
name, a :class:`Recipe`, or a plain list of passes (including user-written ones). Names are
registered one by one (:func:`register_recipe`) or as a family sharing a prefix whose rest is an
argument (:func:`register_recipe_family`: ``auto:3.25``). The built-in table lives beside the
passes it names (``passes/builtin_recipes.py``), registered when ``qcompiler.passes`` is imported.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable, Sequence

from qcompiler.errors import RecipeError
from qcompiler.pipeline.pass_base import Pass

__all__ = ["Recipe", "register_recipe", "register_recipe_family", "get_recipe", "list_recipes", "recipe_families"]


@dataclass(frozen=True)
class Recipe:
    """A named, ordered list of passes."""

    name: str
    passes: tuple[Pass, ...]
    description: str = ""


_REGISTRY: dict[str, tuple[str, Callable[[], Sequence[Pass]]]] = {}
_FAMILIES: dict[str, tuple[str, Callable[[str], Recipe]]] = {}


def register_recipe(name: str, description: str, factory: Callable[[], Sequence[Pass]]) -> None:
    """Make ``name`` usable in ``compile(recipe=name)``; ``factory`` builds fresh pass instances."""
    _REGISTRY[name] = (description, factory)


def register_recipe_family(prefix: str, grammar: str, build: Callable[[str], Recipe]) -> None:
    """Make every name ``prefix + ARG`` a recipe: ``build(name)`` makes it (fresh passes), raising a
    RecipeError that names the argument when it cannot; ``grammar`` shows the form (``auto:B``)."""
    _FAMILIES[prefix] = (grammar, build)


def recipe_families() -> dict[str, str]:
    """Each registered family's prefix and its grammar."""
    return {prefix: grammar for prefix, (grammar, _) in _FAMILIES.items()}


def get_recipe(name: str) -> Recipe:
    """The registered recipe ``name`` (fresh pass instances) — the longest registered family prefix
    it starts with builds it — or an error suggesting a name."""
    family = max((p for p in _FAMILIES if name.startswith(p)), key=len, default=None)
    if family is not None:
        return _FAMILIES[family][1](name)
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, _REGISTRY, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        forms = f" (and {', '.join(g for g, _ in _FAMILIES.values())})" if _FAMILIES else ""
        raise RecipeError(f"unknown recipe {name!r}{hint} Known recipes: {', '.join(sorted(_REGISTRY))}{forms}")
    description, factory = _REGISTRY[name]
    return Recipe(name, tuple(factory()), description)


def list_recipes() -> list[Recipe]:
    """Every registered recipe (families, which take an argument, are not listed)."""
    return [get_recipe(name) for name in _REGISTRY]
