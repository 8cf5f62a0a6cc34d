"""Which layers a pass leaves in full precision: ``ignore`` patterns over module paths.

A pattern is an fnmatch glob over the whole path (``model.layers.0.*``, ``*.down_proj``) or, as
llm-compressor writes them, ``re:`` followed by a regular expression searched in the path
(``re:.*mlp\\.gate$``). A pattern that matches no layer is reported: it is almost always a typo.
"""

from __future__ import annotations

import fnmatch
import re
import warnings
from typing import Iterable, Optional

from qcompiler.errors import QuantizationError

__all__ = ["check_patterns", "matching_pattern", "ignore_reason", "report_unmatched"]


def check_patterns(owner: str, patterns) -> tuple[str, ...]:
    """``patterns`` as a tuple of valid patterns (a single string is one pattern)."""
    if isinstance(patterns, str):
        patterns = (patterns,)
    try:
        patterns = tuple(patterns)
    except TypeError:
        raise QuantizationError(f"{owner}: ignore must be a list of module-path patterns, got {patterns!r}") from None
    for p in patterns:
        if not isinstance(p, str) or not p.strip():
            raise QuantizationError(f"{owner}: ignore pattern {p!r} is not a non-empty string")
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                raise QuantizationError(
                    f"{owner}: ignore pattern {p!r} is not a valid regular expression ({e})"
                ) from None
    return patterns


def matching_pattern(path: str, patterns: Iterable[str]) -> Optional[str]:
    """The first pattern that matches module path ``path`` (None: the layer is not ignored)."""
    for p in patterns:
        if re.search(p[3:], path) if p.startswith("re:") else fnmatch.fnmatchcase(path, p):
            return p
    return None


def ignore_reason(path: str, patterns: Iterable[str]) -> Optional[str]:
    """Why a pass leaves ``path`` alone (``ignored (matches '*.down_proj')``), or None."""
    pattern = matching_pattern(path, patterns)
    return None if pattern is None else f"ignored (matches {pattern!r})"


def report_unmatched(owner: str, patterns: Iterable[str], paths: Iterable[str], notes: list) -> None:
    """Note and warn about every pattern that matched none of ``paths``."""
    paths = list(paths)
    for p in patterns:
        if not any(matching_pattern(path, (p,)) for path in paths):
            message = (
                f"ignore pattern {p!r} matched no layer (layers look like {paths[0]!r})"
                if paths
                else f"ignore pattern {p!r} matched no layer"
            )
            notes.append(message)
            warnings.warn(f"qcompiler: {owner}: {message}", stacklevel=3)
