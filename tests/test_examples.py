"""The worked examples under ``examples/``: each ``main(argv)`` runs a short real job.

The examples import their sibling modules as top-level ``config`` and ``train`` (as
Flax's examples do, run from their folder), so :func:`load_example` imports each folder
with it first on ``sys.path`` and then takes those names out of ``sys.modules`` again:
the three examples never see each other's modules. ``--fake-devices`` is not passed:
``conftest.py`` already made 8 CPU devices.

The runs use JAX's default random-number mode, as users' runs do.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import types
from pathlib import Path

import chex
import jax
import numpy as np
import pytest
from conftest import need_devices
from jax.sharding import PartitionSpec as P

import meshensemble as me
from meshensemble.training import tuning

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NAMES = ("howto_ensemble", "data_parallel_fashion_mnist", "mesh_2d")
_SIBLINGS = ("config", "train", "main")


def load_example(name: str) -> types.SimpleNamespace:
    """Imports ``examples/<name>/{config,train,main}.py`` without leaving them in sys.modules."""
    folder = os.fspath(EXAMPLES / name)
    saved = {m: sys.modules.pop(m) for m in _SIBLINGS if m in sys.modules}
    sys.path.insert(0, folder)
    try:
        main = importlib.import_module("main")
        return types.SimpleNamespace(
            main=main, train=sys.modules["train"], config=sys.modules["config"]
        )
    finally:
        sys.path.remove(folder)
        for m in _SIBLINGS:
            sys.modules.pop(m, None)
        sys.modules.update(saved)


def spy_results(monkeypatch, train_module) -> list:
    """Records what ``train_module.train_and_evaluate`` returns when ``main`` calls it."""
    results: list = []
    real = train_module.train_and_evaluate

    def spy(*args, **kwargs):
        results.append(real(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(train_module, "train_and_evaluate", spy)
    return results


def synthetic_npz(path: Path, num_train: int = 64, num_test: int = 40) -> str:
    """``me.data.synthetic`` saved in the layout of Keras's ``mnist.npz``."""
    return me.data.save_npz(me.data.synthetic(num_train=num_train, num_test=num_test), path)


