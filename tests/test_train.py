"""The training loop and the `meshensemble train` CLI."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import need_devices

import meshensemble as me
from meshensemble import cli
from meshensemble.cli import train as cli_train
from meshensemble.tasks.classification import final_table
from meshensemble.training import Feeder, TrainConfig, build_ensemble, train
from meshensemble.training.guards import NonFiniteGuard

DATA = me.data.synthetic(num_train=192, num_test=40, seed=0)


def tiny(tmp_path, name="run", **kw) -> TrainConfig:
    base = dict(
        model="mlp",
        members=4,
        mesh="ensemble=4,data=2",
        epochs=1,
        batch_size=32,
        learning_rate=0.05,
        workdir=str(tmp_path / name),
        quiet=True,
        checkpoint=False,
        eval_batch_size=16,
    )
    return TrainConfig(**(base | kw))


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def params_of(result) -> dict:
    return jax.device_get(result.state.params)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_same_seed_same_members_whatever_the_mesh_and_chunking(tmp_path):
    need_devices(8)
    runs = {
        "4x2": train(tiny(tmp_path, "a", max_steps=4), dataset=DATA),
        "2x1 k2": train(
            tiny(tmp_path, "b", mesh="ensemble=2,data=1", chunk_steps=2, max_steps=4), dataset=DATA
        ),
        "1x8 pmap": train(
            tiny(tmp_path, "c", mesh="ensemble=1,data=8", backend="pmap", max_steps=4), dataset=DATA
        ),
    }
    ref = params_of(runs["4x2"])
    for name, result in runs.items():
        chex.assert_trees_all_close(params_of(result), ref, atol=1e-5, custom_message=name)
        assert result.history[-1]["step"] == 4
    np.testing.assert_allclose(
        runs["2x1 k2"].history[-1]["train_loss"],
        runs["4x2"].history[-1]["train_loss"],
        atol=1e-5,
    )


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("shuffle", ["shared", "per-member"])
def test_streaming_path_matches_on_device_path(tmp_path, shuffle):
    need_devices(8)
    device = train(tiny(tmp_path, "d", shuffle=shuffle, epochs=2, max_steps=10), dataset=DATA)
    host = train(
        tiny(tmp_path, "h", shuffle=shuffle, epochs=2, max_steps=10, streaming=True),
        dataset=DATA,
    )
    chex.assert_trees_all_close(params_of(device), params_of(host), atol=1e-4)
    assert device.history[-1]["step"] == 10


@pytest.mark.slow  # among the heaviest default tests, measured
def test_per_member_orders_are_distinct_permutations_drawn_on_device(tmp_path):
    need_devices(8)
    result = train(tiny(tmp_path, "p", max_steps=2, shuffle="per-member"), dataset=DATA)
    cfg = tiny(tmp_path, "p", shuffle="per-member")
    feeder = Feeder(result.ensemble, DATA, cfg, jax.random.key(1), 1, 6)
    order = feeder.order(1)
    assert order.shape == (4, 192)
    assert order.sharding.is_equivalent_to(me.member_sharding(result.ensemble.mesh), 2)
    rows = np.asarray(order)
    for row in rows:
        np.testing.assert_array_equal(np.sort(row), np.arange(192))
    assert len({tuple(r[:32]) for r in rows}) == 4  # each member its own first batch
    assert not np.array_equal(np.asarray(feeder.order(2)), rows)  # a new order each epoch
    shared = Feeder(result.ensemble, DATA, tiny(tmp_path, "q"), jax.random.key(1), 1, 6)
    assert shared.order(1).shape == (192,)


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.plots  # the rendered PNGs
def test_outputs_metrics_jsonl_config_and_plots(tmp_path):
    need_devices(8)
    cfg = tiny(tmp_path, "o", epochs=2, checkpoint=True, tensorboard=True)
    result = train(cfg, dataset=DATA)
    workdir = cfg.workdir
    lines = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    assert [r["epoch"] for r in lines] == [1, 2]
    assert [r["step"] for r in lines] == [6, 12]  # 192 // 32 steps per epoch
    for r in lines:
        assert len(r["train_loss"]) == 4 and len(r["test_member_accuracy"]) == 4
        assert len(r["test_member_nll"]) == 4
        for key in (
            "test_ensemble_accuracy",
            "test_ensemble_nll",
            "test_ensemble_brier",
            "test_ensemble_ece",
            "test_mean_member_nll",
            "test_mean_member_ece",
        ):
            assert np.isfinite(r[key]), key
        assert not any("time" in k or "second" in k for k in r)
    assert lines == result.history
    config = json.loads(Path(workdir, "config.json").read_text())
    assert config["members"] == 4 and config["resolved"]["mesh"] == {"ensemble": 4, "data": 2}
    assert config["conv"] == "auto" and config["resolved"]["conv"] is None  # an MLP: no conv
    assert config["precision"] == "fp32"
    for png in ("learning_curves.png", "members.png"):
        assert os.path.getsize(os.path.join(workdir, png)) > 1000
    assert os.listdir(os.path.join(workdir, "tensorboard"))
    # the saved checkpoint restores onto another mesh and predicts the same
    ens = me.Ensemble(
        me.models.MLP(),
        result.ensemble.optimizer,
        4,
        me.make_mesh(ensemble=2, data=1),
        input_transform=me.data.normalize,
    )
    state, loop, step = me.restore_checkpoint(workdir, ens, DATA.test_images[:1])
    assert step == 12 and loop["epoch"] == 2
    np.testing.assert_allclose(
        np.asarray(ens.predict(state, DATA.test_images)),
        np.asarray(result.ensemble.predict(result.state, DATA.test_images)),
        atol=1e-5,
    )


@pytest.mark.slow  # among the heaviest default tests, measured
def test_learns_the_synthetic_task(tmp_path):
    need_devices(8)
    data = me.data.synthetic(num_train=512, num_test=100, seed=1)
    result = train(
        tiny(tmp_path, "l", epochs=3, optimizer="adam", learning_rate=3e-3), dataset=data
    )
    assert result.history[-1]["test_ensemble_accuracy"] > 0.6


@pytest.mark.slow
def test_cli_trains_on_the_full_mnist_npz(tmp_path, mnist_npz, capsys):
    """The real CNN on real MNIST through the npz source, on a 2-D mesh."""
    need_devices(8)
    workdir = str(tmp_path / "npz")
    argv = ["train", "--source", "npz", "--data-file", mnist_npz, "--members", "2"]
    argv += ["--max-steps", "3", "--workdir", workdir, "--mesh", "ensemble=2,data=4"]
    code = cli.main(argv)
    out = capsys.readouterr().out
    assert code == 0
    assert "full MNIST" in out and mnist_npz in out
    assert "2 x cnn, mesh ensemble=2 x data=4" in out
    record = read_jsonl(os.path.join(workdir, "metrics.jsonl"))[0]
    assert record["step"] == 3 and len(record["test_member_accuracy"]) == 2
    assert record["test_ensemble_accuracy"] > 0.2  # 3 SGD steps of the real CNN on MNIST


@pytest.mark.slow  # among the heaviest default tests, measured
def test_cli_trains_through_tfds_mock_data(tmp_path, capsys, mock_tfds):
    need_devices(8)
    with mock_tfds(num_examples=64):
        code = cli.main(
            [
                "train",
                "--source",
                "tfds",
                "--dataset",
                "fashion_mnist",
                "--model",
                "mlp",
                "--members",
                "2",
                "--batch-size",
                "16",
                "--epochs",
                "1",
                "--workdir",
                str(tmp_path / "tfds"),
                "--no-checkpoint",
            ]
        )
    out = capsys.readouterr().out
    assert code == 0, out
    record = read_jsonl(tmp_path / "tfds" / "metrics.jsonl")[0]
    assert record["step"] == 4 and len(record["train_loss"]) == 2


def test_config_file_and_flags_override(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default workdir: a run there (the main job's) is resumed
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"members": 2, "epochs": 3, "model": "mlp"}))
    args = cli.build_parser().parse_args(["train", "--config", str(path), "--epochs", "1"])
    cfg = cli_train.config_from_args(args)
    assert (cfg.members, cfg.epochs, cfg.model) == (2, 1, "mlp")
    path.write_text(json.dumps({"member": 2}))
    with pytest.raises(cli.UsageError, match="unknown key"):
        cli_train.config_from_args(cli.build_parser().parse_args(["train", "--config", str(path)]))


# --------------------------------------------------------------------- resuming a run
@pytest.fixture
def npz(tmp_path) -> str:
    return me.data.save_npz(DATA, tmp_path / "data.npz")


def cli_argv(npz, workdir, *extra) -> list[str]:
    argv = ["train", "--source", "npz", "--data-file", npz, "--model", "mlp", "--members", "4"]
    argv += ["--mesh", "ensemble=4,data=2", "--batch-size", "32", "--learning-rate", "0.05"]
    return [*argv, "--eval-batch-size", "16", "--workdir", str(workdir), *extra]


def files(workdir) -> dict:
    return {p: p.read_bytes() for p in Path(workdir).rglob("*") if p.is_file()}


FIX = "or pass --overwrite (or overwrite=True), or use another workdir"


@pytest.mark.slow  # among the heaviest default tests, measured
def test_train_refuses_to_resume_another_run_and_changes_nothing(tmp_path):
    need_devices(8)
    cfg = tiny(tmp_path, "held", checkpoint=True, max_steps=2)
    train(cfg, dataset=DATA)
    before = files(cfg.workdir)
    w = cfg.workdir
    other = dataclasses.replace(DATA, train_labels=(DATA.train_labels + 1) % 10)
    cases = [
        (dict(seed=1), None, "holds a run with seed=0, this run has seed=1; resume with seed=0"),
        (dict(learning_rate=0.1), None, "learning_rate=0.05, this run has learning_rate=0.1;"),
        (dict(shuffle="per-member"), None, "shuffle='shared', this run has shuffle='per-member'"),
        (dict(schedule="cosine"), None, "schedule='constant', this run has schedule='cosine'"),
        (dict(model="cnn"), None, "model='mlp', this run has model='cnn'"),
        (dict(), other, "holds a run with train split fingerprint="),
        (dict(), me.data.synthetic(num_train=64, num_test=40), "num_train=192, this run has "),
    ]
    for change, data, message in cases:
        with pytest.raises(ValueError) as err:
            train(dataclasses.replace(cfg, **change), dataset=data or DATA)
        text = str(err.value)
        assert text.startswith(f"workdir {w} holds a run with ") and text.endswith(FIX), text
        assert message in text and "\n" not in text
        assert files(w) == before, change  # config.json and the rest untouched
    # what does not define the run may change: a constant rate is extended by more epochs
    more = train(dataclasses.replace(cfg, epochs=2, max_steps=None, mesh="ensemble=2,data=4"), DATA)
    assert more.history[-1]["step"] == 12
    saved = json.loads(Path(w, "config.json").read_text())
    assert saved["epochs"] == 2 and saved["max_steps"] is None
    assert saved["resolved"]["data_identity"]["num_train"] == 192
    # a decaying schedule spans the epochs: changing them is another run
    cos = tiny(tmp_path, "cos", checkpoint=True, max_steps=2, schedule="cosine")
    train(cos, dataset=DATA)
    with pytest.raises(ValueError, match="holds a run with epochs=1, this run has epochs=2"):
        train(dataclasses.replace(cos, epochs=2), dataset=DATA)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_max_steps_is_per_command_and_a_split_epoch_keeps_its_whole_train_loss(
    tmp_path, npz, capsys
):
    need_devices(8)
    whole = train(
        tiny(tmp_path, "whole", epochs=2, source="npz", data_file=npz, checkpoint=True)
    ).history
    workdir = tmp_path / "split"
    assert cli.main(cli_argv(npz, workdir, "--epochs", "2", "--max-steps", "3")) == 0
    assert cli.main(["train", "--workdir", str(workdir)]) == 0  # no --max-steps: to the end
    assert "resumed from checkpoint 3" in capsys.readouterr().out
    split = read_jsonl(workdir / "metrics.jsonl")
    assert [r["step"] for r in split] == [3, 6, 12]  # one record per step, none twice
    for a, b in zip(whole, split[1:]):  # epoch 1 is steps 1-6 also when split at 3
        np.testing.assert_allclose(b["train_loss"], a["train_loss"], rtol=1e-5)
        np.testing.assert_allclose(b["test_ensemble_nll"], a["test_ensemble_nll"], rtol=1e-5)
    assert json.loads((workdir / "config.json").read_text())["max_steps"] is None
    # a larger --max-steps continues; a rerun at the end trains nothing and adds nothing
    assert cli.main(["train", "--workdir", str(workdir), "--epochs", "3", "--max-steps", "14"]) == 0
    assert cli.main(["train", "--workdir", str(workdir), "--epochs", "3", "--max-steps", "14"]) == 0
    assert [r["step"] for r in read_jsonl(workdir / "metrics.jsonl")] == [3, 6, 12, 14]


def test_resuming_with_another_data_file_is_one_line(tmp_path, npz, capsys):
    need_devices(8)
    workdir = tmp_path / "d"
    assert cli.main(cli_argv(npz, workdir, "--max-steps", "2")) == 0
    before = files(workdir)
    copy = tmp_path / "copy.npz"
    copy.write_bytes(Path(npz).read_bytes())
    fewer = me.data.save_npz(me.data.synthetic(num_train=64, num_test=40), tmp_path / "few.npz")
    shuffled = dataclasses.replace(DATA, train_labels=DATA.train_labels[::-1].copy())
    other = me.data.save_npz(shuffled, tmp_path / "other.npz")
    capsys.readouterr()
    for path, message in (
        (fewer, "holds a run with num_train=192, this run has num_train=64"),
        (other, "holds a run with train split fingerprint="),
        (str(copy), f"holds a run with data_file='{npz}', this run has data_file='{copy}'"),
    ):
        code = cli.main(["train", "--workdir", str(workdir), "--data-file", path])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error: workdir ") and err.count("\n") == 1, err
        assert message in err and "resume with the run's data (" in err and FIX in err, err
        assert files(workdir) == before


# --------------------------------------------------------------------- non-finite losses
class PoisonMLP(nn.Module):
    """An MLP whose logits are NaN for an image with a white top-left pixel."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        poison = x[:, 0, 0, 0] > 0.99
        h = nn.relu(nn.Dense(32)(x.reshape((x.shape[0], -1))))
        return nn.Dense(10)(h) + jnp.where(poison, jnp.nan, 0.0)[:, None]


