"""Using a trained regression run: ``evaluate`` (and ``--calibrate``), ``me.load_predictor``,
``meshensemble predict`` and ``meshensemble export``."""

from __future__ import annotations

import csv
import json
import math
import os
import pathlib
import shutil
import types

import jax
import numpy as np
import pytest
from conftest import need_devices

import meshensemble as me
from meshensemble import calibration, cli
from meshensemble.training.restore import load_run_config, run_identity, run_mesh
from meshensemble.training.rundata import input_record

ALPHA = 0.1
VALIDATION = 100
MESH = "ensemble=4,data=2"


def _data(root: pathlib.Path) -> tuple[str, me.data.RegressionData]:
    """An npz of two features and one target [N] (offset 100: units matter), exchangeable
    validation and test rows."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(500, 2)).astype(np.float32)
    y = (100 + 3 * x[:, 0] - x[:, 1] ** 2 + rng.normal(size=500) * (1 + abs(x[:, 0]))).astype(
        np.float32
    )
    path = os.fspath(root / "d.npz")
    np.savez(path, x_train=x[:300], y_train=y[:300], x_test=x[300:], y_test=y[300:])
    return path, me.data.load_regression_npz(path)


def _reference(workdir: str, data: me.data.RegressionData, mesh: str, **fields):
    """The run's ensemble and state, rebuilt from the data (not from the run's records);
    ``fields`` override its config (e.g. ``shard_members=False``)."""
    saved = json.loads(pathlib.Path(workdir, "config.json").read_text())
    cfg = me.TrainConfig(**{k: v for k, v in saved.items() if k != "resolved"} | fields)
    split = me.data.split_validation(data, cfg.validation, cfg.seed)
    train, val = split.train, (split.x, split.y)
    task = me.tasks.Regression().for_data(train, {})
    stats = input_record(train.x_train)["normalization"]
    steps = saved["resolved"]["steps_per_epoch"]
    ens = me.training.build_ensemble(
        cfg, run_mesh(mesh, 4), train.num_train, train.x_train[:1], task=task,
        input_stats=stats, steps_per_epoch=steps,
    )  # fmt: skip
    state, _, step = me.restore_checkpoint(workdir, ens, data.x_test[:1], move_damaged=False)
    return types.SimpleNamespace(ens=ens, state=state, step=step, val=val)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-member regression run with a validation split, evaluated with --calibrate."""
    need_devices(8)
    root = tmp_path_factory.mktemp("regression_use")
    path, data = _data(root)
    workdir = os.fspath(root / "run")
    argv = ["train", "--task", "regression", "--source", "npz", "--data-file", path,
            "--members", "4", "--mesh", MESH, "--epochs", "6", "--batch-size", "40",
            "--validation", str(VALIDATION), "--optimizer", "adam", "--learning-rate", "0.01",
            "--no-compile-cache", "--quiet", "--workdir", workdir]  # fmt: skip
    assert cli.main(argv) == 0
    own = os.fspath(root / "own")
    shutil.copytree(workdir, own)  # as train left it: calibrated at its end
    plain = os.fspath(root / "plain")
    shutil.copytree(workdir, plain)
    if os.path.exists(os.path.join(plain, "evaluation.json")):  # without the run's own
        os.remove(os.path.join(plain, "evaluation.json"))  # calibration
    before = sorted(os.listdir(workdir))
    argv = ["evaluate", "--workdir", workdir, "--calibrate", "--alpha", str(ALPHA),
            "--mesh", "ensemble=2,data=4"]  # fmt: skip
    assert cli.main(argv) == 0
    result = json.loads(pathlib.Path(workdir, "evaluation.json").read_text())
    ref = _reference(workdir, data, MESH)
    return types.SimpleNamespace(root=root, workdir=workdir, plain=plain, data=data, path=path,
                                 result=result, ref=ref, before=before, own=own)  # fmt: skip