def assert_member_sharded(tree, num_members: int, ensemble: int) -> None:
    """Every leaf is ``[num_members, ...]`` split over ``ensemble`` in blocks."""
    chex.assert_tree_shape_prefix(tree, (num_members,))
    for leaf in jax.tree.leaves(tree):
        assert leaf.sharding.spec[:1] == P("ensemble")[:1], leaf.sharding
        shard_rows = {s.data.shape[0] for s in leaf.addressable_shards}
        assert shard_rows == {num_members // ensemble}


# --- layout and flags (no training) ----------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_example_layout_and_flags(name: str) -> None:
    folder = EXAMPLES / name
    for file in ("main.py", "train.py", "config.py", "README.md"):
        assert (folder / file).is_file(), f"{name}/{file} is missing"
    readme = (folder / "README.md").read_text()
    assert f"examples/{name}/main.py --fake-devices 8" in readme
    ex = load_example(name)
    assert callable(ex.main.main) and callable(ex.train.train_and_evaluate)
    args = ex.main.parse_args(["--fake-devices", "8", "--source", "npz", "--data-file", "x.npz"])
    cfg = ex.main.get_config(args)
    assert args.fake_devices == 8 and cfg.source == "npz" and cfg.data_file == "x.npz"
    assert ex.main.get_config(ex.main.parse_args([])) == ex.config.get_config()
    assert (EXAMPLES / "README.md").read_text().count(f"({name}/)") == 1


def test_configs_follow_the_recipes() -> None:
    howto = load_example("howto_ensemble").config.get_config()
    assert (howto.num_members, howto.batch_size) == (8, 128)
    assert (howto.learning_rate, howto.momentum) == (0.1, 0.9)
    dp = load_example("data_parallel_fashion_mnist").config.get_config()
    assert dp.dataset == "fashion_mnist" and dp.data is None
    cfg = load_example("mesh_2d").config.get_config()
    assert isinstance(cfg, me.TrainConfig) and cfg.members == 8
    assert me.parse_mesh(cfg.mesh) == {"ensemble": 4, "data": 2}


def test_howto_mesh_size() -> None:
    size = load_example("howto_ensemble").train.ensemble_axis_size
    assert [size(8, n) for n in (8, 16, 6, 4, 3, 1)] == [8, 8, 4, 4, 2, 1]


def test_bad_input_exits_2(tmp_path, capsys) -> None:
    ex = load_example("data_parallel_fashion_mnist")
    path = synthetic_npz(tmp_path / "s.npz")
    argv = ["--source", "npz", "--data-file", path, "--batch-size", "30"]
    assert ex.main.main(argv) == 2  # 30 does not split over data=8
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "multiple of the data axis (8)" in err
    assert load_example("mesh_2d").main.main(["--source", "npz"]) == 2
    assert "needs a data file" in capsys.readouterr().err


# --- short real runs -------------------------------------------------------------------


@pytest.mark.slow
def test_howto_ensemble(tmp_path, monkeypatch, capsys) -> None:
    need_devices(8)
    ex = load_example("howto_ensemble")
    results = spy_results(monkeypatch, ex.train)
    path = synthetic_npz(tmp_path / "s.npz", num_train=64, num_test=40)
    argv = ["--source", "npz", "--data-file", path, "--batch-size", "32"]
    assert ex.main.main([*argv, "--num-epochs", "2", "--max-steps", "3"]) == 0
    (result,) = results
    ens, state = result.ensemble, result.state
    assert dict(ens.mesh.shape) == {"ensemble": 8, "data": 1}  # one member per device
    assert ens.members_per_device == 1
    assert_member_sharded(state.params, 8, 8)
    chex.assert_tree_all_finite(state.params)
    kernel = np.asarray(state.params["Dense_1"]["kernel"])
    assert not np.allclose(kernel[0], kernel[1])  # members start from different keys
    assert [r["steps"] for r in result.history] == [2, 1]  # 64 // 32 = 2, then max 3
    for r in result.history:
        assert len(r["train_member_loss"]) == 8
        assert np.all(np.isfinite(r["train_member_loss"])) and np.isfinite(r["test_loss"])
        assert 0.0 <= r["train_accuracy"] <= 1.0 and 0.0 <= r["test_accuracy"] <= 1.0
    probs = np.asarray(ens.predict(state, np.zeros((5, 28, 28, 1), np.uint8)))
    assert probs.shape == (5, 10)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    out = capsys.readouterr().out
    assert "data: MNIST from" in out and "mesh: ensemble=8 x data=1 on 8 cpu" in out
    assert "epoch:   1, train_loss: " in out and "epoch:   2, " in out and "epoch:   3" not in out


@pytest.mark.slow
def test_data_parallel_fashion_mnist_on_mock_tfds(tmp_path, monkeypatch, capsys, mock_tfds) -> None:
    need_devices(8)
    ex = load_example("data_parallel_fashion_mnist")
    results = spy_results(monkeypatch, ex.train)
    argv = ["--source", "tfds", "--data-dir", os.fspath(tmp_path), "--batch-size", "32"]
    with mock_tfds(num_examples=64):
        assert ex.main.main([*argv, "--num-epochs", "1"]) == 0
    (result,) = results
    model, state = result.model, result.state
    assert dict(model.mesh.shape) == {"ensemble": 1, "data": 8}
    assert model.num_members == 1
    # One CNN, whole on every device: the ensemble axis has size 1.
    assert_member_sharded(state.params, 1, 1)
    for leaf in jax.tree.leaves(state.params):
        assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == 8
    chex.assert_tree_all_finite(state.params)
    # The batch is split over `data`: 8 devices of 32 / 8 = 4 rows.
    placed = model.place(np.zeros((32, 28, 28, 1), np.uint8))
    assert sorted(s.data.shape[0] for s in placed.addressable_shards) == [4] * 8
    (record,) = result.history
    assert record["steps"] == 2  # 64 mock examples // 32
    assert np.isfinite(record["train_loss"]) and np.isfinite(record["test_loss"])
    assert 0.0 <= record["test_accuracy"] <= 1.0
    out = capsys.readouterr().out
    assert "data: Fashion-MNIST from TFDS" in out
    assert "mesh: ensemble=1 x data=8 on 8 cpu device(s): 1 CNN, batch 32 split into 8 x 4" in out
    assert "epoch:   1, train_loss: " in out


@pytest.mark.slow
def test_mesh_2d(tmp_path, monkeypatch, capsys) -> None:
    need_devices(8)
    ex = load_example("mesh_2d")
    results = spy_results(monkeypatch, ex.train)
    path = synthetic_npz(tmp_path / "s.npz", num_train=64, num_test=40)
    workdir = tmp_path / "run"
    argv = ["--source", "npz", "--data-file", path, "--batch-size", "32", "--max-steps", "2"]
    assert ex.main.main([*argv, "--workdir", os.fspath(workdir)]) == 0
    (result,) = results
    assert isinstance(result, me.TrainResult)
    ens = result.ensemble
    assert dict(ens.mesh.shape) == {"ensemble": 4, "data": 2}
    assert ens.num_members == 8 and ens.members_per_device == 2
    assert_member_sharded(result.state.params, 8, 4)
    (record,) = result.history  # 2 steps = one epoch of 64 // 32
    assert record["step"] == 2 and len(record["train_loss"]) == 8
    assert np.all(np.isfinite(record["train_loss"]))
    assert len(record["test_member_accuracy"]) == 8
    assert 0.0 <= record["test_ensemble_accuracy"] <= 1.0
    resolved = json.loads((workdir / "config.json").read_text())["resolved"]
    assert resolved["mesh"] == {"ensemble": 4, "data": 2} and resolved["devices"] == 8
    # conv="auto": the first run of this configuration times the candidates and records why
    assert resolved["conv"] in tuning.conv_candidates("cpu")  # the tuner's candidates
    assert resolved["member_strategy"] in ("loop", "vmap")
    assert f"conv: {resolved['conv']}" in resolved["tuning"]["reason"] or resolved["tuning"]
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["step"] == 2
    for name in ("learning_curves.png", "members.png"):
        assert (workdir / name).stat().st_size > 0
    assert not (workdir / "checkpoints").exists()  # the example's config turns them off
    out = capsys.readouterr().out
    assert "mesh ensemble=4 x data=2 on 8 cpu devices: 2 member(s)/device, batch 32 = 2 x 16" in out
    assert "ensemble 3    cpu:6     cpu:7     members 6-7" in out
    assert ", mesh ensemble=4 x data=2 x model=1 on 8 cpu" in out  # the library's own line
    assert "  member 7 " in out and "  ensemble " in out  # the final table


# --- a task written outside the package ---------------------------------------------
CUSTOM = EXAMPLES / "custom_task"


@pytest.fixture(scope="module")
def poisson():
    """``examples/custom_task``'s ``poisson`` and ``main`` modules (importable by name: a
    run records its task as ``poisson:Poisson``)."""
    sys.path.insert(0, os.fspath(CUSTOM))
    try:
        yield types.SimpleNamespace(
            task=importlib.import_module("poisson"), main=importlib.import_module("main")
        )
    finally:
        sys.path.remove(os.fspath(CUSTOM))
        sys.modules.pop("main", None)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_the_custom_task_runs_every_step_with_nothing_changed_inside(poisson, tmp_path, capsys):
    """A task of the user's: the Ensemble API, the loop in chunks, a stop and an exact
    resume, evaluate, predict and export (under ~200 lines, examples/custom_task)."""
    need_devices(8)
    lines = sum(len(p.read_text().splitlines()) for p in CUSTOM.glob("*.py"))
    assert lines < 200
    workdir = os.fspath(tmp_path / "counts")
    made = poisson.main.main(["--workdir", workdir, "--epochs", "2"])
    run, resumed = made["run"], made["resumed"]
    assert run.history[-1]["step"] == 16 and np.isfinite(run.history[-1]["test_nll"])
    chex.assert_trees_all_equal(jax.device_get(run.state.params),
                                jax.device_get(resumed.state.params))  # fmt: skip
    saved = json.loads((tmp_path / "counts" / "config.json").read_text())
    assert saved["task"] == "poisson:Poisson" and saved["resolved"]["chunk_steps"] == 4
    assert made["result"]["test_nll"] == pytest.approx(run.history[-1]["test_nll"], rel=1e-6)
    data = poisson.main.counts()
    want = np.asarray(me.distributed.fetch(run.ensemble.predict(run.state, data.x_test[:5])))
    np.testing.assert_allclose(made["predicted"], want, rtol=1e-5)
    assert made["meta"]["task"] == "poisson" and made["meta"]["members"] == 4
    exp = jax.export.deserialize(
        bytearray((tmp_path / "counts_export" / "ensemble.jax").read_bytes())
    )
    got = np.asarray(exp.call(data.x_test[:5])["prediction"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert "resumed from step 6 to 16" in capsys.readouterr().out


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_the_custom_task_is_mesh_invariant_and_its_members_train_alone(poisson, backend):
    """The parity suites for the example task: the same members on every mesh shape and
    backend, and each member equal to one model trained alone with the task's loss."""
    need_devices(8)
    import optax

    data = poisson.main.counts(64, 16)
    x, y = data.x_train[:32], data.y_train[:32]

    def steps(mesh):
        ens = me.Ensemble(me.models.MLP((16,), num_classes=1), optax.adam(0.01), 8, mesh,
                          backend=backend, task=poisson.task.Poisson())  # fmt: skip
        state = ens.init(jax.random.key(0), x[:1])
        for _ in range(3):
            state, metrics = ens.train_step(state, x, y)
        return {"params": state.params, "loss": metrics["loss"], "nll": metrics["ensemble_nll"]}

    shapes = (
        [(8, 1), (4, 2), (2, 4), (1, 8), (1, 1)] if backend == "shard_map" else [(8, 1), (1, 8)]
    )
    me.testing.assert_mesh_invariant(steps, shapes)
    net, task = me.models.MLP((16,), num_classes=1), poisson.task.Poisson()
    ens = me.Ensemble(net, optax.adam(0.01), 8, me.make_mesh(4, 2), task=task)
    me.testing.assert_members_match_single_model_training(ens, jax.random.key(0), x, y)


@pytest.mark.slow
def test_the_custom_task_on_two_processes_equals_one(poisson, tmp_path, monkeypatch):
    """2 processes x 4 devices train the example task as 1 x 8 (--task poisson:Poisson)."""
    from meshensemble.runtime.distributed import launch_local

    need_devices(8)
    data = poisson.main.counts(128, 32)
    npz = tmp_path / "counts.npz"
    np.savez(npz, x_train=data.x_train, y_train=data.y_train, x_test=data.x_test,
             y_test=data.y_test)  # fmt: skip
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([os.fspath(CUSTOM), os.environ.get("PYTHONPATH", "")])
    )
    argv = ["train", "--task", "poisson:Poisson", "--source", "npz", "--data-file", str(npz),
            "--members", "8", "--mesh", "ensemble=4,data=2", "--optimizer", "adam",
            "--learning-rate", "0.01", "--batch-size", "32", "--max-steps", "3", "--quiet",
            "--no-compile-cache"]  # fmt: skip
    assert launch_local([*argv, "--workdir", str(tmp_path / "multi")], 2, 4, timeout=400,
                        prefix_output=False) == 0  # fmt: skip
    from meshensemble.cli import main

    assert main([*argv, "--workdir", str(tmp_path / "one")]) == 0
    for name in ("multi", "one"):
        assert (
            json.loads((tmp_path / name / "config.json").read_text())["task"] == "poisson:Poisson"
        )
    one = (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()[-1]
    multi = (tmp_path / "multi" / "metrics.jsonl").read_text().splitlines()[-1]
    for key, value in json.loads(multi).items():  # train_curve: a dict of lists
        for a, b in zip(jax.tree.leaves(value), jax.tree.leaves(json.loads(one)[key]), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=key)


# --- the regression measurements' scripts ----------------------------------------
def _regression_script(name: str) -> types.ModuleType:
    """``examples/regression/<name>.py`` imported as a module (it imports its sibling)."""
    import importlib.util

    path = EXAMPLES / "regression" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"regression_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_regression_measurements_over_seeds_run(tmp_path, capsys) -> None:
    """The scripts behind docs/regression.md's numbers over seeds, on two short runs each."""
    pytest.importorskip("sklearn")
    need_devices(8)
    splits = _regression_script("splits")
    argv = ["--seeds", "0", "1", "--workdir", str(tmp_path / "splits")]
    models = splits.main([*argv, "--", "--epochs", "2", "--members", "2"])
    assert len(models["ensemble, calibrated"]) == len(models["GP"]) == 2  # calibrated runs
    out = capsys.readouterr().out
    assert "| BayesianRidge |" in out and "calibrated 90% coverage per split: " in out
    toy = _regression_script("toy_spread")
    out = toy.main(["--seeds", "0", "--workdir", str(tmp_path / "toy"), "--", "--epochs", "2"])
    assert len(out) == 1 and all(np.isfinite(out[0]))
    assert ">= 3x in" in capsys.readouterr().out
