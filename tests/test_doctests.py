"""The docstrings' examples run (issue #27, docs that stay true).

Every ``>>>`` example in the docstrings of the modules in ``COVERED`` runs here under
:mod:`doctest` (``ELLIPSIS | NORMALIZE_WHITESPACE``, warnings as errors as in every test),
one test per module, so a failure names the module and prints the example's diff. An
example that cannot run in a test (a GPU, a multi-host launch, a long run, the network, a
file only a user has) marks its line ``# doctest: +SKIP``; nothing skips a whole module:
every module of the package is either in ``COVERED`` or in ``NOT_COVERED`` with the reason
(``test_every_module_is_listed``), and every ``>>>`` line of a covered module is collected
(``test_every_example_is_collected``: none hides where doctest's finder does not look).

The namespace the examples share (decided once; a module's own globals come on top, the
way ``python -m doctest`` sees the module, except the names below, which win):

- ``me`` (meshensemble), ``jax``, ``jnp``, ``np``, ``optax``, ``nn`` (``flax.linen``),
  ``functools``, ``P`` (``jax.sharding.PartitionSpec``);
- ``images``: uint8 ``[32, 28, 28, 1]`` and ``labels``: int32 ``[32]`` in ``0..9``, the
  test split of ``me.data.synthetic(64, 32, seed=0)`` (MNIST's shapes, one bright bar per
  class: learnable in a few steps); a held-out split of them: ``val_*`` are the first
  16 rows, ``test_*`` the last 16 (``test_images``, ``val_labels``, ``test_labels``);
- ``mesh``: ``me.make_mesh(ensemble=2, data=1)`` (2 of the 8 fake CPU devices);
- ``ens``: ``me.Ensemble(me.models.MLP((8,)), optax.sgd(0.1), 2, mesh,
  input_transform=me.data.normalize)``, and its ``state``: ``ens.init(jax.random.key(0),
  images[:1])`` trained 20 steps on the 64 training images (batches of 32), so the
  predictions beat chance and a temperature fits; a fresh copy for every docstring (a
  step donates its state);
- ``key``: ``jax.random.key(0)``;
- ``member_probs``: ``ens.predict_members(state, images)``, ``[2, 32, 10]``;
  ``member_logits``: the same as logits; ``probs``: their member mean ``[32, 10]``;
  ``val_member_probs``/``test_member_probs`` (numpy) ``[2, 16, 10]``, ``val_probs``/``test_probs``
  ``[16, 10]`` and ``val_logits``/``test_logits`` (the ensemble's log-probabilities,
  ``me.calibration.ensemble_logits``) ``[16, 10]`` of the two splits;
- ``predictor``: ``me.Predictor(ens, state, step=20, workdir="run", calibration=None,
  num_classes=10)``, an uncalibrated predictor of that ensemble (no run folder behind it);
- the working directory is a fresh temporary folder per docstring (``tmp``: its path),
  so an example that writes a file writes it there (and the host's cache of verified files,
  ``MESHENSEMBLE_VERIFY_CACHE``, is a file in it);
- in that folder, a copy of each of these that the docstring names (:func:`npz_folder`,
  :func:`run_folder`: built through the public API once per worker, the first time a
  docstring names one):
  ``mnist.npz``, a Keras-layout npz of ``me.data.synthetic(96, 32, seed=0)`` with every
  4th training label wrong (so a held-out split has errors to calibrate on);
  ``runs/tiny``, a classification run on it (4 ``mlp`` members on the default
  ``ensemble=4 x data=2`` mesh, batch 32, ``validation=32``, 2 epochs: checkpoints 2 and
  4) and ``runs/toy``, a regression run on the 1-D toy (4 members, batch 8,
  ``validation=10``, 2 epochs: last checkpoint 2), both then evaluated with
  ``calibrate=True`` (``evaluation.json``, the temperature, the interval calibration);
- in the docstrings of ``meshensemble.bench.*`` also (:func:`bench_fixtures`, once per
  worker): ``cfg``, ``resolve(tiny=True, cases="matmul,howto")``; ``ctx``, its
  ``Context``; ``cases``, its plan on this process's devices; ``runners`` and ``owner``,
  one prepared and timed runner per distinct spec and its first case (as ``run_bench``
  makes them); ``runner``, the first of them; ``results``, ``collect``'s results of them.

An example line that truly cannot run in a test (a GPU, a multi-host launch, real
processes, the network, minutes of work, a file only a user has) is marked
``# doctest: +SKIP``; a run folder or data that can be built cheaply is built here instead.
The fixtures are built once per worker and the examples use tiny MLP ensembles, not the
CNNs of a real run.
"""