@pytest.mark.slow  # among the heaviest default tests, measured
def test_evaluate_scores_are_the_ensembles_on_the_restored_state(run):
    want = run.ref.ens.evaluate(run.ref.state, run.data.x_test, run.data.y_test)
    got = run.result
    for key in ("nll", "rmse", "mae", "crps", "coverage_50", "coverage_90", "width_95",
                "quantile_calibration_error"):  # fmt: skip
        assert got[f"test_{key}"] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert (got["task"], got["checkpoint_step"], got["num_test"]) == ("regression", run.ref.step,
                                                                      200)  # fmt: skip
    # in the data's units: errors are on the targets' scale, not the standardised one
    assert got["test_rmse"] < run.data.y_test.std() < 100
    assert sorted(os.listdir(run.workdir)) == run.before  # evaluation.json: the train's


@pytest.mark.slow  # among the heaviest default tests, measured
def test_calibrate_fits_on_validation_and_covers_the_test_split(run):
    cal = run.result["calibration"]
    x_val, y_val = run.ref.val
    out = me.distributed.fetch(run.ref.ens.predict(run.ref.state, x_val))
    s = calibration.fit_variance_scale(out["mean"], out["variance"], y_val)
    q = calibration.conformal_interval_quantile(
        out["mean"], np.sqrt(s * out["variance"]), y_val, ALPHA
    )
    assert cal["variance_scale"] == pytest.approx(s, rel=1e-5)
    assert cal["conformal"] == {"quantile": pytest.approx(q, rel=1e-5), "alpha": ALPHA,
                                "num_calibration": VALIDATION}  # fmt: skip
    t = me.distributed.fetch(run.ref.ens.predict(run.ref.state, run.data.x_test))
    half = q * np.sqrt(s * t["variance"])
    covered = np.mean(np.abs(run.data.y_test - t["mean"]) <= half)
    assert cal["test"]["coverage_conformal"] == pytest.approx(covered, abs=1e-9)
    assert cal["test"]["width_conformal"] == pytest.approx(np.mean(2 * half), rel=1e-5)
    assert covered >= 1 - ALPHA - 0.05  # the guarantee, with sampling slack for 200 rows
    z = 1.6448536269514722  # the normal 95% quantile: 90% central intervals before scaling
    before = np.mean(np.abs(run.data.y_test - t["mean"]) <= z * np.sqrt(t["variance"]))
    assert cal["test"]["coverage_before"] == pytest.approx(before, abs=1e-9)


