"""Strings from files (a manifest, a model folder, a recipe) escaped for where they go: a terminal
must never obey them (clear the screen, write the clipboard, fake lines) and a markdown page must
never render them as HTML, links or layout (IDE previews and static-site builds run inline HTML)."""

from __future__ import annotations

import html
import re
import unicodedata

__all__ = ["printable", "markdown_text", "markdown_code"]

_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\](){}#+!|~<>])")


def printable(text: str, *, newlines: bool = True) -> str:
    """``text`` with every control or format character escaped (``\\x1b``)."""
    return "".join(
        ch if (ch == "\n" and newlines) or unicodedata.category(ch)[0] != "C" else ascii(ch)[1:-1] for ch in text
    )


def markdown_text(value) -> str:
    """``value`` as inert markdown text on one line: control characters escaped, HTML's ``& < >``
    as entities, every markdown mark (links, emphasis, code, table bars) backslash-escaped."""
    text = html.escape(printable(str(value), newlines=False), quote=False)
    return _MARKDOWN_SPECIAL.sub(r"\\\1", text)


def markdown_code(value) -> str:
    """``value`` as code that cannot close early: an HTML ``<code>`` element around the same inert
    text (markdown is still parsed inside inline HTML, so a link or a ``|`` in a layer name must be
    escaped there too; a markdown code span would end at the name's first backtick)."""
    return f"<code>{markdown_text(value)}</code>"