def test_reinit_guard_reinitialises_once_per_event_and_compiles_once():
    need_devices(8)
    ens = me.Ensemble(me.models.MLP(), optax.sgd(0.1), 4, me.make_mesh(4, 1))
    key, sample = jax.random.key(0), DATA.train_images[:1]
    state = ens.init(jax.random.key(5), sample)
    messages: list[str] = []
    guard = NonFiniteGuard(ens, "reinit", key, sample)
    nan = float("nan")

    def losses(*row):
        return {"loss": jnp.asarray([row], jnp.float32)}

    compiles: list[str] = []
    listener = lambda event, *a, **k: compiles.append(event) if "/compile" in event else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        state = guard.check(state, losses(nan, 1, 1, 1), 0, messages.append)  # member 0 diverges
        state = guard.check(state, losses(nan, 1, 1, 1), 1, messages.append)  # ran on the bad one
        assert messages == ["non-finite loss in member(s) [0] at step 1: re-initialising them"]
        state = guard.check(state, losses(1, 1, 1, 1), 2, messages.append)  # the fresh member
        state = guard.check(state, losses(1, 1, nan, 1), 3, messages.append)
        compiles.clear()
        state = guard.check(state, losses(1, nan, nan, 1), 4, messages.append)
        state = guard.flush(state, messages.append)  # member 2 stale, member 1 new
        assert compiles == []  # the re-init program is built once
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert messages[1:] == [
        "non-finite loss in member(s) [2] at step 4: re-initialising them",
        "non-finite loss in member(s) [1] at step 5: re-initialising them",
    ]
    fresh = {
        at: jax.device_get(ens.init(jax.random.fold_in(key, at), sample).params) for at in (1, 4, 5)
    }
    got = jax.device_get(state.params)
    for member, at in ((0, 1), (2, 4), (1, 5)):
        row = lambda tree, m=member: jax.tree.map(lambda v: v[m], tree)
        chex.assert_trees_all_equal(row(got), row(fresh[at]))