from __future__ import annotations

import atexit
import doctest
import functools
import importlib
import io
import os
import pathlib
import re
import shutil
import sys
import tempfile
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import meshensemble as me

PACKAGE = pathlib.Path(me.__file__).resolve().parent
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


ALL_MODULES = sorted(module_name(p) for p in PACKAGE.rglob("*.py"))

COVERED = [
    "meshensemble",
    "meshensemble.numerics",
    "meshensemble.numerics.gaussian",
    "meshensemble.numerics.statmath",
    "meshensemble.numerics.sums",
    "meshensemble.numerics.temperature",
    "meshensemble.calibration",
    "meshensemble.calibration._checks",
    "meshensemble.calibration._rows",
    "meshensemble.calibration.conformal",
    "meshensemble.calibration.intervals",
    "meshensemble.calibration.run",
    "meshensemble.calibration.temperature",
    "meshensemble.cli",
    "meshensemble.cli.bench",
    "meshensemble.cli.common",
    "meshensemble.cli.convert",
    "meshensemble.cli.evaluate",
    "meshensemble.cli.export",
    "meshensemble.cli.export",
    "meshensemble.cli.predict",
    "meshensemble.cli.train",
    "meshensemble.metrics",
    "meshensemble.metrics.classification",
    "meshensemble.metrics.ood",
    "meshensemble.metrics.regression",
    "meshensemble.metrics.reliability",
    "meshensemble.metrics.streaming",
    "meshensemble.metrics.uncertainty",
    "meshensemble.core",
    "meshensemble.core.adapters",
    "meshensemble.core.backends",
    "meshensemble.core.derive",
    "meshensemble.core.ensemble",
    "meshensemble.core.evaluating",
    "meshensemble.core.forward",
    "meshensemble.core.inputs",
    "meshensemble.core.members",
    "meshensemble.core.ordering",
    "meshensemble.core.state",
    "meshensemble.core.steps",
    "meshensemble.core.tasks",
    "meshensemble.core.keys",
    "meshensemble.core.layout",
    "meshensemble.core.mesh",
    "meshensemble.core.sharding",
    "meshensemble.core.streaming",
    "meshensemble.data",
    "meshensemble.data.augment",
    "meshensemble.data.auto",
    "meshensemble.data.codec",
    "meshensemble.data.dataset",
    "meshensemble.data.folder",
    "meshensemble.data.lazy",
    "meshensemble.data.manifest",
    "meshensemble.data.npz",
    "meshensemble.data.ood",
    "meshensemble.data.preprocess",
    "meshensemble.data.regression",
    "meshensemble.data.sample",
    "meshensemble.data.split",
    "meshensemble.data.stream",
    "meshensemble.data.synthetic",
    "meshensemble.data.tabular",
    "meshensemble.data.tfds",
    "meshensemble.data.tfds_stream",
    "meshensemble.errors",
    "meshensemble.startup",
    "meshensemble.evaluation",
    "meshensemble.evaluation.run",
    "meshensemble.models",
    "meshensemble.models.batchensemble",
    "meshensemble.models.conv",
    "meshensemble.models.lora",
    "meshensemble.models.vit",
    "meshensemble.models.zoo",
    "meshensemble.models.user",
    "meshensemble.bench",
    "meshensemble.bench.accuracy",
    "meshensemble.bench.cases",
    "meshensemble.bench.config",
    "meshensemble.bench.flops",
    "meshensemble.bench.layouts",
    "meshensemble.bench.report",
    "meshensemble.bench.stream_case",
    "meshensemble.bench.suite",
    "meshensemble.bench.timing",
    "meshensemble.bench.workloads",
    "meshensemble.plots",
    "meshensemble.tasks",
    "meshensemble.tasks.classification",
    "meshensemble.tasks.ood",
    "meshensemble.tasks.regression",
    "meshensemble.serving",
    "meshensemble.serving.blocks",
    "meshensemble.serving.export",
    "meshensemble.serving.inputs",
    "meshensemble.serving.outputs",
    "meshensemble.serving.predictor",
    "meshensemble.runtime",
    "meshensemble.runtime.autotune",
    "meshensemble.runtime.compilation",
    "meshensemble.runtime.distributed",
    "meshensemble.runtime.plugins",
    "meshensemble.runtime.precompile",
    "meshensemble.runtime.storage",
    "meshensemble.training.backbone",
    "meshensemble.training.bundle",
    "meshensemble.training.calibrate",
    "meshensemble.training",
    "meshensemble.training.checkpoint",
    "meshensemble.training.checksums",
    "meshensemble.training.config",
    "meshensemble.training.fields",
    "meshensemble.training.feeder",
    "meshensemble.training.guards",
    "meshensemble.training.identity",
    "meshensemble.training.inference",
    "meshensemble.training.loop",
    "meshensemble.training.monitor",
    "meshensemble.training.order",
    "meshensemble.training.outputs",
    "meshensemble.training.pacing",
    "meshensemble.training.recipe",
    "meshensemble.training.restore",
    "meshensemble.training.rundata",
    "meshensemble.training.setup",
    "meshensemble.training.plan",
    "meshensemble.testing",
    "meshensemble.training.tuning",
]
"""The modules whose examples run here (a module with no example is listed too: one
written later runs from then on)."""

