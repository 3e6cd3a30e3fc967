"""``meshensemble evaluate``: one tiny trained run, evaluated on several meshes and by hand."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import types

import numpy as np
import pytest
from conftest import need_devices
from scipy.special import logsumexp
from sklearn.metrics import average_precision_score, roc_auc_score

from meshensemble import cli, data, metrics
from meshensemble import evaluation as evaluate
from meshensemble.tasks import ood as ood_lib
from meshensemble.training import TrainConfig, train
from meshensemble.training import checkpoint as ckpt_lib

NUM_TEST = 90  # not a multiple of the batch or of data=4: exercises padding and masking
BATCH = 32
ENSEMBLE_KEYS = (
    "accuracy",
    "nll",
    "brier",
    "ece",
    "entropy",
    "expected_entropy",
    "mutual_information",
    "disagreement",
    "disagreement_vs_ensemble",
    "pairwise_kl",
    "adaptive_ece",
)
MEMBER_KEYS = ("accuracy", "nll", "brier", "ece", "disagreement_vs_ensemble")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Trains 4 MLP members one epoch (4 steps) on ensemble=4,data=2, then evaluates there.

    The synthetic set is written to an npz and the run trained with ``source="npz"``, so
    ``config.json`` says where the data is and ``evaluate`` reloads it from there.
    """
    need_devices(8)
    root = tmp_path_factory.mktemp("evaluate")
    npz = data.save_npz(data.synthetic(128, NUM_TEST, seed=0), root / "synthetic.npz")
    workdir = os.fspath(root / "run")
    cfg = TrainConfig(
        model="mlp",
        members=4,
        mesh="ensemble=4,data=2",
        epochs=1,
        batch_size=32,
        source="npz",
        data_file=npz,
        workdir=workdir,
        quiet=True,
    )
    trained = train(cfg)
    lines: list[str] = []
    report = evaluate.evaluate_run(
        workdir, mesh="ensemble=4,data=2", batch_size=BATCH, echo=lines.append
    )
    return types.SimpleNamespace(
        root=root, npz=npz, workdir=workdir, trained=trained, report=report, lines=lines
    )


def _copy(run, name: str) -> str:
    """A copy of the run's folder, so a test may write into it."""
    dest = os.fspath(run.root / name)
    shutil.copytree(run.workdir, dest)
    return dest


def _assert_same(a: dict, b: dict, atol: float = 1e-5) -> None:
    """The numeric entries both dicts have agree to ``atol``."""
    shared = [k for k in a if k in b and k not in ("ood_sets", "task", "test_per_class")]
    assert shared
    for k in shared:
        # logits (unbounded) differ by float32 rounding between device layouts: a near-tie of
        # the max-logit / energy scores may swap ranks, moving an AUROC/AUPR by ~1/n^2
        tol = max(atol, 1e-3) if k.endswith(("_max_logit", "_energy")) else atol
        np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), atol=tol, err_msg=k)


def _entropy(p: np.ndarray) -> np.ndarray:
    p = p.astype(np.float64)
    return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.plots  # the rendered PNGs
def test_report_keys_files_and_training_names(run) -> None:
    r = run.report
    want = {f"test_ensemble_{k}" for k in ENSEMBLE_KEYS}
    want |= {f"test_member_{k}" for k in MEMBER_KEYS}
    want |= {f"test_mean_member_{k}" for k in MEMBER_KEYS}
    want |= {
        f"ood_{s}_{m}_{k}"
        for s in ("noise", "inverted")
        for m in ("auroc", "aupr")
        for k in ood_lib.OOD_SCORE_KINDS
    }
    want |= {
        f"ood_{s}_{m}_auroc_{k}"
        for s in ("noise", "inverted")
        for m in ("member", "mean_member")
        for k in ood_lib.MEMBER_OOD_KINDS
    }
    want |= {"checkpoint_step", "num_test", "ood_sets", "task", "test_per_class"}
    assert set(r) == want and r["task"] == "classification"
    assert r["checkpoint_step"] == 4 and r["num_test"] == NUM_TEST
    assert r["ood_sets"] == ["noise", "inverted"]
    assert all(len(r[f"test_member_{k}"]) == 4 for k in MEMBER_KEYS)
    with open(os.path.join(run.workdir, evaluate.EVALUATION_FILE)) as f:
        assert json.load(f) == r
    for name in (ood_lib.RELIABILITY_PLOT, ood_lib.OOD_PLOT):
        path = os.path.join(run.workdir, name)
        assert os.path.getsize(path) > 1000
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not os.path.exists(os.path.join(run.workdir, evaluate.CALIBRATION_PLOT))
    # The same names and values as the training loop's last record (same final state).
    last = {k: v for k, v in run.trained.history[-1].items() if k.startswith("test_")}
    assert set(last) == {k for k in r if k.startswith("test_")} - {"test_per_class"}
    _assert_same(last, r)
    text = "\n".join(run.lines)
    assert "OOD set" in text and "inverted" in text and "ensemble" in text


