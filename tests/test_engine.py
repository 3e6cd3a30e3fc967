"""One engine for every task (issue 38): what regression runs lacked, and the stale calibration.

Regression runs once had a loop of their own: one host step per call, no bagging, no
streamed input, the compilation cache silently off, no compile log, tuner or progress,
seven flags accepted and ignored, the non-finite guard looking only at evaluation epochs,
an unchecked save on SIGTERM, no check of the data on resume, ``dataset=`` dropped, every
process clearing the folder on ``--overwrite``, the stop signal gathered every step. They
now run the one loop; each test here fails when one of those comes back. The last tests
are the stale calibration (a calibration is applied only to the run it was fitted for) and
the task registry.
"""

from __future__ import annotations

import dataclasses
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import need_devices

import meshensemble as me
from meshensemble import cli
from meshensemble.training import checkpoint as ckpt_lib
from meshensemble.training import guards, loop
from meshensemble.training.feeder import Feeder

ROWS = 40  # training rows of the table below; 10 test rows


def table(path, seed: int = 0, marker_row: int | None = None) -> str:
    """An npz of a float table: 2 features, 1 target [N] (offset 100); ``marker_row`` gets
    feature 1 = 1000 (every other row 0), which :class:`Poison` turns into a NaN output."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS + 10, 2)).astype(np.float32)
    x[:, 1] = 0.0
    if marker_row is not None:
        x[marker_row, 1] = 1000.0
    y = (100 + 3 * x[:, 0] + rng.normal(size=ROWS + 10)).astype(np.float32)
    np.savez(path, x_train=x[:ROWS], y_train=y[:ROWS], x_test=x[ROWS:], y_test=y[ROWS:])
    return os.fspath(path)


def config(tmp_path, data_file, **kw) -> me.TrainConfig:
    base = dict(task="regression", source="npz", data_file=data_file, members=4, model="mlp",
                mesh="ensemble=2,data=1", batch_size=8, epochs=2, optimizer="adam",
                learning_rate=0.01, workdir=str(tmp_path / "w"), quiet=True)  # fmt: skip
    return me.TrainConfig(**(base | kw))


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_regression_run_steps_in_chunks_paced_checkpoints_and_logs(tmp_path, capsys):
    """K-step chunks (a chunk program, calls of 2 steps), --checkpoint-every, the compile
    log, the tuner's choice and the progress lines; the stop signal asked once per call."""
    need_devices(2)
    calls, asked = [], []
    real_calls, real_requested = loop._Run.calls, guards.StopSignal.requested
    mp = pytest.MonkeyPatch()
    with mp.context() as m:
        m.setattr(
            loop._Run, "calls", lambda self, pos: calls.append(real_calls(self, pos)) or calls[-1]
        )
        m.setattr(
            guards.StopSignal,
            "requested",
            lambda self, step: asked.append(step) or real_requested(self, step),
        )
        cfg = config(tmp_path, table(tmp_path / "t.npz"), chunk_steps=5, checkpoint_every=3,
                     batch_size=4, keep=20, stop_within=0, quiet=False)  # fmt: skip
        result = me.training.train(cfg)
    out = capsys.readouterr().out
    steps = 2 * (ROWS // 4)  # 20: 2 epochs of 10
    assert result.history[-1]["step"] == steps
    assert max(calls) > 1 and sum(calls) == steps  # K-step calls, cut at checkpoint steps
    assert len(asked) == len(calls) < steps  # the stop signal: once per call, not per step
    assert ckpt_lib.list_checkpoints(cfg.workdir) == [3, 6, 9, 10, 12, 15, 18, 20]
    compiled = json.loads((tmp_path / "w" / "compile.json").read_text())
    assert "jit(train_chunk)" in [p["name"] for p in compiled["by_program"]]
    resolved = json.loads((tmp_path / "w" / "config.json").read_text())["resolved"]
    assert resolved["chunk_steps"] == 5 and resolved["member_strategy"] in ("vmap", "loop")
    assert "tuning" in resolved and "member strategy:" in out  # the tuner's choice, said
    assert "  epoch 1: step " in out and "compiled " in out  # progress and the compile log


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_second_identical_regression_run_loads_its_programs_from_the_cache(tmp_path):
    need_devices(2)
    data = table(tmp_path / "t.npz")
    cache = str(tmp_path / "cache")
    summaries = []
    for name in ("a", "b"):
        jax.clear_caches()  # as a new process: nothing compiled in memory
        cfg = config(tmp_path, data, workdir=str(tmp_path / name), compile_cache_dir=cache,
                     max_steps=2)  # fmt: skip
        summaries.append(me.training.train(cfg).compile)
    first, second = summaries
    assert first["cache_misses"] > 0 and first["cache_hits"] == 0
    assert second["cache_hits"] >= first["cache_misses"] - 1 and second["cache_hits"] > 0
    assert os.listdir(cache)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_bagging_and_a_streamed_input_train_a_regression_ensemble(tmp_path):
    """--bootstrap gives each member its own resample (other members than per-member
    shuffling alone); --input stream trains the same members as the on-device input."""
    need_devices(2)
    data = table(tmp_path / "t.npz")
    run = lambda name, **kw: me.training.train(
        config(tmp_path, data, workdir=str(tmp_path / name), max_steps=3, **kw)
    )
    bagged = run("bag", bootstrap=True, shuffle="per-member")
    shuffled = run("shuffle", shuffle="per-member")
    leaves = lambda r: jax.tree.leaves(jax.device_get(r.state.params))
    assert any(not np.allclose(a, b) for a, b in zip(leaves(bagged), leaves(shuffled)))
    saved = json.loads((tmp_path / "bag" / "config.json").read_text())
    assert saved["bootstrap"] is True
    device, streamed = run("device", input="device"), run("stream", input="stream")
    for a, b in zip(leaves(device), leaves(streamed)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert streamed.history[-1]["step"] == 3


class Poison(nn.Module):
    """A Gaussian head whose outputs are NaN for a row with a large feature 1."""

    num_classes: int = 2

    @nn.compact
    def __call__(self, x, train: bool = False):
        poison = x[:, 1] > 2.0  # the marker row, standardised
        out = nn.Dense(self.num_classes)(nn.tanh(nn.Dense(16)(x)))
        return out + jnp.where(poison, jnp.nan, 0.0)[:, None]


def _first_meeting(cfg, data_file, row: int) -> int:
    """The step at which the members (shared order) first meet training ``row``, or 0."""
    train = me.data.load_regression_npz(data_file)
    ens = me.training.build_ensemble(cfg, me.make_mesh(2, 1), ROWS, train.x_train[:1])
    order_key = jax.random.split(jax.random.key(cfg.seed))[1]
    feeder = Feeder(ens, train, cfg, order_key, 1, ROWS // cfg.batch_size)
    for epoch in (1, 2):
        position = int(np.argmax(np.asarray(feeder.order(epoch)) == row))
        if position < (ROWS // cfg.batch_size) * cfg.batch_size:
            return (epoch - 1) * (ROWS // cfg.batch_size) + position // cfg.batch_size + 1
    return 0


@pytest.mark.slow  # among the heaviest default tests, measured
def test_the_guard_catches_a_nan_at_any_step_and_a_stop_never_saves_it(tmp_path, monkeypatch):
    """A NaN output at a step that is no evaluation (nor epoch end) is named at that step;
    a stop requested right after it saves no checkpoint with NaN (the guard runs first)."""
    need_devices(2)
    monkeypatch.setitem(me.models.REGISTRY, "poison", Poison)
    cfg = config(tmp_path, table(tmp_path / "t.npz"), model="poison", epochs=2, eval_every=5)
    meets = {r: _first_meeting(cfg, cfg.data_file, r) for r in range(ROWS)}
    row = next(r for r, s in meets.items() if s > 1 and s % (ROWS // 8))  # mid-epoch
    step = meets[row]
    table(tmp_path / "t.npz", marker_row=row)
    with pytest.raises(me.training.NonFiniteError, match=rf"at step {step};"):
        me.training.train(cfg)
    stopping = dataclasses.replace(cfg, workdir=str(tmp_path / "stop"))
    monkeypatch.setattr(guards.StopSignal, "requested", lambda self, s: s >= step)
    with pytest.raises(me.training.NonFiniteError, match=rf"at step {step};"):
        me.training.train(stopping)
    assert ckpt_lib.list_checkpoints(stopping.workdir) == []  # nothing NaN was saved


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_regression_resume_with_other_data_under_the_same_file_is_refused(tmp_path, capsys):
    need_devices(2)
    data = table(tmp_path / "t.npz")
    argv = ["train", "--task", "regression", "--source", "npz", "--data-file", data,
            "--members", "2", "--mesh", "ensemble=2,data=1", "--batch-size", "8", "--epochs",
            "2", "--max-steps", "3", "--quiet", "--workdir", str(tmp_path / "w")]  # fmt: skip
    assert cli.main(argv) == 0
    table(tmp_path / "t.npz", seed=1)  # the same file, other contents
    before = sorted(os.listdir(tmp_path / "w"))
    resume = [a for a in argv if a not in ("--max-steps", "3")]
    assert cli.main(resume) == 2
    err = capsys.readouterr().err.strip()
    assert "split fingerprint" in err and "--overwrite" in err and len(err.splitlines()) == 1
    assert sorted(os.listdir(tmp_path / "w")) == before


@pytest.mark.slow  # among the heaviest default tests, measured
def test_train_honours_a_dataset_given_from_python_for_regression(tmp_path):
    need_devices(2)
    given = me.data.load_regression_npz(table(tmp_path / "t.npz"))
    cfg = me.TrainConfig(task="regression", members=2, mesh="ensemble=2,data=1", epochs=1,
                         batch_size=None, workdir=str(tmp_path / "w"), quiet=True)  # fmt: skip
    result = me.training.train(cfg, dataset=given)  # source auto would load the 1-D toy
    assert result.dataset.num_train == ROWS and result.dataset.x_train.shape[1] == 2
    resolved = json.loads((tmp_path / "w" / "config.json").read_text())["resolved"]
    assert resolved["data_identity"]["origin"] == "object" and resolved["input"]["shape"] == [2]


class _Processes:
    """``jax`` as :mod:`meshensemble.training.loop` sees it, as process ``index`` of 2."""

    def __init__(self, index: int) -> None:
        self.index = index

    def process_count(self) -> int:
        return 2

    def process_index(self) -> int:
        return self.index

    def __getattr__(self, name):
        return getattr(jax, name)


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("index", [0, 1])
def test_overwrite_clears_the_folder_on_process_0_only_after_every_process_checked(
    tmp_path, monkeypatch, index
):
    need_devices(2)
    data = table(tmp_path / "t.npz")
    cfg = config(tmp_path, data, max_steps=1)
    me.training.train(cfg)
    events = []
    from jax.experimental import multihost_utils

    monkeypatch.setattr(multihost_utils, "sync_global_devices", lambda n: events.append("sync"))
    real_clear = loop.clear_run
    monkeypatch.setattr(loop, "clear_run", lambda w: events.append("clear") or real_clear(w))
    monkeypatch.setattr(loop, "jax", _Processes(index))
    me.training.train(dataclasses.replace(cfg, overwrite=True, checkpoint=False))
    assert events == (["sync", "clear"] if index == 0 else ["sync"])


def _classification(tmp_path, name, seed, data_seed, **kw) -> me.TrainConfig:
    ds = me.data.synthetic(256, 64, seed=data_seed)
    wrong = np.where(np.arange(256) % 4 == 0, (ds.y_train + 1) % 10, ds.y_train)  # some errors
    ds = dataclasses.replace(ds, train_labels=wrong.astype(np.int32))  # to calibrate on
    npz = me.data.save_npz(ds, tmp_path / f"{name}.npz")
    base = dict(model="mlp", members=2, mesh="ensemble=2,data=1", epochs=1, batch_size=32,
                validation=64, seed=seed, source="npz", data_file=npz, quiet=True,
                workdir=str(tmp_path / "run"))  # fmt: skip
    return me.TrainConfig(**(base | kw))


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_calibration_is_never_applied_to_another_run(tmp_path, capsys):
    """The issue's case: train, evaluate --calibrate, train --overwrite on other data with
    another seed, predict: never the old temperature. --overwrite removes every output of
    the old run (evaluation.json, figures, a prediction written inside the folder); an old
    evaluation.json put back (as an older version left it) is not applied either."""
    need_devices(2)
    first = _classification(tmp_path, "a", seed=0, data_seed=0)
    me.training.train(first)
    workdir = first.workdir
    assert cli.main(["evaluate", "--workdir", workdir, "--calibrate", "--alpha", "0.2"]) == 0
    with open(os.path.join(workdir, "evaluation.json")) as f:
        old = json.load(f)
    np.save(tmp_path / "x.npy", me.data.synthetic(8, 8, seed=5).test_images)
    predict = ["predict", "--workdir", workdir, "--input", str(tmp_path / "x.npy"), "--out"]
    assert cli.main([*predict, os.path.join(workdir, "p.npz")]) == 0
    assert "temperature" in capsys.readouterr().out  # calibrated: this run's own
    second = _classification(tmp_path, "b", seed=1, data_seed=1, overwrite=True)
    me.training.train(second)
    left = set(os.listdir(workdir))
    assert not left & {"evaluation.json", "calibration.png", "reliability_diagram.png",
                       "ood_histogram.png", "p.npz"}  # fmt: skip
    assert cli.main([*predict, str(tmp_path / "q.npz")]) == 0
    assert "uncalibrated" in capsys.readouterr().out
    with open(os.path.join(workdir, "evaluation.json"), "w") as f:
        json.dump(old, f)  # what an older version's --overwrite left behind
    assert cli.main([*predict, str(tmp_path / "r.npz")]) == 0
    out, err = capsys.readouterr()
    assert "uncalibrated" in out and "fitted for another run" in err
    p = me.load_predictor(workdir, echo=lambda line: None)
    assert p.calibration is None and p.temperature is None
    want = np.asarray(p.ensemble.predict(p.state, np.load(tmp_path / "x.npy")))
    np.testing.assert_allclose(np.load(tmp_path / "r.npz")["probs"], want, atol=1e-6)
    assert cli.main(["export", "--workdir", workdir, "--out", str(tmp_path / "e")]) == 0
    meta = json.loads((tmp_path / "e" / "export.json").read_text())
    assert meta["temperature"] is None and meta["conformal"] is None


def test_tasks_are_found_by_name_or_module_and_class():
    from meshensemble.core.tasks import task_class

    assert task_class("regression") is me.tasks.Regression
    assert task_class("meshensemble.tasks.classification:Classification").name == "classification"
    with pytest.raises(ValueError, match=r"task='ordinal' is unknown; choose one of"):
        task_class("ordinal")
    with pytest.raises(ValueError, match=r"module 'no_such_module' does not import"):
        task_class("no_such_module:Task")
    with pytest.raises(ValueError, match=r"is <class 'dict'>, not a subclass"):
        task_class("builtins:dict")
    with pytest.raises(ValueError, match=r"task='ordinal' is unknown"):
        me.TrainConfig(task="ordinal").validate()
