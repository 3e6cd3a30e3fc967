"""Calibration of a trained run: the validation split, ``predict(temperature=...)``, the
inference bundle's temperature and ``meshensemble evaluate --calibrate``."""

from __future__ import annotations

import json
import os
import shutil
import types
import warnings
from functools import partial

import jax
import numpy as np
import pytest
from conftest import need_devices

import meshensemble as me
from meshensemble import calibration, cli, data
from meshensemble import evaluation as evaluate
from meshensemble.core import steps
from meshensemble.core.mesh import BATCH, MEMBERS
from meshensemble.data.split import split_validation
from meshensemble.training import TrainConfig, train
from meshensemble.training.identity import check_same_run, read_saved_config, run_fields

NUM_TRAIN, NUM_TEST, NUM_VAL = 320, 90, 64


def _skewed(n: int = 1000) -> data.Dataset:
    """A dataset whose classes have very different sizes (class c: ~ (c + 1) shares)."""
    ds = data.synthetic(n, 20, seed=1)
    labels = np.repeat(np.arange(10), np.arange(1, 11) * n // 55 + 1)[:n].astype(np.int32)
    labels = np.concatenate([labels, np.full(n - len(labels), 9, np.int32)])
    return data.Dataset(
        "mnist", ds.train_images, labels, ds.test_images, ds.test_labels, "synthetic", "skewed"
    )


def _noisy(num_train: int, num_test: int, flip: float = 0.3) -> data.Dataset:
    """Synthetic data with a fraction of labels replaced at random: no member can be sure,
    so the fitted temperature lies inside its search range."""
    ds = data.synthetic(num_train, num_test, seed=0)
    rng = np.random.default_rng(7)

    def noisy(y: np.ndarray) -> np.ndarray:
        y = y.copy()
        hit = rng.random(len(y)) < flip
        y[hit] = rng.integers(0, 10, hit.sum())
        return y

    return data.Dataset(
        "mnist",
        ds.train_images,
        noisy(ds.train_labels),
        ds.test_images,
        noisy(ds.test_labels),
        "synthetic",
        "noisy",
    )


def test_split_is_stratified_seeded_and_disjoint() -> None:
    ds = _skewed()
    split = split_validation(ds, 100, seed=3)
    sizes = np.bincount(ds.train_labels, minlength=10)
    held = np.bincount(split.labels, minlength=10)
    assert held.sum() == split.count == 100
    assert np.all(np.abs(held - 100 * sizes / sizes.sum()) < 1), held  # stratified
    # disjoint and complete: the held-out and the kept examples partition the train split
    keep = np.setdiff1d(np.arange(ds.num_train), split.indices)
    assert len(np.intersect1d(keep, split.indices)) == 0
    assert split.train.num_train + split.count == ds.num_train
    np.testing.assert_array_equal(split.train.train_labels, ds.train_labels[keep])
    np.testing.assert_array_equal(split.train.train_images, ds.train_images[keep])
    np.testing.assert_array_equal(split.images, ds.train_images[split.indices])
    np.testing.assert_array_equal(split.train.test_labels, ds.test_labels)
    # seeded: the same seed gives the same indices, another seed others
    again = split_validation(ds, 100, seed=3)
    np.testing.assert_array_equal(again.indices, split.indices)
    assert again.fingerprint == split.fingerprint
    other = split_validation(ds, 100, seed=4)
    assert not np.array_equal(other.indices, split.indices)
    assert other.record()["fingerprint"] != split.record()["fingerprint"]
    assert split.record()["per_class"] == held.tolist()
    assert split_validation(ds, 0, seed=3).train is ds


def test_split_errors_are_one_line() -> None:
    ds = data.synthetic(100, 10)
    with pytest.raises(ValueError, match=r"^validation=-1 must be an integer >= 0"):
        split_validation(ds, -1)
    with pytest.raises(ValueError, match=r"leaves 10 of the 100 .* use --validation 68 or less$"):
        split_validation(ds, 90, batch_size=32)
    with pytest.raises(ValueError, match=r"^validation=-2 must be an integer >= 0"):
        TrainConfig(validation=-2).validate()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """4 MLP members, 2 epochs on ensemble=4,data=2 with 64 examples held out."""
    need_devices(8)
    root = tmp_path_factory.mktemp("calibrate")
    ds = _noisy(NUM_TRAIN, NUM_TEST)
    npz = data.save_npz(ds, root / "synthetic.npz")
    workdir = os.fspath(root / "run")
    cfg = TrainConfig(
        model="mlp",
        members=4,
        mesh="ensemble=4,data=2",
        epochs=2,
        batch_size=32,
        validation=NUM_VAL,
        seed=5,
        source="npz",
        data_file=npz,
        workdir=workdir,
        quiet=True,
    )
    trained = train(cfg)
    return types.SimpleNamespace(root=root, ds=ds, cfg=cfg, workdir=workdir, trained=trained)


def _copy(run, name: str) -> str:
    dest = os.fspath(run.root / name)
    shutil.copytree(run.workdir, dest)
    return dest


@pytest.mark.slow  # among the heaviest default tests, measured
def test_run_holds_the_split_out_and_records_it(run) -> None:
    split = split_validation(run.ds, NUM_VAL, seed=5)
    saved = read_saved_config(run.workdir)
    assert saved["validation"] == NUM_VAL
    rec = saved["resolved"]["validation"]
    assert rec["count"] == NUM_VAL and rec["seed"] == 5
    assert rec["fingerprint"] == split.fingerprint
    # never trained on: the run's training set is the rest, in order
    used = run.trained.dataset
    assert used.num_train == NUM_TRAIN - NUM_VAL
    np.testing.assert_array_equal(used.train_images, split.train.train_images)
    # 256 examples / 32 = 8 steps per epoch (320 would give 10)
    assert run.trained.history[-1]["step"] == 16
    # part of the run's identity: resuming with another split is refused
    other = run_fields(TrainConfig(**{**vars(run.cfg), "validation": 32}))
    with pytest.raises(ValueError, match="validation=64.*validation=32"):
        check_same_run(run.workdir, saved, other)


def test_too_large_validation_is_one_line(tmp_path) -> None:
    cfg = TrainConfig(
        model="mlp", members=4, epochs=1, batch_size=32, validation=300, workdir=str(tmp_path)
    )
    with pytest.raises(ValueError, match="validation=300 leaves 20 of the 320 .*fewer than one"):
        train(cfg, dataset=data.synthetic(NUM_TRAIN, 16))


@pytest.mark.slow  # among the heaviest default tests, measured
def test_predict_with_temperature(run) -> None:
    ens, state = run.trained.ensemble, run.trained.state
    x = run.ds.test_images[:50]
    base = np.asarray(ens.predict(state, x))
    # None runs today's program: the per-device ensemble prediction, bitwise
    ref = ens.build(
        ("test_ref", "ensemble_prediction"),
        lambda c: partial(steps.ensemble_prediction, c),
        (MEMBERS, BATCH),
        BATCH,
    )
    np.testing.assert_array_equal(base, np.asarray(ref(state, x)))
    np.testing.assert_array_equal(np.asarray(ens.predict(state, x, temperature=None)), base)
    np.testing.assert_allclose(np.asarray(ens.predict(state, x, temperature=1.0)), base, atol=1e-6)
    members = np.asarray(ens.predict_members(state, x))
    np.testing.assert_array_equal(
        np.asarray(ens.predict_members(state, x, temperature=None)), members
    )
    # a scalar T: pool, then calibrate (what evaluate --calibrate fits)
    want = calibration.apply_temperature(calibration.ensemble_logits(members), 2.5)
    got = np.asarray(ens.predict(state, x, temperature=2.5))
    np.testing.assert_allclose(got, np.asarray(want), atol=1e-6)
    assert np.all(got.max(-1) < base.max(-1) + 1e-7)  # T > 1 softens
    np.testing.assert_array_equal(got.argmax(-1), base.argmax(-1))
    # [members] temperatures: each member scaled, then pooled
    ts = np.array([0.5, 1.0, 2.0, 4.0], np.float32)
    per = np.asarray(ens.predict_members(state, x, temperature=ts))
    want_per = calibration.apply_temperature(np.log(np.maximum(members, 1e-12)), ts)
    np.testing.assert_allclose(per, np.asarray(want_per), atol=1e-6)
    np.testing.assert_allclose(per[1], members[1], atol=1e-6)
    pooled = np.asarray(ens.predict(state, x, temperature=ts))
    np.testing.assert_allclose(pooled, per.mean(0), atol=1e-6)
    bads = ((0.0, "> 0"), ([1.0, 2.0], r"\[members\] = \[4\]"), (np.nan, "finite"))
    for bad, text in (*bads, (np.inf, "finite"), ("hot", "must be a number > 0")):
        with pytest.raises(ValueError, match=text):
            ens.predict(state, x, temperature=bad)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_inference_bundle_carries_the_temperature(run) -> None:
    ens, state = run.trained.ensemble, run.trained.state
    x = run.ds.test_images[:20]
    for name, t in (("scalar", 1.75), ("members", [0.5, 1.0, 1.5, 2.0]), ("none", None)):
        path = os.fspath(run.root / f"bundle_{name}")
        me.save_inference(path, state, temperature=t)
        loaded, got = me.load_inference(path, ens, x[:1], with_temperature=True)
        if t is None:
            assert got is None
        elif name == "scalar":
            assert isinstance(got, float) and got == t
        else:
            np.testing.assert_array_equal(got, np.asarray(t))
        np.testing.assert_allclose(
            np.asarray(ens.predict(loaded, x, temperature=got)),
            np.asarray(ens.predict(state, x, temperature=t)),
            atol=1e-6,
        )
        # the old call still returns the state alone
        assert isinstance(me.load_inference(path, ens, x[:1]), me.EnsembleState)
    with pytest.raises(ValueError, match="must be finite and > 0"):
        me.save_inference(os.fspath(run.root / "bundle_bad"), state, temperature=-1.0)
    assert not os.path.exists(run.root / "bundle_bad")


@pytest.mark.slow  # among the heaviest default tests, measured
def test_evaluate_calibrate_writes_the_section(run, capsys) -> None:
    workdir = _copy(run, "cli")
    argv = ["evaluate", "--workdir", workdir, "--mesh", "ensemble=2,data=4", "--batch-size", "40"]
    assert cli.main([*argv, "--calibrate", "--alpha", "0.2", "--ood", "noise"]) == 0
    out = capsys.readouterr().out
    assert "note: 64 validation examples are few for a temperature" in out, out
    assert "calibration: T=" in out and "coverage" in out
    with open(os.path.join(workdir, evaluate.EVALUATION_FILE)) as f:  # strict JSON
        section = json.loads(f.read(), parse_constant=lambda t: pytest.fail(t))["calibration"]
    with open(os.path.join(workdir, evaluate.CALIBRATION_PLOT), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert section["num_validation"] == NUM_VAL and section["temperature"] > 0
    assert not section["temperature_at_bound"]
    # T is fitted on the validation split: its NLL cannot get worse
    assert section["validation_nll_after"] <= section["validation_nll_before"] + 1e-6
    for part in ("before", "after"):
        assert set(section[part]) == {"accuracy", "nll", "ece", "adaptive_ece", "brier"}
    assert section["before"]["accuracy"] == section["after"]["accuracy"]
    conf = section["conformal"]
    assert conf["method"] == "thr" and conf["alpha"] == 0.2
    counts = np.asarray(conf["set_size_counts"])
    assert counts.sum() == NUM_TEST and len(counts) == 11
    assert conf["mean_set_size"] == pytest.approx((counts * np.arange(11)).sum() / NUM_TEST)
    assert 0 <= conf["coverage"] <= 1

    # the same numbers by hand: T, q and the test sets from the member probabilities
    ens, state = run.trained.ensemble, run.trained.state
    split = split_validation(run.ds, NUM_VAL, seed=5)
    zv = calibration.ensemble_logits(ens.predict_members(state, split.images))
    t = calibration.fit_temperature(zv, split.labels)
    assert section["temperature"] == pytest.approx(t, rel=1e-4)
    pv = calibration.apply_temperature(zv, t)
    q = calibration.conformal_quantile(pv, split.labels, 0.2)
    assert conf["threshold"] == pytest.approx(q, abs=1e-5)
    pt = ens.predict(state, run.ds.test_images, temperature=t)
    sets = calibration.prediction_sets(pt, q)
    assert conf["coverage"] == pytest.approx(calibration.coverage(sets, run.ds.test_labels))
    assert section["after"]["nll"] == pytest.approx(
        float(me.metrics.nll(pt, run.ds.test_labels)), rel=1e-4
    )


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_plain_evaluate_keeps_the_calibration_of_its_checkpoint(run, capsys) -> None:
    """``evaluate`` without ``--calibrate`` rewrites evaluation.json: the temperature and
    conformal threshold fitted for that checkpoint stay (predict applies them); one of
    another checkpoint goes, with a note."""
    workdir = _copy(run, "keep")
    path = os.path.join(workdir, evaluate.EVALUATION_FILE)
    argv = ["evaluate", "--workdir", workdir, "--mesh", "ensemble=2,data=4"]
    assert cli.main([*argv, "--calibrate", "--alpha", "0.2"]) == 0
    with open(path) as f:
        fitted = json.load(f)
    capsys.readouterr()
    assert cli.main(argv) == 0
    assert "kept the calibration of checkpoint" in capsys.readouterr().out
    with open(path) as f:
        again = json.load(f)
    assert again["calibration"] == fitted["calibration"]
    assert again["checkpoint_step"] == fitted["checkpoint_step"]
    again["calibration"]["fitted_for"]["step"] -= 1  # as if fitted for another checkpoint
    with open(path, "w") as f:
        json.dump(again, f)
    assert cli.main(argv) == 0
    assert "note: dropped the calibration of checkpoint" in capsys.readouterr().out
    with open(path) as f:
        assert "calibration" not in json.load(f)


def test_calibrate_refuses_a_run_without_validation(run, capsys) -> None:
    workdir = _copy(run, "no_validation")
    path = os.path.join(workdir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["validation"] = 0
    with open(path, "w") as f:
        json.dump(cfg, f)
    assert cli.main(["evaluate", "--workdir", workdir, "--calibrate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train with --validation N first" in err, err
    assert not os.path.exists(os.path.join(workdir, evaluate.EVALUATION_FILE))
    assert cli.main(["evaluate", "--workdir", run.workdir, "--calibrate", "--alpha", "2"]) == 2
    assert "alpha=2.0 must lie in (0, 1)" in capsys.readouterr().err
    jax.clear_caches()


def test_a_temperature_at_its_bound_is_refused_not_applied(run) -> None:
    """Five validation examples, all right (issue 25, case 4): T ran to 0.001 and was
    applied, test NLL 0.433 -> 3.674. Now one line says why and how many to hold out."""
    ens, state = run.trained.ensemble, run.trained.state
    x, y = run.ds.test_images, run.ds.test_labels
    right = np.flatnonzero(np.asarray(ens.predict(state, x)).argmax(-1) == y)[:5]
    with pytest.raises(ValueError, match="search bound T=0.001.*not applied.*--validation") as e:
        evaluate.calibrate_ensemble(ens, state, (x[right], y[right]), (x, y), alpha=0.2)
    assert "\n" not in str(e.value)
    # the library itself refuses a bound unless asked to return it
    z = 5.0 * np.eye(10)[np.arange(40) % 10]
    with pytest.raises(ValueError, match="lower temperature bound 0.001.*hold out more"):
        calibration.fit_temperature(z, np.arange(40) % 10)


def test_alpha_too_small_for_the_split_is_refused_before_any_work(run, capsys, monkeypatch):
    """--alpha 0.001 with the run's 64 validation examples (as config.json records them):
    refused before the restore, the test evaluation and the OOD evaluation; the run folder
    is unchanged."""
    workdir = _copy(run, "small_alpha")

    def never(*args, **kwargs):
        raise AssertionError("restored a checkpoint before refusing")

    monkeypatch.setattr(evaluate, "restore_checkpoint", never, raising=False)
    before = {
        p: os.stat(os.path.join(r, p)).st_mtime_ns for r, _, fs in os.walk(workdir) for p in fs
    }
    argv = ["evaluate", "--workdir", workdir, "--calibrate", "--alpha", "0.001", "--ood", "noise"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "n >= 1/alpha - 1 = 999" in err and " 64 " in err, err
    after = {
        p: os.stat(os.path.join(r, p)).st_mtime_ns for r, _, fs in os.walk(workdir) for p in fs
    }
    assert after == before
    # a split that is merely small for the alpha or for a temperature is a warning
    small = types.SimpleNamespace(validation=64)
    for alpha, want in ((0.2, ["few for a temperature"]), (0.1, ["few for alpha=0.1", "temp"])):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            me.calibration.run.check_calibration(small.validation, alpha, "thr")
        assert [w for w in want if not any(w in str(s.message) for s in seen)] == []
        assert len(seen) == len(want)
