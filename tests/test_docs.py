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


MESH_PAGES = ("data_parallel.md", "howto_mesh.md", "regression.md", "testing.md", "uncertainty.md")
"""Pages whose executed code builds meshes of 8 devices: a reader pastes it on a CPU."""
FAKE_DEVICES = re.compile(r"^\s*(me\.use_fake_cpu_devices|set_fake_cpu_devices)\(8\)", re.M)


def exec_code(page: str) -> str:
    """Every ``{exec-code}`` block of ``docs/<page>``, in order (one namespace, as built)."""
    text = (ROOT / "docs" / page).read_text()
    return "\n".join(re.findall(r"```\{exec-code\}[^\n]*\n(.*?)```", text, re.DOTALL))


@pytest.mark.parametrize("page", MESH_PAGES)
def test_a_page_that_builds_meshes_sets_its_devices_before_it_computes(page):
    """The docs build sets 8 CPU devices in conf.py; a reader's Python has one, so the
    page's code sets them itself, before its first mesh (else it fails as pasted)."""
    code = exec_code(page)
    found = FAKE_DEVICES.search(code)
    assert found, f"docs/{page} never calls me.use_fake_cpu_devices(8)"
    first = min(code.find(k) for k in ("make_mesh", "jax.devices()", "device_count") if k in code)
    assert found.start() < first, f"docs/{page} makes a mesh before setting its devices"


@pytest.mark.slow
@pytest.mark.parametrize("page", ["howto_mesh.md", "regression.md"])
def test_a_pages_code_runs_as_pasted_in_a_fresh_python_on_a_cpu(page, tmp_path):
    """The page's executed code, in a new process with one CPU device and no XLA flags
    (what a reader has), not the docs build's 8 devices (about 30 s each on 2 cores)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["JAX_PLATFORMS"] = "cpu"
    code = exec_code(page)
    assert "make_mesh" in code, f"docs/{page}: its mesh code is not executed by the docs build"
    code = "save_figure = lambda *a, **k: None\n" + code
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_diabetes_split_sizes_written_in_the_docs_are_the_datas():
    """Every "(N train, M test)" the regression page states is ``me.data.diabetes``'s."""
    pytest.importorskip("sklearn")
    data = me.data.diabetes(seed=0)
    want = (len(data.x_train), len(data.x_test))
    text = (ROOT / "docs" / "regression.md").read_text()
    found = [tuple(map(int, m)) for m in re.findall(r"(\d+) train, (\d+) test", text)]
    assert found and all(f == want for f in found), (found, want)
    assert want == (354, 88)


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
