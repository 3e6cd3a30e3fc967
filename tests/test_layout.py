"""The package's layout rules, read from the source (function-level imports included).

* Rooms from low to high: ``errors`` < ``numerics``, ``runtime`` < ``core`` < ``models``,
  ``metrics``, ``data``, ``plots`` < ``training`` < ``calibration`` < ``tasks``,
  ``evaluation``, ``testing`` < ``serving`` < ``bench`` < ``cli``. A module imports only
  its own room and lower rooms; nothing outside ``cli`` imports ``cli``.
* No import cycle among the package's modules.
* No module uses another module's ``_private`` names.
* No module is over 700 lines, no function over 60 lines of code.
* Collectives (``lax.pmean``, ``psum``, ``all_gather`` ...) appear only in
  ``meshensemble/core/steps.py`` (and the bench's copy of the Flax HOWTO's pmap step).
* Every name in ``meshensemble.__all__`` resolves, and the public face imports.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import meshensemble as me

PACKAGE = pathlib.Path(me.__file__).parent
RANK = {
    "errors": -1,  # the error types: below every room, imports nothing of the package
    "startup": 0,  # the console script's Ctrl-C while it imports: the standard library only
    "numerics": 0,  # pure array math the core and the metrics share
    "runtime": 0,  # compilation cache, ahead-of-time programs, auto-tuning, processes
    "core": 1,  # the ensemble on the mesh
    "models": 2,
    "metrics": 2,
    "data": 2,
    "plots": 2,
    "training": 3,
    "calibration": 4,  # temperature, conformal sets, and `evaluate --calibrate` on a run
    "tasks": 5,  # the task implementations (classification, regression): the engine reaches
    #  them through the protocol and registry of core/tasks.py, never by import
    "evaluation": 5,
    "testing": 5,
    "serving": 6,  # predict / export: reads a run as evaluation does, below bench and cli
    "bench": 7,
    "cli": 8,
}
MAX_LINES = 700


def module_name(path: pathlib.Path) -> str:
    parts = ["meshensemble", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the top-level public face


def resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if MODULES[module].name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str) -> list[tuple[str, list[str], int]]:
    """``(imported module, names taken from it, line)`` for every import in ``module``."""
    tree = ast.parse(MODULES[module].read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = resolve(module, node)
            names = [a.name for a in node.names]
            subs = [n for n in names if f"{source}.{n}" in MODULES]
            if len(subs) < len(names):  # some names are not submodules: taken from `source`
                found.append((source, [n for n in names if n not in subs], node.lineno))
            # `from pkg import sub` imports the submodule pkg.sub
            found += [
                (f"{source}.{n}", [], node.lineno) for n in names if f"{source}.{n}" in MODULES
            ]
    return [f for f in found if f[0] == "meshensemble" or f[0].startswith("meshensemble.")]


def package_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        for target, _, _ in imports(module):
            while target not in MODULES and "." in target:  # a name inside a module
                target = target.rsplit(".", 1)[0]
            if target in MODULES and target != module:
                edges[module].add(target)
    return edges


def test_rooms_import_only_their_own_and_lower_rooms():
    bad = []
    for module in MODULES:
        here = room(module)
        if here is None:
            continue
        assert here in RANK, f"{module}: room {here!r} has no rank; add it to RANK and the docs"
        for target, _, line in imports(module):
            there = room(target)
            if there is None:
                bad.append(f"{module}:{line} imports the public face {target}")
            elif there != here and RANK[there] >= RANK[here]:
                bad.append(f"{module}:{line} ({here}) imports {target} ({there})")
    assert not bad, "\n".join(bad)


def test_the_error_types_sit_below_every_room():
    """errors.py is the lowest room: every room may raise its kinds, it imports none."""
    lowest = [r for r, rank in RANK.items() if rank == min(RANK.values())]
    assert lowest == ["errors"]
    assert imports("meshensemble.errors") == []


def test_nothing_outside_cli_imports_cli():
    bad = [
        f"{m}:{line} imports {t}"
        for m in MODULES
        if room(m) != "cli"
        for t, _, line in imports(m)
        if room(t) == "cli"
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    edges = package_edges()
    # The package __init__ files re-export their own modules (parent -> child) and a child
    # module's import of a sibling loads the parent first; only module-to-module edges that
    # are not parent -> own child count.
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in edges.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(
                    " -> ".join(stack[stack.index(nxt) :] + [node, nxt])
                    if nxt in stack
                    else f"{node} -> {nxt}"
                )
            elif nxt not in state:
                visit(nxt, stack + [node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not cycles, "\n".join(cycles)


def test_no_module_uses_another_modules_private_names():
    bad = []
    for module in MODULES:
        tree = ast.parse(MODULES[module].read_text())
        aliases: dict[str, str] = {}  # local name -> package module
        for target, names, line in imports(module):
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    bad.append(f"{module}:{line} imports {target}.{name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = resolve(module, node)
                for a in node.names:
                    if f"{source}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{source}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in MODULES and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and aliases[node.value.id] != module
            ):
                bad.append(f"{module}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_stay_small(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines; split it by concern"


MAX_FUNCTION_LINES = 60
"""The most lines of code in one function, its docstring not counted (issue #27)."""
COLLECTIVES = frozenset(
    {"pmean", "psum", "pmax", "pmin", "all_gather", "psum_scatter", "ppermute", "all_to_all"}
)
"""``jax.lax`` functions that move data between devices."""
COLLECTIVES_HOME = "meshensemble.core.steps"
"""The one module whose per-device functions call collectives."""
OTHER_COLLECTIVES = {
    "meshensemble.bench.cases": "the Flax HOWTO's pmap step, copied as the bench's baseline",
}
"""Modules allowed a collective of their own, with the reason."""


def code_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of ``fn`` from its first statement after the docstring to its end."""
    body = fn.body
    has_doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    first = body[1] if has_doc and len(body) > 1 else body[0]
    return fn.end_lineno - first.lineno + 1


def long_functions(source: str, limit: int) -> list[str]:
    """``name (lines)`` of every function or method in ``source`` with more than ``limit``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n = code_lines(node)
            if n > limit:
                found.append(f"{node.name} ({n} lines, line {node.lineno})")
    return found


def collective_calls(source: str) -> list[str]:
    """``lax.<collective>`` (however ``lax`` is reached) named anywhere in ``source``."""
    tree = ast.parse(source)
    found = [
        f"{node.attr} (line {node.lineno})"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES
    ]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("lax"):
            found += [f"{a.name} (imported)" for a in node.names if a.name in COLLECTIVES]
    return found


def test_no_function_is_long():
    bad = [
        f"{module}: {f}"
        for module, path in MODULES.items()
        for f in long_functions(path.read_text(), MAX_FUNCTION_LINES)
    ]
    assert not bad, "split these by step (setup, loop, outputs):\n" + "\n".join(bad)


def test_collectives_live_in_the_steps_only():
    bad = [
        f"{module}: {c}"
        for module, path in MODULES.items()
        if module != COLLECTIVES_HOME and module not in OTHER_COLLECTIVES
        for c in collective_calls(path.read_text())
    ]
    assert not bad, "move these into meshensemble/core/steps.py:\n" + "\n".join(bad)
    assert collective_calls(MODULES[COLLECTIVES_HOME].read_text())
    for module in OTHER_COLLECTIVES:
        assert collective_calls(MODULES[module].read_text()), f"{module} needs no exception"


def coroutines(source: str) -> list[str]:
    """The coroutine functions a module defines (``async def``)."""
    return [n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.AsyncFunctionDef)]