@pytest.mark.slow  # among the heaviest default tests, measured
def test_matches_numpy_and_sklearn(run) -> None:
    ens, state = run.trained.ensemble, run.trained.state
    ds = data.load_npz(run.npz)
    mp = np.asarray(ens.predict_members(state, ds.test_images))  # [4, N, 10] on the host
    host = metrics.prefix_metrics(metrics.ensemble_metrics(mp, ds.test_labels, num_bins=15))
    _assert_same(host, run.report)
    assert set(host) == {k for k in run.report if k.startswith("test_")} - {"test_per_class"}

    noise = ood_lib.ood_images("noise", ds.test_images)
    assert noise.shape == ds.test_images.shape and noise.dtype == np.uint8
    mp_noise = np.asarray(ens.predict_members(state, noise))
    s_in, s_out = _entropy(mp.mean(0)), _entropy(mp_noise.mean(0))
    y = np.r_[np.zeros(NUM_TEST), np.ones(NUM_TEST)]
    s = np.r_[s_in, s_out]
    # float32 on device vs float64 here: allow a near-tie or two to swap ranks.
    assert run.report["ood_noise_auroc_entropy"] == pytest.approx(roc_auc_score(y, s), abs=1e-3)
    assert run.report["ood_noise_aupr_entropy"] == pytest.approx(
        average_precision_score(y, s), abs=1e-3
    )
    # Each member as a single model: its own entropy and max-probability scores.
    for kind, score in (("entropy", _entropy), ("max_prob", lambda p: 1 - p.max(-1))):
        want = [roc_auc_score(y, np.r_[score(mp[i]), score(mp_noise[i])]) for i in range(4)]
        got = run.report[f"ood_noise_member_auroc_{kind}"]
        np.testing.assert_allclose(got, want, atol=1e-3)
        assert run.report[f"ood_noise_mean_member_auroc_{kind}"] == pytest.approx(np.mean(got))

    # The logit scores: each member's logits (softmax = its probabilities), then each
    # member's max logit / free energy averaged over members; each member alone too.
    z, z_noise = (
        np.asarray(ens.predict_members(state, v, logits=True)) for v in (ds.test_images, noise)
    )
    assert z.shape == mp.shape and z.dtype == np.float32
    np.testing.assert_allclose(np.exp(z - logsumexp(z, -1, keepdims=True)), mp, atol=1e-6)
    halved = ens.predict_members(state, ds.test_images, temperature=2.0, logits=True)
    np.testing.assert_allclose(np.asarray(halved), z / 2, rtol=1e-6)
    logit_scores = {"max_logit": lambda v: -v.max(-1), "energy": lambda v: -logsumexp(v, -1)}
    for kind, score in logit_scores.items():
        s = np.r_[score(z).mean(0), score(z_noise).mean(0)]
        assert run.report[f"ood_noise_auroc_{kind}"] == pytest.approx(roc_auc_score(y, s), abs=1e-3)
        want = [roc_auc_score(y, np.r_[score(z[i]), score(z_noise[i])]) for i in range(4)]
        np.testing.assert_allclose(run.report[f"ood_noise_member_auroc_{kind}"], want, atol=1e-3)
    assert "max_logit" in "\n".join(run.lines) and "energy" in "\n".join(run.lines)

    # Reliability-diagram data streamed on the mesh = the host computation.
    out = ood_lib.stream_scores(ens, state, ds.test_images, ds.test_labels, BATCH, 15)
    np.testing.assert_allclose(out["scores"]["entropy"], s_in, atol=1e-5)
    ref = metrics.reliability_diagram_data(mp.mean(0), ds.test_labels, num_bins=15)
    for key in ("accuracy", "confidence", "count", "bin_edges"):
        np.testing.assert_allclose(out["ensemble"][key], ref[key], atol=1e-5, err_msg=key)
    pooled = metrics.calibration_bins(mp.reshape(-1, 10), np.tile(ds.test_labels, 4), 15)
    np.testing.assert_allclose(out["mean_member"]["count"], pooled["count"])


