"""Early stopping and keep-best on the validation split; lines under 120 characters.

The data are random labels: the validation NLL is best after an epoch or so and then
rises as the members memorise the noise, so early stopping has something to stop.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import numpy as np
import pytest
from conftest import need_devices

import meshensemble as me
from meshensemble import cli
from meshensemble.training import TrainConfig, train
from meshensemble.training.checkpoint import list_checkpoints

BASE = me.data.synthetic(num_train=256, num_test=40, seed=0)
NOISE = me.data.Dataset(
    name="noise",
    x_train=BASE.x_train,
    y_train=np.random.default_rng(0).integers(0, 10, 256).astype(np.int32),
    x_test=BASE.x_test,
    y_test=BASE.y_test,
    num_classes=10,
)
WIDTH = 120


def watched(tmp_path, name, **kw) -> TrainConfig:
    base = dict(
        model="mlp", members=2, mesh="ensemble=2,data=1", epochs=6, batch_size=32,
        learning_rate=0.1, workdir=str(tmp_path / name), quiet=True, eval_batch_size=16,
        validation=64, eval_every=1, early_stopping="val_nll:3", keep_best="val_nll", keep=1,
    )  # fmt: skip
    return TrainConfig(**(base | kw))


def records(workdir) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def kept_best(workdir) -> dict:
    with open(os.path.join(workdir, "config.json")) as f:
        return json.load(f)["resolved"]["keep_best"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--validation", "64", "--early-stopping", "val_crps:2"], "val_crps.*val_nll"),
        (["--validation", "64", "--keep-best", "val_loss"], "val_loss.*val_accuracy"),
        (["--early-stopping", "val_nll:2"], "validation=0.*--validation N"),
        (["--keep-best", "val_nll"], "validation=0.*--validation N"),
        (["--validation", "64", "--early-stopping", "val_nll"], "METRIC:PATIENCE"),
        (["--validation", "64", "--early-stopping", "val_nll:0"], "METRIC:PATIENCE"),
    ],
)
def test_a_bad_watch_is_one_line_and_writes_nothing(tmp_path, capsys, argv, message):
    workdir = tmp_path / "w"
    assert cli.main(["train", "--source", "sample", "--workdir", str(workdir), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and len(err) <= 2 * WIDTH, err
    assert re.search(message, err), err
    assert not workdir.exists()


def test_regression_watches_crps_not_accuracy():
    reg = me.tasks.Regression()
    assert {"val_nll", "val_crps"} <= set(reg.validation_metrics)
    assert "val_accuracy" not in reg.validation_metrics
    with pytest.raises(ValueError, match="val_accuracy.*val_crps"):
        me.training.monitor.Monitors.from_config(
            TrainConfig(task="regression", validation=8, keep_best="val_accuracy"), reg
        )


@pytest.mark.slow  # among the heaviest default tests, measured
def test_cli_lines_fit_120_and_keep_best_is_named_and_used(tmp_path, capsys):
    """The only default-suite guard of two items: no train/evaluate line over 120
    characters, and a run that keeps (and names) its best checkpoint for --checkpoint best."""
    need_devices(2)
    npz = me.data.save_npz(NOISE, tmp_path / "noise.npz")
    workdir = str(tmp_path / "run")
    argv = ["train", "--source", "npz", "--data-file", npz, "--model", "mlp", "--members", "2",
            "--mesh", "ensemble=2,data=1", "--batch-size", "64", "--epochs", "3",
            "--eval-every", "1", "--validation", "64", "--early-stopping", "val_nll:1",
            "--keep-best", "val_nll", "--keep", "1", "--workdir", workdir]  # fmt: skip
    assert cli.main(argv) == 0
    train_out = capsys.readouterr().out
    held = kept_best(workdir)
    nll = [r["val_ensemble_nll"] for r in records(workdir)]
    assert held["value"] == min(nll) and held["step"] == records(workdir)[np.argmin(nll)]["step"]
    assert f"best checkpoint {held['step']}" in train_out.splitlines()[-1]
    assert held["step"] in list_checkpoints(workdir)  # pinned past --keep 1
    evaluate = ["evaluate", "--workdir", workdir, "--checkpoint", "best", "--calibrate"]
    assert cli.main([*evaluate, "--ood", "noise", "--ood", "inverted"]) == 0
    eval_out = capsys.readouterr().out
    assert f"checkpoint {held['step']}" in eval_out
    lines = (train_out + eval_out).replace(str(tmp_path), "/tmp/x").splitlines()  # not its length
    assert len(lines) > 10
    assert [s for s in lines if len(s) > WIDTH] == [], "\n".join(lines)


@pytest.mark.slow
def test_interrupted_and_resumed_decides_as_uninterrupted(tmp_path):
    """Early stopping and keep-best resume from the loop position: a run cut while it
    waits (since >= 1) stops at the same step, keeps the same best, trains the same."""
    need_devices(2)
    whole = train(watched(tmp_path, "whole"), dataset=NOISE)
    recs = records(whole_dir := str(tmp_path / "whole"))
    stop = recs[-1]["early_stopping"]
    assert stop["since"] == 3 and recs[-1]["step"] < 6 * 6  # it did stop early
    cut = next(r["step"] for r in recs if r["early_stopping"]["since"] == 1)
    split = watched(tmp_path, "split")
    train(dataclasses.replace(split, max_steps=cut), dataset=NOISE)
    resumed = train(split, dataset=NOISE)
    assert records(split.workdir) == recs
    assert list_checkpoints(split.workdir) == list_checkpoints(whole_dir)
    assert kept_best(split.workdir) == kept_best(whole_dir)
    for a, b in zip(jax.tree.leaves(whole.state.params), jax.tree.leaves(resumed.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
