"""Any data from the CLI (issue 39): each source trains, evaluates with --calibrate,
predicts and exports; a bad source is one line, exit 2, nothing written.

The data is real where it can be (scikit-learn's load_digits, load_wine,
load_breast_cancer), a 32x32x3 image folder this test writes, and TFDS cifar10 mock data.
The default suite runs one whole cycle (load_wine as CSV, a tiny MLP, one epoch) and the
refusals; every other source's cycle, on the default mesh and on a (4, 2) mesh of fake
devices, is marked slow (25-50 s each on 2 cores).
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import numpy as np
import pytest

import meshensemble as me
from meshensemble import cli

sklearn_datasets = pytest.importorskip("sklearn.datasets")

TINY = ["--model", "mlp", "--members", "2", "--epochs", "1", "--batch-size", "16",
        "--no-compile-cache", "--quiet"]  # fmt: skip
"""A tiny run: the cycle, not the accuracy, is under test."""
MESH_4x2 = ["--members", "4", "--mesh", "ensemble=4,data=2"]


def _digits_npz(path: pathlib.Path) -> list[str]:
    x, y = sklearn_datasets.load_digits(return_X_y=True)  # 1,797 real 8x8 digits
    images = (x.reshape(-1, 8, 8, 1) * 255 / 16).round().astype(np.uint8)
    np.savez(path, x_train=images[:1500], y_train=y[:1500], x_test=images[1500:],
             y_test=y[1500:])  # fmt: skip
    return ["--source", "npz", "--data-file", str(path)]


def _table_csv(path: pathlib.Path, loader: str) -> list[str]:
    frame = getattr(sklearn_datasets, loader)(as_frame=True).frame
    frame.to_csv(path, index=False)
    return ["--source", "csv", "--data-file", str(path), "--target-column", "target",
            "--test-fraction", "0.25"]  # fmt: skip


def _folder(root: pathlib.Path, classes: int = 10, n: int = 3, odd: bool = False) -> list[str]:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", n + 3), ("test", n)):
        for c in range(classes):
            (root / split / f"c{c}").mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                pixels[..., c % 3] //= 4  # a little signal per class
                Image.fromarray(pixels, "RGB").save(root / split / f"c{c}" / f"{i}.png")
    if odd:
        Image.new("RGB", (30, 32)).save(root / "train" / "c1" / "odd.png")
    return ["--source", "folder", "--data-dir", str(root)]


def _cycle(tmp_path: pathlib.Path, data: list[str], x: np.ndarray, extra=(), validation="20",
           calibrate=True):
    """train, evaluate --calibrate, predict and export one run; returns what they wrote."""
    w = str(tmp_path / "run")
    assert cli.main(["train", *data, *TINY, *extra, "--validation", validation,
                     "--workdir", w]) == 0  # fmt: skip
    mesh = [a for a in extra if a.startswith("ensemble=")]
    at = ["--mesh", mesh[0]] if mesh else []
    cal = ["--calibrate"] if calibrate else []
    assert cli.main(["evaluate", "--workdir", w, *cal, *at]) == 0
    result = json.loads(pathlib.Path(w, "evaluation.json").read_text())
    np.save(tmp_path / "x.npy", x)
    assert cli.main(["predict", "--workdir", w, "--input", str(tmp_path / "x.npy"), "--out",
                     str(tmp_path / "p.npz"), "--quiet", *at]) == 0  # fmt: skip
    probs = np.load(tmp_path / "p.npz")["probs"]
    out = str(tmp_path / "exported")
    assert cli.main(["export", "--workdir", w, "--out", out, "--platforms", "cpu"]) == 0
    meta = json.loads(pathlib.Path(out, "export.json").read_text())
    exp = jax.export.deserialize(bytearray(pathlib.Path(out, "ensemble.jax").read_bytes()))
    raw = np.asarray(exp.call(x)["probs"])  # the artifact takes the raw inputs
    config = json.loads(pathlib.Path(w, "config.json").read_text())["resolved"]
    return result, probs, raw, meta, config


def _check(result, probs, raw, meta, classes: int, n: int, calibrated=True) -> None:
    assert probs.shape == (n, classes) and np.allclose(probs.sum(-1), 1, atol=1e-5)
    assert meta["classes"] == classes
    if calibrated:
        assert meta["temperature"] is not None  # calibrated, and the artifact applies it
        assert result["calibration"]["temperature"] == meta["temperature"]
    assert len(result["test_per_class"]["accuracy"]) == classes  # per class, as for MNIST
    assert any("member" in k for k in result) and any("ensemble" in k for k in result)
    np.testing.assert_allclose(raw, probs, rtol=1e-5, atol=1e-6)  # artifact == predict


@pytest.mark.slow
def test_load_digits_npz_cycle(tmp_path):
    data = _digits_npz(tmp_path / "digits.npz")
    x = np.load(tmp_path / "digits.npz")["x_test"][:5]
    result, probs, raw, meta, config = _cycle(tmp_path, data, x)
    _check(result, probs, raw, meta, 10, 5)
    assert meta["input"]["shape"] == ["batch", 8, 8, 1] and meta["input"]["dtype"] == "uint8"
    assert config["input"]["normalization"] is None  # one channel: MNIST's [0, 1] scaling


@pytest.mark.parametrize(
    "loader, classes",
    [("load_wine", 3), pytest.param("load_breast_cancer", 2, marks=pytest.mark.slow)],
)  # load_wine's cycle is the default suite's one full cycle; the others are slow
def test_real_tables_through_csv_cycle(tmp_path, loader, classes):
    data = _table_csv(tmp_path / "t.csv", loader)
    frame = getattr(sklearn_datasets, loader)(as_frame=True).frame
    x = frame.drop(columns="target").to_numpy(np.float32)[:7]
    result, probs, raw, meta, config = _cycle(tmp_path, data, x, validation="80")
    _check(result, probs, raw, meta, classes, 7)
    norm = config["input"]["normalization"]  # standardised features, from the train split
    assert len(norm["mean"]) == x.shape[1] and min(norm["std"]) > 0
    held = config["data_identity"]
    assert held["source"] == "csv" and held["data_file"] == str(tmp_path / "t.csv")


@pytest.mark.slow
def test_colour_image_folder_cycle_artifact_takes_raw_uint8(tmp_path):
    data = _folder(tmp_path / "photos")
    x = np.random.default_rng(1).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    result, probs, raw, meta, config = _cycle(
        tmp_path, data, x, extra=["--augment", "crop_flip"], validation="10"
    )
    _check(result, probs, raw, meta, 10, 4)
    assert meta["input"]["shape"] == ["batch", 32, 32, 3] and meta["input"]["dtype"] == "uint8"
    norm = config["input"]["normalization"]  # per channel, recorded in the run
    assert len(norm["mean"]) == 3 and meta["preprocessing"]["input"]["normalization"] == norm
    assert config["data_identity"]["data_dir"] == str(tmp_path / "photos")


@pytest.mark.slow
def test_tfds_cifar10_mock_cycle(tmp_path, mock_tfds):
    """Mock data whose images carry their labels (``signal=True``), so ``--calibrate`` has a
    model better than chance to calibrate."""
    data = ["--source", "tfds", "--dataset", "cifar10", "--data-dir", str(tmp_path / "tfds")]
    x = np.random.default_rng(2).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    with mock_tfds(num_examples=48, signal=True):
        ds = me.data.load_dataset("cifar10", source="tfds", data_dir=tmp_path / "tfds")
        result, probs, raw, meta, config = _cycle(tmp_path, data, x)
    _check(result, probs, raw, meta, 10, 3)
    assert ds.input_shape == (32, 32, 3) and len(set(ds.y_train.tolist())) > 2
    assert len(config["input"]["normalization"]["mean"]) == 3


@pytest.mark.slow
@pytest.mark.parametrize("source", ["npz", "wine", "cancer", "folder", "tfds"])
def test_every_source_cycles_on_a_4x2_mesh(tmp_path, source, mock_tfds):
    import contextlib

    x = np.random.default_rng(3).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    context, classes, validation = contextlib.nullcontext(), 10, "20"
    if source == "npz":
        data = _digits_npz(tmp_path / "digits.npz")
        x = np.load(tmp_path / "digits.npz")["x_test"][:4]
    elif source in ("wine", "cancer"):
        loader = {"wine": "load_wine", "cancer": "load_breast_cancer"}[source]
        data, classes, validation = _table_csv(tmp_path / "t.csv", loader), 3, "80"
        frame = getattr(sklearn_datasets, loader)(as_frame=True).frame
        x = frame.drop(columns="target").to_numpy(np.float32)[:4]
        classes = 3 if source == "wine" else 2
    elif source == "folder":
        data = _folder(tmp_path / "photos")
    else:
        data = ["--source", "tfds", "--dataset", "cifar10", "--data-dir", str(tmp_path / "t")]
        context = mock_tfds(num_examples=48, signal=True)
    with context:
        out = _cycle(tmp_path, data, x, extra=[*MESH_4x2], validation=validation)
    _check(*out[:4], classes, 4)


def _tree(root: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _refused(tmp_path, capsys, data: list[str], *parts: str) -> None:
    before = _tree(tmp_path)
    w = tmp_path / "run"
    assert cli.main(["train", *data, *TINY, "--workdir", str(w)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for part in parts:
        assert part in err, (part, err)
    assert not w.exists() and _tree(tmp_path) == before  # nothing written


def test_bad_sources_are_one_line_exit_2_and_write_nothing(tmp_path, capsys):
    x = np.zeros((6, 8, 8, 1), np.uint8)
    np.savez(tmp_path / "bad.npz", x_train=x, y_train=np.arange(6) % 2,
             x_test=np.zeros((3, 8, 7, 1), np.uint8), y_test=np.arange(3) % 2)  # fmt: skip
    _refused(tmp_path, capsys, ["--source", "npz", "--data-file", str(tmp_path / "bad.npz")],
             "x_test", "8, 7, 1")  # fmt: skip
    _folder(tmp_path / "mixed", classes=2, n=1, odd=True)
    _refused(tmp_path, capsys, ["--source", "folder", "--data-dir", str(tmp_path / "mixed")],
             "odd.png", "one size")  # fmt: skip
    root = tmp_path / "mixed"
    (root / "train" / "c1" / "odd.png").unlink()
    (root / "test" / "zebra").mkdir()
    (root / "test" / "c0" / "0.png").rename(root / "test" / "zebra" / "0.png")
    _refused(tmp_path, capsys, ["--source", "folder", "--data-dir", str(root)], "'zebra'")
    table = tmp_path / "t.csv"
    table.write_text("a,b,label\n1,2,0\n3,4,1\n5,6,0\n7,8,1\n")
    _refused(tmp_path, capsys, ["--source", "csv", "--data-file", str(table), "--target-column",
                                "target", "--test-fraction", "0.5"], "'target'")  # fmt: skip


@pytest.mark.slow  # among the heaviest default tests, measured
def test_ood_by_path_and_shift_for_a_non_mnist_run(tmp_path):
    """``evaluate --ood PATH`` takes an npz of the run's input shape; shifts take any input."""
    data = _digits_npz(tmp_path / "digits.npz")
    w = str(tmp_path / "run")
    assert cli.main(["train", *data, *TINY, "--workdir", w]) == 0
    x = np.random.default_rng(4).integers(0, 256, (40, 8, 8, 1), dtype=np.uint8)
    np.savez(tmp_path / "other.npz", x_train=x[:20], y_train=np.arange(20) % 2, x_test=x[20:],
             y_test=np.arange(20) % 2)  # fmt: skip
    other = str(tmp_path / "other.npz")
    assert cli.main(["evaluate", "--workdir", w, "--ood", other, "--ood", "hflip"]) == 0
    result = json.loads(pathlib.Path(w, "evaluation.json").read_text())
    assert result["ood_sets"] == [other, "hflip"]
    assert 0 <= result[f"ood_{other}_auroc_max_prob"] <= 1
    assert 0 <= result["ood_hflip_auroc_max_prob"] <= 1
    os.remove(os.path.join(w, "evaluation.json"))
    bad = np.zeros((4, 9, 9, 1), np.uint8)
    np.savez(tmp_path / "bad.npz", x_train=bad, y_train=np.arange(4) % 2, x_test=bad,
             y_test=np.arange(4) % 2)  # fmt: skip
    assert cli.main(["evaluate", "--workdir", w, "--ood", str(tmp_path / "bad.npz")]) == 2
    assert not os.path.exists(os.path.join(w, "evaluation.json"))