def test_cli_on_another_mesh(run, capsys) -> None:
    workdir = _copy(run, "cli")
    argv = ["evaluate", "--workdir", workdir, "--mesh", "ensemble=2,data=4"]
    assert cli.main([*argv, "--batch-size", str(BATCH)]) == 0
    out = capsys.readouterr().out
    assert "mesh ensemble=2 x data=4" in out and "OOD set" in out
    with open(os.path.join(workdir, evaluate.EVALUATION_FILE)) as f:
        _assert_same(json.load(f), run.report)


def test_one_device_with_fashion_npz(run) -> None:
    fashion = data.save_npz(data.synthetic(16, 50, seed=3), run.root / "fashion.npz")
    r = evaluate.evaluate_run(
        _copy(run, "one"),
        checkpoint=4,
        ood=["noise", "inverted", "fashion_mnist", "noise"],
        mesh={"ensemble": 1, "data": 1},
        batch_size=BATCH,
        ood_file=fashion,
        echo=lambda s: None,
    )
    assert r["ood_sets"] == ["noise", "inverted", "fashion_mnist"]
    assert {f"ood_fashion_mnist_auroc_{k}" for k in metrics.OOD_KINDS} <= set(r)
    _assert_same(r, run.report)


def _one_line_error(capsys, argv: list[str], *expect: str) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for text in expect:
        assert text in err, err
    return err


@pytest.mark.slow  # among the heaviest default tests, measured
def test_errors_are_one_line(run, tmp_path, capsys) -> None:
    missing = os.fspath(tmp_path / "missing")
    _one_line_error(capsys, ["evaluate", "--workdir", missing], missing, "no such run folder")
    assert not os.path.exists(missing)

    no_ckpt = tmp_path / "no_ckpt"
    no_ckpt.mkdir()
    shutil.copy(os.path.join(run.workdir, "config.json"), no_ckpt)
    _one_line_error(capsys, ["evaluate", "--workdir", os.fspath(no_ckpt)], "no checkpoint")
    assert not (no_ckpt / "checkpoints").exists()

    argv = ["evaluate", "--workdir", run.workdir]
    _one_line_error(capsys, [*argv, "--checkpoint", "999"], "999", "available steps: 4")
    _one_line_error(capsys, [*argv, "--checkpoint", "last"], "--checkpoint", "'last'")
    _one_line_error(capsys, [*argv, "--ood", "cifar10"], "--ood", "cifar10", "noise")
    _one_line_error(capsys, [*argv, "--mesh", "ensemble=3"], "members")

    for name, text in (("bad_json", "{not json"), ("bad_value", '{"members": -1}')):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(text)
        path = os.fspath(folder / "config.json")
        _one_line_error(capsys, ["evaluate", "--workdir", os.fspath(folder)], path, "corrupt")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(capsys, ["evaluate", "--workdir", os.fspath(empty)], "config.json")


