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
    assert "on mesh ensemble=4 x data=2" in out  # the library's own line: the mesh it used
    assert "  member 7 " in out and "  ensemble " in out  # the final table


def _regression_script(name: str) -> types.ModuleType:
    """``examples/regression/<name>.py`` imported as a module (it imports its sibling)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / "regression" / f"{name}.py"
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
    argv = ["--seeds", "0", "1", "--no-compare", "--workdir", str(tmp_path / "splits")]
    models = splits.main([*argv, "--", "--epochs", "2", "--members", "2"])
    assert len(models["cli ensemble"]) == len(models["BayesianRidge"]) == 2
    assert "BayesianRidge: nll" in capsys.readouterr().out
    toy = _regression_script("toy_spread")
    out = toy.main(["--seeds", "0", "--workdir", str(tmp_path / "toy"), "--", "--epochs", "2"])
    assert len(out) == 1 and all(np.isfinite(out[0]))
    assert ">= 3x in" in capsys.readouterr().out