@pytest.mark.slow  # among the heaviest default tests, measured
def test_training_reinitialises_a_diverged_member_once_and_goes_on(tmp_path, monkeypatch):
    need_devices(8)
    monkeypatch.setitem(me.models.REGISTRY, "poison", PoisonMLP)
    images = DATA.train_images.copy()
    images[:, 0, 0, 0] = 0
    images[7, 0, 0, 0] = 255  # example 7 makes a member's loss NaN
    data = dataclasses.replace(DATA, train_images=images)
    cfg = tiny(tmp_path, "nan", model="poison", shuffle="per-member", on_nonfinite="reinit")
    cfg = dataclasses.replace(cfg, epochs=2, mesh="ensemble=4,data=1")
    # where each member meets example 7: its order, drawn as the loop draws it
    order_key = jax.random.split(jax.random.key(cfg.seed))[1]
    ens = build_ensemble(cfg, me.make_mesh(4, 1), 192)
    feeder = Feeder(ens, data, cfg, order_key, 1, 6)
    meets = {}
    for epoch in (1, 2):
        order = np.asarray(feeder.order(epoch))
        for m in range(4):
            meets[epoch, m] = (epoch - 1) * 6 + int(np.argmax(order[m] == 7)) // 32 + 1
    last_clean = min(meets[2, m] for m in range(4)) - 1  # the run stops before epoch 2's
    assert last_clean > 6, "pick another seed: a member meets example 7 first in epoch 2"
    events: dict[int, list[int]] = {}
    for (epoch, m), step in sorted(meets.items()):
        if epoch == 1:
            events.setdefault(step, []).append(m)
    messages: list[str] = []
    result = train(dataclasses.replace(cfg, max_steps=last_clean), data, echo=messages.append)
    got = [m for m in messages if m.startswith("non-finite")]
    assert got == [
        f"non-finite loss in member(s) {sorted(ms)} at step {s}: re-initialising them"
        for s, ms in sorted(events.items())
    ]
    chex.assert_tree_all_finite(result.state.params)
    epoch1, epoch2 = result.history
    assert epoch2["step"] == last_clean and np.all(np.isfinite(epoch2["train_loss"]))
    assert np.isfinite(epoch2["test_ensemble_nll"])