ENTRY = "a program entry point: importing it runs the command line"
NOT_COVERED: dict[str, str] = {
    "meshensemble.bench.__main__": ENTRY,
    "meshensemble.cli.__main__": ENTRY,
}
"""The modules whose examples do not run here, each with the reason; a new module must be
added to this or to ``COVERED`` (``test_every_module_is_listed``)."""


@functools.lru_cache(maxsize=1)
def fixtures() -> dict:
    """The shared namespace, built once per worker (see the module docstring)."""
    ds = me.data.synthetic(num_train=64, num_test=32, seed=0)
    images, labels = ds.test_images, ds.test_labels
    mesh = me.make_mesh(ensemble=2, data=1)
    ens = me.Ensemble(
        me.models.MLP((8,)), optax.sgd(0.1), 2, mesh, input_transform=me.data.normalize
    )
    key = jax.random.key(0)
    state = ens.init(key, images[:1])
    for step in range(20):
        rows = slice(32 * (step % 2), 32 * (step % 2 + 1))
        state, _ = ens.train_step(state, ds.train_images[rows], ds.train_labels[rows])
    member_probs = ens.predict_members(state, images)
    val, test = slice(0, 16), slice(16, 32)
    namespace = {
        "me": me,
        "jax": jax,
        "jnp": jnp,
        "np": np,
        "optax": optax,
        "nn": nn,
        "functools": functools,
        "P": P,
        "images": images,
        "labels": labels,
        "mesh": mesh,
        "ens": ens,
        "state": state,
        "key": key,
        "member_probs": member_probs,
        "member_logits": ens.predict_members(state, images, logits=True),
        "probs": member_probs.mean(0),
        "predictor": me.Predictor(
            ens, state, step=20, workdir="run", calibration=None, num_classes=10
        ),
    }
    host_probs = np.asarray(member_probs)  # a split of the rows, read on the host
    for split, rows in (("val", val), ("test", test)):
        namespace[f"{split}_images"] = images[rows]
        namespace[f"{split}_labels"] = labels[rows]
        namespace[f"{split}_member_probs"] = host_probs[:, rows]
        namespace[f"{split}_probs"] = host_probs[:, rows].mean(0)
        namespace[f"{split}_logits"] = me.calibration.ensemble_logits(host_probs[:, rows])
    return namespace


RUN_FILES = ("mnist.npz", "runs/tiny", "runs/toy")
"""What :func:`run_folder` holds; a docstring that names one gets its own copy."""