def test_predictor_equals_ensemble_predict_and_applies_the_calibration(run, tmp_path):
    p = me.load_predictor(run.workdir, mesh="ensemble=2,data=4", batch_size=24)
    assert isinstance(p, me.Predictor) and p.task.name == "regression"
    x = run.data.x_test[:37]
    want = me.distributed.fetch(run.ref.ens.predict(run.ref.state, x))
    raw = p.predict(x, scale=False)
    for k in ("mean", "variance", "aleatoric", "epistemic"):  # other mesh, other batches:
        np.testing.assert_allclose(raw[k], want[k], rtol=1e-5, atol=1e-6)  # float rounding
    s, q = (
        run.result["calibration"]["variance_scale"],
        run.result["calibration"]["conformal"]["quantile"],
    )
    out = p.outputs(x.astype(np.float64), members=True)  # cast per batch
    np.testing.assert_allclose(out["variance"], s * want["variance"], rtol=1e-5)
    np.testing.assert_allclose(out["epistemic"], s * want["epistemic"], rtol=1e-5)
    half = q * np.sqrt(s * want["variance"])
    np.testing.assert_allclose(out["upper"], want["mean"] + half, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(out["lower"], want["mean"] - half, rtol=1e-5, atol=1e-4)
    members = me.distributed.fetch(run.ref.ens.predict_members(run.ref.state, x))
    np.testing.assert_allclose(out["member_mean"], members["mean"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["member_variance"], members["variance"], rtol=1e-5)

    np.save(tmp_path / "x.npy", x)
    argv = ["predict", "--workdir", run.workdir, "--input", str(tmp_path / "x.npy"), "--out"]
    assert cli.main([*argv, str(tmp_path / "p.npz"), "--members", "--quiet"]) == 0
    saved = np.load(tmp_path / "p.npz")
    for k, v in out.items():
        np.testing.assert_allclose(saved[k], v, rtol=1e-5, atol=1e-6)
    np.savez(tmp_path / "x.npz", x=x)
    assert cli.main([*argv[:4], str(tmp_path / "x.npz"), "--out", str(tmp_path / "p.csv")]) == 0
    rows = list(csv.DictReader((tmp_path / "p.csv").read_text().splitlines()))
    assert len(rows) == 37 and list(rows[0]) == ["index", "mean", "variance", "aleatoric",
                                                 "epistemic", "lower", "upper"]  # fmt: skip
    assert float(rows[5]["upper"]) == pytest.approx(out["upper"][5, 0], rel=1e-6)


def test_predict_writes_the_same_bits_for_any_batch_size(run, tmp_path):
    """A row's moments, members and conformal interval are the same bits for ``predict
    --batch-size`` 1000 (the default), 7 and 1, and alone: regression runs through the one
    predictor's blocked program too."""
    x = run.data.x_test  # 200 rows: 4 blocks a device in one batch, 1 in batches of 7
    np.save(tmp_path / "x.npy", x)
    argv = ["predict", "--workdir", run.workdir, "--input", str(tmp_path / "x.npy"),
            "--members", "--quiet", "--out"]  # fmt: skip
    out = {}
    for size in (None, 7, 1):
        path = str(tmp_path / f"p{size}.npz")
        assert cli.main([*argv, path, *([] if size is None else ["--batch-size", str(size)])]) == 0
        out[size] = dict(np.load(path))
    assert {"mean", "variance", "lower", "upper", "member_mean"} <= set(out[None])
    for size in (7, 1):
        for key, want in out[None].items():
            np.testing.assert_array_equal(out[size][key], want, err_msg=f"{key}, batch {size}")
    p = me.load_predictor(run.workdir)
    assert list(p.outputs(x[:1], members=True)) == list(me.tasks.regression.OUTPUT_KEYS)
    for i in (0, 77, 199):
        alone = p.outputs(x[i : i + 1], members=True)
        for key, v in alone.items():
            got, want = (v[:, 0], out[None][key][:, i]) if key.startswith("member_") else (
                v[0], out[None][key][i])  # fmt: skip
            np.testing.assert_array_equal(got, want, err_msg=f"{key}, row {i} alone")


def test_export_equals_predict_for_batches_of_1_and_7(run, tmp_path):
    out = os.fspath(tmp_path / "exported")
    assert cli.main(["export", "--workdir", run.workdir, "--out", out, "--platforms", "cpu"]) == 0
    meta = json.loads(pathlib.Path(out, "export.json").read_text())
    cal = run.result["calibration"]
    assert (meta["task"], meta["targets"], meta["members"]) == ("regression", 1, 4)
    assert meta["input"] == {"shape": ["batch", 2], "dtype": "float32"}
    assert meta["variance_scale"] == cal["variance_scale"]
    assert meta["conformal"] == {"quantile": cal["conformal"]["quantile"], "alpha": ALPHA}
    saved = json.loads(pathlib.Path(run.workdir, "config.json").read_text())["resolved"]
    assert meta["preprocessing"] == {"task": saved["task"], "input": saved["input"]}
    exp = jax.export.deserialize(bytearray(pathlib.Path(out, "ensemble.jax").read_bytes()))
    p = me.load_predictor(run.workdir)
    for n in (1, 7):
        x = run.data.x_test[:n]
        got, want = exp.call(x), p.outputs(x, members=True)
        for k in ("mean", "variance", "member_mean", "member_variance"):
            np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-5, atol=1e-5)
        lower, upper = me.tasks.regression.intervals_from(got["mean"], got["variance"], meta)
        np.testing.assert_allclose(upper, want["upper"], rtol=1e-5, atol=1e-4)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_an_fsdp_run_predicts_and_exports_like_any_other(run, tmp_path):
    """``--shard-members``: the predictor, ``predict`` and ``export`` lay the restored state
    out as the run did (they failed asking for ``Ensemble(sample=)``)."""
    workdir = os.fspath(tmp_path / "fsdp")
    argv = ["train", "--task", "regression", "--source", "npz", "--data-file", run.path,
            "--members", "4", "--mesh", "ensemble=2,data=4", "--shard-members", "--epochs",
            "1", "--batch-size", "40", "--no-compile-cache", "--quiet", "--validation", "0",
            "--workdir", workdir]  # fmt: skip
    assert cli.main(argv) == 0
    p = me.load_predictor(workdir)
    x = run.data.x_test[:9]
    whole = _reference(workdir, run.data, MESH, shard_members=False)  # members unsplit
    want = me.distributed.fetch(whole.ens.predict(whole.state, x))
    got = p.outputs(x, members=True)
    for k in ("mean", "variance", "aleatoric", "epistemic"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
    np.save(tmp_path / "x.npy", x)
    argv = ["predict", "--workdir", workdir, "--input", str(tmp_path / "x.npy"), "--out"]
    assert cli.main([*argv, str(tmp_path / "p.npz"), "--quiet"]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "p.npz")["mean"], want["mean"], rtol=1e-5)
    out = os.fspath(tmp_path / "exported")
    assert cli.main(["export", "--workdir", workdir, "--out", out, "--platforms", "cpu"]) == 0
    exp = jax.export.deserialize(bytearray(pathlib.Path(out, "ensemble.jax").read_bytes()))
    member_mean = np.asarray(exp.call(x)["member_mean"])
    np.testing.assert_allclose(member_mean, got["member_mean"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_plain_evaluate_keeps_the_calibration_predict_applies(run, tmp_path, capsys):
    workdir = os.fspath(tmp_path / "kept")
    shutil.copytree(run.workdir, workdir)
    assert cli.main(["evaluate", "--workdir", workdir, "--mesh", MESH]) == 0
    assert "kept the calibration of checkpoint" in capsys.readouterr().out
    result = json.loads(pathlib.Path(workdir, "evaluation.json").read_text())
    assert result["calibration"] == run.result["calibration"]
    x = run.data.x_test[:5]
    out = me.load_predictor(workdir).outputs(x)
    want = me.load_predictor(run.workdir).outputs(x)
    np.testing.assert_allclose(out["upper"], want["upper"], rtol=1e-6)


def _edit_config(workdir: str, **fields) -> None:
    path = pathlib.Path(workdir, "config.json")
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))


def _refused(capsys, argv, match):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1, err


def test_one_line_refusals(run, tmp_path, capsys):
    novalid = os.fspath(tmp_path / "novalid")
    shutil.copytree(run.plain, novalid)
    _edit_config(novalid, validation=0)
    _refused(capsys, ["evaluate", "--workdir", novalid, "--calibrate"], "no validation split")
    small = ["evaluate", "--workdir", run.plain, "--calibrate", "--alpha", "0.005"]
    _refused(capsys, small, "too small for the run's 100 validation scores")
    _refused(capsys, [*small[:4], "--conformal", "aps"], "is for classification sets")
    _refused(capsys, [*small[:3], "--conformal", "aps"], "add --calibrate, or drop --conformal")
    _refused(capsys, [*small[:3], "--ood", "inverted"], "task 'regression' offers no OOD sets")
    assert not os.path.exists(os.path.join(run.plain, "evaluation.json"))
    _refused(capsys, ["train", "--task", "classification", "--workdir", run.plain],
             "holds a regression run, which a resumed command continues")  # fmt: skip

    other = tmp_path / "other.npz"
    with np.load(run.path) as d:
        arrays = dict(d)
    arrays["y_test"] = arrays["y_test"] + 1
    np.savez(other, **arrays)
    _refused(capsys, ["evaluate", "--workdir", run.plain, "--data-file", str(other)],
             "drop --source/--data-file/--data-dir to load what it recorded")  # fmt: skip
    assert not os.path.exists(os.path.join(run.plain, "evaluation.json"))
    changed = os.fspath(tmp_path / "changed")  # the recorded file itself changed
    shutil.copytree(run.plain, changed)
    saved = json.loads(pathlib.Path(changed, "config.json").read_text())
    saved["resolved"]["data_identity"]["data_file"] = str(other)  # where the run's data is
    _edit_config(changed, data_file=str(other), resolved=saved["resolved"])
    _refused(capsys, ["evaluate", "--workdir", changed], "the test split of this data")
    _refused(capsys, ["evaluate", "--workdir", changed], "has changed since it was trained")

    np.save(tmp_path / "x3.npy", np.zeros((4, 3), np.float32))
    predict = ["predict", "--workdir", run.plain, "--out", str(tmp_path / "p.npz"), "--input"]
    _refused(capsys, [*predict, str(tmp_path / "x3.npy")], "the run takes features [N, 2]")
    np.save(tmp_path / "x2.npy", np.zeros((4, 2), np.float32))
    _refused(capsys, [*predict, str(tmp_path / "x2.npy"), "--sets"], "no conformal intervals")
    _refused(capsys, [*predict, str(tmp_path / "x2.npy"), "--no-temperature"],
             "does not apply")  # fmt: skip
    np.save(tmp_path / "nan.npy", np.array([[0, 0], [np.nan, 1]], np.float32))
    _refused(capsys, [*predict, str(tmp_path / "nan.npy")], "holds nan (not finite) at row 1, "
             "column 0; give finite features")  # fmt: skip
    assert not os.path.exists(tmp_path / "p.npz")
    with pytest.raises(ValueError, match="at row 1, column 0"):
        me.load_predictor(run.plain).outputs(np.array([[0, 0], [np.inf, 1]]))
    with pytest.raises(ValueError, match="no prediction sets; use predictor.intervals"):
        me.load_predictor(run.plain).prediction_sets(np.zeros((1, 2)))
    assert math.isfinite(run.result["calibration"]["conformal"]["quantile"])



def test_a_run_with_a_validation_split_calibrates_itself_and_predict_applies_it(run, tmp_path):
    """Train fits the calibration evaluate --calibrate fits (the same validation rows, alpha
    0.1) at its end, bound to its last checkpoint; predict serves it with no other command."""
    own = json.loads(pathlib.Path(run.own, "evaluation.json").read_text())
    cal, step = own["calibration"], own["checkpoint_step"]
    assert step == run.ref.step == me.training.checkpoint.list_checkpoints(run.own)[-1]
    assert cal["fitted_for"] == run.result["calibration"]["fitted_for"]  # the run's identity
    assert cal["fitted_for"] == run_identity(run.workdir, load_run_config(run.workdir), step)
    out = me.distributed.fetch(run.ref.ens.predict(run.ref.state, run.ref.val[0]))
    s = calibration.fit_variance_scale(out["mean"], out["variance"], run.ref.val[1])
    q = calibration.conformal_interval_quantile(
        out["mean"], np.sqrt(s * out["variance"]), run.ref.val[1], ALPHA
    )
    assert cal["variance_scale"] == pytest.approx(s, rel=1e-5)
    assert cal["conformal"] == {"quantile": pytest.approx(q, rel=1e-5), "alpha": ALPHA,
                                "num_calibration": VALIDATION}  # fmt: skip
    record = json.loads(pathlib.Path(run.own, "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == step and own["test_nll"] == record["test_nll"]
    x = run.data.x_test[:9]
    np.save(tmp_path / "x.npy", x)
    argv = ["predict", "--workdir", run.own, "--input", str(tmp_path / "x.npy"), "--out",
            str(tmp_path / "p.npz"), "--mesh", MESH, "--sets", "--quiet"]  # fmt: skip
    assert cli.main(argv) == 0
    got = np.load(tmp_path / "p.npz")
    want = me.distributed.fetch(run.ref.ens.predict(run.ref.state, x))
    np.testing.assert_allclose(got["variance"], s * want["variance"], rtol=1e-5)
    half = q * np.sqrt(s * want["variance"])
    np.testing.assert_allclose(got["upper"], want["mean"] + half, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got["lower"], want["mean"] - half, rtol=1e-5, atol=1e-4)