# --------------------------------------------------------------------- what is printed
@pytest.mark.slow  # among the heaviest default tests, measured
def test_quiet_prints_exactly_the_final_table(tmp_path, npz, capsys):
    need_devices(8)
    workdir = tmp_path / "q"
    assert cli.main(cli_argv(npz, workdir, "--max-steps", "2", "--quiet")) == 0
    out = capsys.readouterr().out
    record = read_jsonl(workdir / "metrics.jsonl")[-1]
    assert out == final_table(record) + "\n"
    assert "  member 3 " in out and "  ensemble " in out


@contextlib.contextmanager
def read_only(path: Path):
    """``path`` (a folder) read-only: by its mode, or as root by a read-only bind mount."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)
        return
    mount = shutil.which("mount")
    ok = mount and subprocess.run([mount, "--bind", str(path), str(path)]).returncode == 0
    if not ok:
        pytest.skip("cannot make a read-only folder here (root without mount)")
    try:
        remount = [mount, "-o", "remount,ro,bind", str(path)]
        if subprocess.run(remount).returncode != 0:
            pytest.skip("cannot remount read-only here")
        yield
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_unwritable_workdir_is_refused_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    argv = ["train", "--source", "npz", "--data-file", "/nonexistent.npz"]
    workdir = blocker / "run"
    assert cli.main([*argv, "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: workdir {workdir} is not writable (Not a directory: {blocker}); "
        "pass a writable --workdir\n"
    )
    ro = tmp_path / "ro"
    with read_only(ro):
        assert cli.main([*argv, "--workdir", str(ro)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: workdir {ro} is not writable (") and err.count("\n") == 1
        assert "pass a writable --workdir" in err and "Traceback" not in err
        assert list(ro.iterdir()) == []


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.plots  # the rendered PNGs
def test_a_failed_plot_is_one_line_and_a_rerun_writes_it(tmp_path, npz, capsys):
    need_devices(8)
    workdir = tmp_path / "p"
    (workdir / "learning_curves.png").mkdir(parents=True)  # a folder where the plot goes
    assert cli.main(cli_argv(npz, workdir, "--max-steps", "2")) == 1
    err = capsys.readouterr().err
    path = workdir / "learning_curves.png"
    assert (
        err.startswith(f"error: could not write {path}: Is a directory; ") and "\n" not in err[:-1]
    )
    assert "checkpoint and metrics.jsonl are saved" in err and "Traceback" not in err
    (workdir / "learning_curves.png").rmdir()
    assert cli.main(["train", "--workdir", str(workdir)]) == 0
    assert "resumed from checkpoint 2" in capsys.readouterr().out
    assert path.stat().st_size > 1000


# --------------------------------------------------------------------- failed runs
class BoomMLP(me.models.MLP):
    """The zoo's MLP (the same parameters) whose apply raises when it trains (the first
    step), not when it initialises."""

    def __call__(self, x, train: bool = False):
        if train:
            raise RuntimeError("boom inside apply")
        return super().__call__(x, train)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_fresh_run_that_fails_before_its_first_checkpoint_leaves_nothing_behind(
    tmp_path, npz, capsys, monkeypatch
):
    need_devices(8)
    monkeypatch.setitem(me.models.REGISTRY, "boom", BoomMLP)
    made = tmp_path / "new" / "run"  # the run makes this folder: it goes too
    assert cli.main(cli_argv(npz, made, "--max-steps", "2", "--model", "boom")) == 1
    assert "boom inside apply" in capsys.readouterr().err
    assert not made.exists() and (tmp_path / "new").exists()
    mine = tmp_path / "mine"  # a folder of the user's: only the run's files go
    mine.mkdir()
    (mine / "notes.txt").write_text("kept")
    assert cli.main(cli_argv(npz, mine, "--max-steps", "2", "--model", "boom")) == 1
    assert sorted(os.listdir(mine)) == ["notes.txt"]
    # the same command, fixed, starts afresh: no --overwrite needed
    assert cli.main(cli_argv(npz, mine, "--max-steps", "2")) == 0
    before = files(mine)
    # a resume that fails keeps the earlier run's files (the same run: its model now raises)
    monkeypatch.setitem(me.models.REGISTRY, "mlp", BoomMLP)
    capsys.readouterr()
    assert cli.main(["train", "--workdir", str(mine), "--max-steps", "4"]) == 1
    assert "boom inside apply" in capsys.readouterr().err
    after = files(mine)
    assert set(before) <= set(after)
    for path, data in before.items():
        if "checkpoints" in path.parts:
            assert after[path] == data, path


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_run_resumes_from_another_working_directory(tmp_path, monkeypatch, capsys):
    """config.json holds the data file's absolute path: a relative --data-file given in
    one folder still names the data when the run is resumed from another."""
    need_devices(8)
    monkeypatch.chdir(tmp_path)
    me.data.save_npz(me.data.synthetic(64, 16, seed=0), tmp_path / "d.npz")
    common = ["--no-autotune", "--no-compile-cache", "--quiet", "--workdir", str(tmp_path / "r")]
    argv = ["train", "--model", "mlp", "--members", "2", "--source", "npz", "--data-file",
            "d.npz", "--batch-size", "32", "--epochs", "1", *common]  # fmt: skip
    assert cli.main(argv) == 0
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    assert saved["data_file"] == str(tmp_path / "d.npz")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert cli.main(["train", "--epochs", "2", *common]) == 0
    assert json.loads((tmp_path / "r" / "config.json").read_text())["epochs"] == 2
    # Fewer epochs than the checkpoint holds: refused, config.json left saying 2.
    assert cli.main(["train", "--epochs", "1", *common]) == 2
    assert "past the end of an --epochs 1 run (step 2); give --epochs 2" in capsys.readouterr().err
    assert json.loads((tmp_path / "r" / "config.json").read_text())["epochs"] == 2


class _ClosedPipe:
    """A stdout whose reader went away (``train ... | head -1`` after its first line)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_closed_stdout_does_not_stop_the_run(tmp_path, monkeypatch):
    need_devices(8)
    npz = me.data.save_npz(me.data.synthetic(64, 16, seed=0), tmp_path / "d.npz")
    monkeypatch.setattr("sys.stdout", _ClosedPipe())
    argv = ["train", "--model", "mlp", "--members", "2", "--source", "npz", "--data-file", npz,
            "--batch-size", "32", "--epochs", "1", "--no-autotune", "--no-compile-cache",
            "--workdir", str(tmp_path / "r")]  # fmt: skip
    assert cli.main(argv) == 0
    assert me.training.checkpoint.list_checkpoints(str(tmp_path / "r")) == [2]