def test_the_package_defines_no_coroutine():
    """pyproject's filters drop every unawaited-coroutine report as a library's abandoned work
    (orbax's after a failed save or read): true only while the package has none of its own."""
    bad = [f"{m}: {c}" for m, p in MODULES.items() for c in coroutines(p.read_text())]
    assert not bad, "narrow pyproject's unawaited-coroutine filters first:\n" + "\n".join(bad)
    assert coroutines("async def f():\n    pass\n") == ["f"]


def test_the_checks_find_a_long_function_and_a_collective():
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    assert long_functions(f'def f():\n    """Doc."""\n{body}\n', 60) == ["f (61 lines, line 1)"]
    assert long_functions(f"def f():\n{body[: body.rindex(chr(10))]}\n", 60) == []
    source = "from jax import lax\nfrom jax.lax import psum\ny = lax.pmean(x, 'data')\n"
    assert collective_calls(source) == ["pmean (line 3)", "psum (imported)"]


def test_the_public_face_resolves_every_name():
    missing = [name for name in me.__all__ if not hasattr(me, name)]
    assert not missing, missing
    for namespace in ("core", "models", "metrics", "data", "training", "checkpoint", "testing"):
        assert hasattr(me, namespace), namespace


def test_declared_dependencies_are_imported_somewhere():
    """No declared dependency stays unused by the package (chex and einops included)."""
    import tomllib

    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    declared = [
        d.split(">")[0].split("=")[0].split("[")[0].strip()
        for d in pyproject["project"]["dependencies"]
    ]
    import_name = {"orbax-checkpoint": "orbax", "tensorflow-datasets": "tensorflow_datasets"}
    text = "\n".join(p.read_text() for p in MODULES.values())
    unused = [
        d
        for d in declared
        if f"import {import_name.get(d, d)}" not in text
        and f"from {import_name.get(d, d)}" not in text
    ]
    assert not unused, f"declared but never imported by the package: {unused}"


def test_every_third_party_import_is_declared():
    """Each top-level third-party module the package imports is a declared dependency.

    Module-level imports must be in ``dependencies`` (a fresh ``pip install -e .`` gets
    them); function-level imports may also come from an optional extra or a dependency's
    own dependencies (named in ``INDIRECT``).
    """
    import sys
    import tomllib

    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    dist = lambda d: d.split(">")[0].split("=")[0].split("[")[0].split("<")[0].strip().lower()
    import_name = {
        "orbax-checkpoint": "orbax",
        "tensorflow-datasets": "tensorflow_datasets",
        "scikit-learn": "sklearn",
    }
    required = {import_name.get(dist(d), dist(d)) for d in pyproject["project"]["dependencies"]}
    optional = {
        import_name.get(dist(d), dist(d)).replace("-cpu", "").replace("-", "_")
        for extra in pyproject["project"]["optional-dependencies"].values()
        for d in extra
    }
    INDIRECT = {"jaxlib", "absl", "etils", "array_record", "tensorboardx", "tensorboardX", "PIL"}
    stdlib = set(sys.stdlib_module_names) | {"meshensemble", "__future__"}
    missing = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        top = set(tree.body)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots = [node.module.split(".")[0]]
            else:
                continue
            for root in roots:
                if root in stdlib or root in required:
                    continue
                if node not in top and (root in optional or root in INDIRECT):
                    continue
                missing.append(f"{name}: {root}")
    assert not missing, f"imported but not declared in pyproject's dependencies: {missing}"