@functools.lru_cache(maxsize=1)
def npz_folder() -> pathlib.Path:
    """A folder with ``mnist.npz`` (see the module docstring), written once per worker."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="meshensemble-doctest-runs-"))
    atexit.register(shutil.rmtree, root, True)
    ds = me.data.synthetic(96, 32, seed=0)
    noisy = np.where(np.arange(96) % 4 == 0, (ds.train_labels + 1) % 10, ds.train_labels)
    npz = str(root / "mnist.npz")  # Keras's layout; every 4th training label is wrong
    np.savez(
        npz, x_train=ds.train_images[..., 0], y_train=noisy.astype(np.uint8),
        x_test=ds.test_images[..., 0], y_test=ds.test_labels.astype(np.uint8),
    )  # fmt: skip
    return root


@functools.lru_cache(maxsize=1)
def run_folder() -> pathlib.Path:
    """:func:`npz_folder` with ``runs/tiny`` and ``runs/toy`` too, built once per worker.

    Built only when a docstring names one of the runs (see the module docstring), through
    the public API as a user would: a tiny classification run on ``mnist.npz`` and a tiny
    regression run on the 1-D toy, both trained, then evaluated with ``calibrate=True``.
    """
    root = npz_folder()
    quiet = lambda line: None  # noqa: E731
    npz = str(root / "mnist.npz")
    common = dict(members=4, epochs=2, quiet=True)
    me.training.train(
        me.TrainConfig(
            model="mlp", batch_size=32, source="npz", data_file=npz, validation=32,
            workdir=str(root / "runs/tiny"), **common,
        ),
        echo=quiet,
    )  # fmt: skip
    me.training.train(
        me.TrainConfig(
            task="regression", source="toy1d", batch_size=8, validation=10,
            workdir=str(root / "runs/toy"), **common,
        ),
        echo=quiet,
    )  # fmt: skip
    for name in ("tiny", "toy"):
        me.evaluation.evaluate_run(str(root / "runs" / name), calibrate=True, echo=quiet)
    return root


@functools.lru_cache(maxsize=1)
def bench_fixtures() -> dict:
    """The bench modules' names, built once per worker (see the module docstring)."""
    from meshensemble import bench
    from meshensemble.bench import report, timing, workloads

    quiet = lambda line: None  # noqa: E731
    cfg = bench.resolve(tiny=True, cases="matmul,howto")
    ctx = workloads.Context(cfg, workloads.load_data(cfg, quiet))
    cases = bench.plan(cfg, len(jax.devices()), jax.devices()[0].platform, ctx.steps_per_epoch)
    runners, owner = {}, {}
    for case in cases:  # one runner per distinct computation, as run_bench does
        if case.spec not in runners:
            runners[case.spec] = bench.RUNNERS[case.spec.kind](ctx, case.spec)
            owner[case.spec] = case.name
    for spec, runner in runners.items():
        runner.prepare()
        if spec.kind != "matmul":
            ctx.flops_per_example(bench.plain_model(spec.model))
            ctx.cost_analysis_per_example(bench.plain_model(spec.model))
    timing.round_robin(runners.values(), cfg.repeats, cfg.warmup)
    results = report.collect(cfg, ctx, cases, runners, owner)
    return {
        "cfg": cfg,
        "ctx": ctx,
        "cases": cases,
        "runners": runners,
        "owner": owner,
        "runner": next(iter(runners.values())),
        "results": results,
    }


def copy_run_files(docstring: str, folder: pathlib.Path) -> None:
    """Copies into ``folder`` each of :data:`RUN_FILES` that ``docstring`` names."""
    named = [name for name in RUN_FILES if name in docstring]
    if not named:
        return
    root = npz_folder() if named == ["mnist.npz"] else run_folder()
    for name in named:
        if (root / name).is_dir():
            shutil.copytree(root / name, folder / name)
        else:
            shutil.copy(root / name, folder / name)


def fresh_state(state):
    """A copy of ``state`` on the same shardings (the examples may donate theirs)."""
    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, state)


