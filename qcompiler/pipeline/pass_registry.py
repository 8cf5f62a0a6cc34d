"""One registry of pass classes, shared by the pass manager, recipe files and artifacts.

Every subclass of ``qc.Pass`` joins it when its class is made (``Pass.__init_subclass__``). A
built-in pass (``qcompiler.passes``) is named by its class name (``GPTQ``); any other pass by its
import path, ``package.module:ClassName``. A recipe file may name a pass that is not imported yet
by that path: the module is imported (code the user installed, named by the user), never anything
else. Artifacts are untrusted files, so loading one never imports: it finds only passes already
registered.
"""

from __future__ import annotations

import difflib
import importlib
import re

from qcompiler.errors import RecipeError

__all__ = ["add_pass_class", "pass_name", "resolve_pass", "registered_passes", "BUILTIN_MODULE"]

BUILTIN_MODULE = "qcompiler.passes"
_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_PASSES: dict[str, type] = {}


def pass_name(cls: type) -> str:
    """What recipes and artifacts call ``cls``: its class name if built in, else ``module:Qualname``."""
    if cls.__module__ == BUILTIN_MODULE or cls.__module__.startswith(BUILTIN_MODULE + "."):
        return cls.__name__
    return f"{cls.__module__}:{cls.__qualname__}"


def add_pass_class(cls: type) -> None:
    """Register ``cls`` under :func:`pass_name` (a class made again under the same name replaces it)."""
    _PASSES[pass_name(cls)] = cls


def registered_passes() -> dict[str, type]:
    """Every registered pass class by name, the built-in ones included."""
    importlib.import_module(BUILTIN_MODULE)
    return dict(_PASSES)


def resolve_pass(name: object, *, allow_import: bool, where: str) -> type:
    """The pass class called ``name``. With ``allow_import`` (recipe files), an import path
    ``package.module:ClassName`` that is not registered yet is imported; errors name ``where``."""
    known = registered_passes()
    if isinstance(name, str) and name in known:
        return known[name]
    if not isinstance(name, str) or not _IMPORT_PATH.fullmatch(name):
        builtin = [n for n in known if ":" not in n]
        close = difflib.get_close_matches(str(name), builtin, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; built-in passes: {', '.join(sorted(builtin))}"
        raise RecipeError(f"{where}: unknown pass {name!r}{hint} (a pass of your own: 'package.module:ClassName')")
    if not allow_import:
        raise RecipeError(f"{where}: pass {name!r} is not imported in this process (import its module first)")
    module_name, qualname = name.split(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise RecipeError(
            f"{where}: cannot import module {module_name!r} for pass {name!r} ({type(exc).__name__}: {exc})"
        ) from None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if obj not in _PASSES.values():  # every qc.Pass subclass registered itself when it was made
        raise RecipeError(
            f"{where}: {name!r} is {'missing' if obj is None else type(obj).__name__}, not a qc.Pass subclass"
        )
    return obj
