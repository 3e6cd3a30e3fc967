"""Sphinx extension: docstrings of constants that a package re-exports.

``meshensemble.ENSEMBLE`` is defined (with its docstring, the string literal under the
assignment) in ``meshensemble/mesh.py`` and re-exported by ``meshensemble/__init__.py``.
autodoc looks for an attribute docstring only in the module it documents the name from,
finds none in ``__init__.py`` and falls back to the value's type docstring (``str``'s).
This hook (``autodoc-process-docstring``) replaces that with the attribute docstring of
the submodule that defines the same object, and otherwise drops the type's docstring.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from sphinx.application import Sphinx
from sphinx.pycode import ModuleAnalyzer, PycodeError
from sphinx.util.docstrings import prepare_docstring


def _attr_docs(modname: str) -> dict[tuple[str, str], list[str]]:
    try:
        analyzer = ModuleAnalyzer.for_module(modname)
        analyzer.analyze()
    except PycodeError:
        return {}
    return analyzer.attr_docs


def _text(lines: list[str]) -> str:
    return "\n".join(line.rstrip() for line in lines).strip()


def defining_docstring(pkgname: str, attr: str, obj: Any) -> list[str] | None:
    """The attribute docstring of ``attr`` in the submodule of ``pkgname`` that defines it."""
    pkg = importlib.import_module(pkgname)
    for info in pkgutil.iter_modules(getattr(pkg, "__path__", [])):
        modname = f"{pkgname}.{info.name}"
        try:
            module = importlib.import_module(modname)
        except Exception:  # noqa: BLE001 - a submodule that cannot import defines nothing
            continue
        if getattr(module, attr, None) is not obj:
            continue
        doc = _attr_docs(modname).get(("", attr))
        if doc:
            return list(doc)
    return None


def process_docstring(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    if what != "data":
        return
    modname, _, attr = name.rpartition(".")
    if not modname or _attr_docs(modname).get(("", attr)):
        return  # documented where autodoc looked
    type_doc = type(obj).__doc__
    if lines and (type_doc is None or _text(lines) != _text(prepare_docstring(type_doc))):
        return  # a docstring of its own, not the type's
    found = defining_docstring(modname, attr, obj)
    lines[:] = found if found is not None else []


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("autodoc-process-docstring", process_docstring)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