def test_convert_any_source_to_arrayrecord_and_train_from_it(tmp_path):
    """``convert`` writes the generic codec's records from an npz of 8x8x1 digits; a run on
    them reads the same examples as one on the npz."""
    data = _digits_npz(tmp_path / "digits.npz")
    out = tmp_path / "ar"
    assert cli.main(["convert", *data, "--out", str(out)]) == 0
    ds = me.data.load_dataset(source="arrayrecord", data_dir=out)
    direct = me.data.load_dataset(source="npz", data_file=tmp_path / "digits.npz")
    assert ds.input_shape == (8, 8, 1) and ds.num_classes == 10
    assert np.array_equal(ds.x_test, direct.x_test) and np.array_equal(ds.y_test, direct.y_test)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_old_mnist_run_folders_still_evaluate_and_predict(tmp_path):
    """A run folder written before issue 39 (``resolved.input`` with feature ``stats``, or no
    ``input`` record at all; no csv/folder fields in the config) evaluates and predicts as
    one written today."""
    w = tmp_path / "run"
    assert cli.main(["train", "--source", "sample", "--model", "mlp", "--members", "2",
                     "--max-steps", "3", "--batch-size", "32", "--no-compile-cache", "--quiet",
                     "--workdir", str(w)]) == 0  # fmt: skip
    x = me.data.load_dataset(source="sample").x_test[:6]
    np.save(tmp_path / "x.npy", x)

    def evaluate_and_predict() -> tuple[float, np.ndarray]:
        (w / "evaluation.json").unlink(missing_ok=True)
        assert cli.main(["evaluate", "--workdir", str(w)]) == 0
        result = json.loads((w / "evaluation.json").read_text())
        assert cli.main(["predict", "--workdir", str(w), "--input", str(tmp_path / "x.npy"),
                         "--out", str(tmp_path / "p.npz"), "--quiet"]) == 0  # fmt: skip
        return result["test_ensemble_nll"], np.load(tmp_path / "p.npz")["probs"]

    nll, probs = evaluate_and_predict()
    config = json.loads((w / "config.json").read_text())
    assert config["resolved"]["input"]["normalization"] is None  # MNIST: [0, 1] scaling
    for key in ("test_file", "test_fraction", "target_column", "targets"):
        del config[key]  # the config fields issue 39 added
    for old_input in ({"shape": [28, 28, 1], "dtype": "uint8", "stats": None}, None):
        if old_input is None:
            del config["resolved"]["input"]  # before the input record (MNIST only)
        else:
            config["resolved"]["input"] = old_input  # the layout of a6fa4c2
        (w / "config.json").write_text(json.dumps(config))
        old_nll, old_probs = evaluate_and_predict()
        assert old_nll == nll
        np.testing.assert_array_equal(old_probs, probs)