def test_fashion_mnist_unavailable_offline(run, tmp_path, capsys) -> None:
    workdir = _copy(run, "fashion")
    path = os.path.join(workdir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["data_dir"] = os.fspath(tmp_path)  # an empty TFDS folder: nothing prepared
    with open(path, "w") as f:
        json.dump(cfg, f)
    argv = ["evaluate", "--workdir", workdir, "--ood", "fashion_mnist"]
    _one_line_error(capsys, argv, "fashion_mnist", "--ood-file")


@contextlib.contextmanager
def read_only(path: str):
    """The folder ``path`` read-only: by its mode, or as root by a read-only bind mount."""
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        try:
            yield
        finally:
            os.chmod(path, 0o755)
        return
    mount = shutil.which("mount")
    if not (mount and subprocess.run([mount, "--bind", path, path]).returncode == 0):
        pytest.skip("cannot make a read-only folder here (root without mount)")
    try:
        if subprocess.run([mount, "-o", "remount,ro,bind", path]).returncode != 0:
            pytest.skip("cannot remount read-only here")
        yield
    finally:
        subprocess.run(["umount", path], check=False)


def test_unwritable_workdir_is_refused_before_any_work(run, capsys) -> None:
    workdir = _copy(run, "ro")
    before = sorted(os.listdir(workdir))
    with read_only(workdir):
        err = _one_line_error(capsys, ["evaluate", "--workdir", workdir], workdir)
        assert err.startswith(f"error: workdir {workdir} is not writable (")
        assert "copy the run to a writable folder" in err and "Traceback" not in err
        assert sorted(os.listdir(workdir)) == before


def test_a_failed_write_is_one_line(run, capsys) -> None:
    for name in (evaluate.EVALUATION_FILE, ood_lib.OOD_PLOT):
        workdir = _copy(run, f"blocked_{name}")
        os.remove(os.path.join(workdir, name))
        os.mkdir(os.path.join(workdir, name))  # a folder where the file goes
        argv = ["evaluate", "--workdir", workdir, "--batch-size", str(BATCH)]
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        path = os.path.join(workdir, name)
        assert err.startswith(f"error: could not write {path}: Is a directory; "), err
        assert err.count("\n") == 1 and "Traceback" not in err


# ------------------------------------------------------------------ the run's own data, read-only
SYN = data.synthetic(160, 40, seed=1)
"""Data passed from Python (``train(cfg, dataset=SYN)``): evaluate cannot reload it."""


@pytest.fixture(scope="module")
def pyrun(tmp_path_factory):
    """4 MLP members trained from a Python dataset with a validation split: checkpoints 2, 4."""
    need_devices(8)
    workdir = os.fspath(tmp_path_factory.mktemp("pyrun") / "run")
    cfg = TrainConfig(
        model="mlp", members=4, mesh="ensemble=4,data=2", epochs=1, batch_size=32,
        validation=32, checkpoint_every=2, keep=5, workdir=workdir, quiet=True,
        eval_batch_size=40,
    )  # fmt: skip
    train(cfg, dataset=SYN)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == [
        "2", "4", "checksums.copy.json", "checksums.json"
    ]  # fmt: skip
    return workdir


def _tree(folder: str) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes (a run's state, to see it unchanged)."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out


def _pycopy(pyrun, tmp_path, name: str) -> str:
    dest = os.fspath(tmp_path / name)
    shutil.copytree(pyrun, dest)
    return dest


def _flip(workdir: str, step: int) -> None:
    """Flips one bit in the biggest file of checkpoint ``step`` (orbax reads it silently)."""
    folder = os.path.join(workdir, "checkpoints", str(step))
    files = [os.path.join(r, n) for r, _, ns in os.walk(folder) for n in ns]
    victim = max(files, key=os.path.getsize)
    with open(victim, "rb") as f:
        raw = bytearray(f.read())
    raw[len(raw) // 2] ^= 1
    with open(victim, "wb") as f:
        f.write(raw)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_python_dataset_run_is_refused_without_its_data_then_checked(pyrun, tmp_path, capsys):
    before = _tree(pyrun)
    err = _one_line_error(
        capsys, ["evaluate", "--workdir", pyrun], "trained on data passed from Python", "dataset="
    )
    assert "synthetic" in err and _tree(pyrun) == before  # refused before any work
    test = (SYN.test_images[::-1], SYN.test_labels[::-1])
    other = data.Dataset("mnist", SYN.train_images, SYN.train_labels, *test,
                         source="synthetic", note="reversed test")  # fmt: skip
    with pytest.raises(data.DataError, match=r"^the test split of this data \(reversed test\)"):
        evaluate.evaluate_run(pyrun, dataset=other, ood=[], echo=lambda s: None)
    assert _tree(pyrun) == before
    workdir = _pycopy(pyrun, tmp_path, "given")
    r = evaluate.evaluate_run(workdir, dataset=SYN, ood=[], echo=lambda s: None)
    assert r["checkpoint_step"] == 4 and r["num_test"] == 40


def test_calibrate_on_a_file_with_every_odd_image_inverted_is_refused(pyrun, tmp_path, capsys):
    images = SYN.train_images.copy()
    images[1::2] = 255 - images[1::2]  # same labels, other images
    odd = data.Dataset("mnist", images, SYN.train_labels, SYN.test_images, SYN.test_labels,
                       source="synthetic", note="odd inverted")  # fmt: skip
    npz = data.save_npz(odd, tmp_path / "odd.npz")
    before = _tree(pyrun)
    argv = ["evaluate", "--workdir", pyrun, "--calibrate", "--source", "npz", "--data-file", npz]
    _one_line_error(capsys, argv, "the train and validation splits of this data", "differ from run")
    assert _tree(pyrun) == before  # no evaluation.json, nothing rewritten


def test_the_run_s_own_data_changed_since_training_is_named_so(run, tmp_path, capsys):
    """No data flags: the recorded file itself differs; the fix is not 'drop the flags'."""
    workdir = _copy(run, "changed")
    ds = data.load_npz(run.npz)
    changed = data.Dataset("mnist", ds.train_images, ds.train_labels,
                           255 - ds.test_images, ds.test_labels, "npz", "changed")  # fmt: skip
    npz = data.save_npz(changed, tmp_path / "changed.npz")
    path = pathlib.Path(workdir, "config.json")
    saved = json.loads(path.read_text())
    saved["resolved"]["data_identity"]["data_file"] = npz  # as if run.npz were rewritten
    path.write_text(json.dumps(saved))
    err = _one_line_error(capsys, ["evaluate", "--workdir", workdir], "has changed since")
    assert "drop --source" not in err
    argv = ["evaluate", "--workdir", run.workdir, "--data-file", npz]
    assert "drop --source/--data-file/--data-dir" in _one_line_error(capsys, argv, "differ")


def test_a_damaged_newest_checkpoint_is_skipped_in_place_and_named(pyrun, tmp_path, capsys):
    workdir = _pycopy(pyrun, tmp_path, "damaged")
    _flip(workdir, 4)
    checkpoints = _tree(os.path.join(workdir, "checkpoints"))
    lines: list[str] = []
    r = evaluate.evaluate_run(workdir, dataset=SYN, ood=[], echo=lines.append)
    assert r["checkpoint_step"] == 2
    said = "evaluating checkpoint 2, not the newest (4): checkpoint 4 is damaged (checksum "
    assert any(line.startswith(said) and "left it in place" in line for line in lines), lines
    # read-only: nothing moved, deleted or rewritten in checkpoints/
    assert _tree(os.path.join(workdir, "checkpoints")) == checkpoints
    assert not os.path.exists(os.path.join(workdir, "checkpoints_damaged"))
    with pytest.raises(ckpt_lib.CheckpointError, match=r"^checkpoint 4 in .* is damaged"):
        evaluate.evaluate_run(workdir, checkpoint=4, dataset=SYN, ood=[], echo=lambda s: None)
    assert _tree(os.path.join(workdir, "checkpoints")) == checkpoints


def test_a_checkpoint_deleted_mid_read_is_told_apart_and_the_previous_used(
    pyrun, tmp_path, monkeypatch
):
    workdir = _pycopy(pyrun, tmp_path, "vanish")
    digest = ckpt_lib.checkpoint_digest

    def deleted_while_read(path):  # a training job's --keep clean-up, mid-read
        if os.path.basename(path) == "4":
            shutil.rmtree(path)
        return digest(path)

    monkeypatch.setattr(ckpt_lib, "checkpoint_digest", deleted_while_read)
    lines: list[str] = []
    r = evaluate.evaluate_run(workdir, dataset=SYN, ood=[], echo=lines.append)
    assert r["checkpoint_step"] == 2
    text = " ".join(lines)
    assert "checkpoint 4 was deleted while being read" in text and "damaged" not in text, lines


def test_after_a_clean_up_mid_read_the_newest_remaining_checkpoint_is_used(
    pyrun, tmp_path, monkeypatch
):
    """Training with --keep saved 6 and removed 4 while 4 was read: 6 is used, not 2."""
    workdir = _pycopy(pyrun, tmp_path, "relist")
    folder = os.path.join(workdir, "checkpoints")
    digest = ckpt_lib.checkpoint_digest

    def saved_and_cleaned(path):
        if os.path.basename(path) == "4" and not os.path.exists(os.path.join(folder, "6")):
            shutil.copytree(path, os.path.join(folder, "6"))  # "checkpoint 6", 4's bytes
            sums = ckpt_lib.read_checksums(folder)
            ckpt_lib.write_checksums(folder, sums | {"6": sums["4"]})
            shutil.rmtree(path)
        return digest(path)

    monkeypatch.setattr(ckpt_lib, "checkpoint_digest", saved_and_cleaned)
    lines: list[str] = []
    r = evaluate.evaluate_run(workdir, dataset=SYN, ood=[], echo=lines.append)
    assert r["checkpoint_step"] == 6, lines
    said = "evaluating checkpoint 6, saved meanwhile: checkpoint 4 was deleted while being read"
    assert any(line.startswith(said) for line in lines), lines


def test_a_run_with_the_old_identity_format_still_evaluates_and_says_so(pyrun, tmp_path):
    from meshensemble.training import identity

    workdir = _pycopy(pyrun, tmp_path, "old")
    path = os.path.join(workdir, "config.json")
    with open(path) as f:
        saved = json.load(f)
    saved["resolved"]["data_identity"] = {
        "source": "synthetic", "num_train": 160, "num_test": 40, "data_file": None,
        "fingerprint": identity.sampled_fingerprint(SYN),
    }  # fmt: skip
    with open(path, "w") as f:
        json.dump(saved, f)
    lines: list[str] = []
    r = evaluate.evaluate_run(workdir, dataset=SYN, ood=[], echo=lines.append)
    assert r["checkpoint_step"] == 4
    assert any("records its data in the old format" in line for line in lines), lines
    other = data.synthetic(160, 40, seed=9)
    with pytest.raises(data.DataError, match="sampled fingerprint"):
        evaluate.evaluate_run(workdir, dataset=other, ood=[], echo=lambda s: None)