def run_examples(name: str, folder: pathlib.Path) -> tuple[int, int, str]:
    """Runs module ``name``'s examples; returns (failed, attempted, the runner's report).

    Each docstring runs in its own new folder under ``folder`` (its working directory).
    """
    module = importlib.import_module(name)
    shared = fixtures()
    globs = {**vars(module), **shared}
    if name.startswith("meshensemble.bench"):
        globs.update(bench_fixtures())
    tests = doctest.DocTestFinder(exclude_empty=True).find(module, name, globs=globs)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    out = io.StringIO()
    for test in sorted(tests, key=lambda t: t.name):
        test.globs["state"] = fresh_state(shared["state"])
        test.globs["tmp"] = str(folder / test.name)
        os.makedirs(test.globs["tmp"])
        os.chdir(test.globs["tmp"])
        copy_run_files(test.docstring or "", pathlib.Path(test.globs["tmp"]))
        runner.run(test, out=out.write, clear_globs=True)
    return runner.failures, runner.tries, out.getvalue()


def example_lines(name: str) -> int:
    """``>>>`` lines in the source of module ``name`` (a comment alone is no example)."""
    path = PACKAGE.parent / (name.replace(".", "/"))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    return len(re.findall(r"^\s*>>> (?!\s*#)", path.read_text(), re.MULTILINE))


def test_every_module_is_listed():
    listed = set(COVERED) | set(NOT_COVERED)
    assert not set(COVERED) & set(NOT_COVERED), set(COVERED) & set(NOT_COVERED)
    assert listed == set(ALL_MODULES), {
        "not listed": sorted(set(ALL_MODULES) - listed),
        "no such module": sorted(listed - set(ALL_MODULES)),
    }


@pytest.mark.parametrize("name", COVERED)
def test_every_example_is_collected(name):
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder(exclude_empty=True).find(module, name, globs={})
    collected = sum(len(t.examples) for t in tests)
    assert collected == example_lines(name), (
        f"{name}: {example_lines(name)} '>>>' lines in the source, {collected} examples "
        "collected; one sits where doctest's finder does not look (e.g. an object defined "
        "in another module, a comment or a non-docstring string)"
    )


def test_a_broken_example_fails(tmp_path, monkeypatch):
    """The harness itself: a wrong output and an undefined name are failures it reports."""
    module = types.ModuleType("meshensemble_doctest_probe")
    module.__doc__ = """Probe.

    Example:
      >>> labels.shape     # a namespace name: runs
      (32,)
      >>> 1 + 1
      3
      >>> undefined_name
    """
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.chdir(tmp_path)
    failed, attempted, report = run_examples(module.__name__, tmp_path)
    assert (failed, attempted) == (2, 3), report
    assert "Expected:\n    3" in report and "NameError" in report, report


def test_a_docstring_gets_its_own_copy_of_what_it_names(tmp_path, monkeypatch):
    """A docstring naming ``mnist.npz`` finds it in its folder; what it does there stays."""
    module = types.ModuleType("meshensemble_doctest_files")
    module.__doc__ = """Names nothing: an empty folder.

    >>> os.listdir(".")
    []
    """
    exec("import os\ndef first(): pass\ndef second(): pass", module.__dict__)
    module.first.__doc__ = """Reads and removes its copy of mnist.npz.

    >>> sorted(np.load("mnist.npz"))
    ['x_test', 'x_train', 'y_test', 'y_train']
    >>> os.remove("mnist.npz")
    """
    module.second.__doc__ = """Has its own mnist.npz, whatever the first one did.

    >>> os.path.getsize("mnist.npz") > 0
    True
    """
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.chdir(tmp_path)
    failed, attempted, report = run_examples(module.__name__, tmp_path)
    assert (failed, attempted) == (0, 4), report


SLOW_EXAMPLES = (
    "meshensemble.bench.layouts",
    "meshensemble.cli.common",
    "meshensemble.cli.evaluate",
    "meshensemble.core.ensemble",
    "meshensemble.testing",
    "meshensemble.training.checkpoint",
    "meshensemble.training.loop",
)
"""The modules whose examples train or restore several runs (20-50 s each on 2 busy cores):
run with the ``slow`` tests, so the default command stays under 5 minutes."""


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_EXAMPLES else n for n in COVERED]
)
def test_examples_run(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MESHENSEMBLE_VERIFY_CACHE", str(tmp_path / "verified-files.json"))
    failed, attempted, report = run_examples(name, tmp_path)
    assert failed == 0, f"{name}: {failed} of {attempted} examples failed\n{report}"
