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
    for path in sorted(PACKAGE.rglob("*.py")):
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


def docs_block(page: str, starts: str) -> str:
    """The code of the ``{exec-code}`` block of ``docs/<page>`` that starts with ``starts``."""
    text = (ROOT / "docs" / page).read_text()
    blocks = re.findall(r"```\{exec-code\}[^\n]*\n(.*?)```", text, re.DOTALL)
    found = [b for b in blocks if b.lstrip().startswith(starts)]
    assert found, f"docs/{page} has no exec-code block starting with {starts!r}"
    return found[0]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape,steps", [((8, 1), 600), ((1, 8), 300)])
def test_the_docs_host_loop_is_safe_at_realistic_epoch_sizes(mesh_shape, steps):
    """docs/howto_mesh.md's ``train_epoch`` queues every step without reading a result.

    Before the ensemble bounded its programs in flight, 600 steps on (8, 1) and 200 on
    (1, 8) aborted the process (XLA:CPU's all-reduce rendezvous). The docs' own function
    runs here, unchanged, for a realistic epoch.
    """
    import jax
    import numpy as np
    import optax

    namespace = {"jax": jax, "np": np}
    exec(docs_block("howto_mesh.md", "def train_epoch(ens"), namespace)
    train_epoch = namespace["train_epoch"]
    ens = me.Ensemble(me.models.MLP(), optax.sgd(0.01), 8, me.make_mesh(*mesh_shape))
    rng = np.random.default_rng(0)
    batch = 8
    train_ds = {
        "image": rng.random((steps * batch, 28, 28, 1), dtype=np.float32),
        "label": rng.integers(0, 10, steps * batch).astype(np.int32),
    }
    state = ens.init(jax.random.key(0), train_ds["image"][:1])
    state, loss, accuracy = train_epoch(ens, state, train_ds, batch, jax.random.key(1))
    assert np.isfinite(loss) and 0 <= accuracy <= 1
    assert int(np.asarray(state.step)[0]) == steps
