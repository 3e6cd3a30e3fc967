"""The public API is documented: a docstring for every name in ``__all__``, an entry in api.md.

Fast checks without building the docs. The docs build itself
(``python -m sphinx -W --keep-going -b html docs docs/_build/html``) runs the pages' code
and fails when api.md misses a name (``docs/_ext/api_coverage.py``).
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

import pytest

import meshensemble as me

ROOT = pathlib.Path(__file__).resolve().parent.parent
API_MD = ROOT / "docs" / "api.md"
PACKAGE = pathlib.Path(me.__file__).resolve().parent


def attribute_docstrings() -> dict[str, list[str]]:
    """Module-level ``NAME = value`` followed by a string literal, in every package module."""
    docs: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.glob("*.py")):
        body = ast.parse(path.read_text()).body
        for stmt, nxt in zip(body, body[1:]):
            targets = (
                stmt.targets
                if isinstance(stmt, ast.Assign)
                else [stmt.target]
                if isinstance(stmt, ast.AnnAssign)
                else []
            )
            is_doc = (
                isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
                and nxt.value.value.strip()
            )
            for target in targets:
                if isinstance(target, ast.Name) and is_doc:
                    docs.setdefault(target.id, []).append(nxt.value.value)
    return docs


def own_docstring(name: str, obj: object) -> str | None:
    """The docstring ``obj`` was given, not one made by ``dataclasses`` or inherited."""
    if inspect.ismodule(obj) or inspect.isroutine(obj):
        return inspect.getdoc(obj)
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__")
        # dataclasses fill a missing docstring with the signature, "Name(field: type, ...)".
        if not doc or doc.startswith(f"{obj.__name__}("):
            return None
        return doc
    return None  # constants: see attribute_docstrings


@pytest.mark.parametrize("name", me.__all__)
def test_public_name_has_docstring(name):
    obj = getattr(me, name)
    if inspect.ismodule(obj) or inspect.isroutine(obj) or inspect.isclass(obj):
        doc = own_docstring(name, obj)
        assert doc and doc.strip(), f"meshensemble.{name} has no docstring"
    else:
        docs = attribute_docstrings().get(name)
        assert docs, (
            f"meshensemble.{name} is a constant without a docstring: put a string literal "
            f'on the line after "{name} = ..." in the module that defines it'
        )


@pytest.mark.parametrize("name", me.__all__)
def test_public_name_in_api_reference(name):
    text = API_MD.read_text()
    pattern = rf"^\.\. auto\w+::\s+meshensemble\.{re.escape(name)}\s*$"
    assert re.search(pattern, text, re.MULTILINE), (
        f"docs/api.md has no autodoc entry for meshensemble.{name}; add e.g. "
        f"'.. autofunction:: meshensemble.{name}' in an eval-rst block"
    )


def test_all_names_exist():
    missing = [name for name in me.__all__ if not hasattr(me, name)]
    assert not missing, f"in meshensemble.__all__ but not defined: {missing}"
