"""TFDS: the prepared ArrayRecord data of MNIST / Fashion-MNIST, read without TensorFlow.

:func:`load_tfds` reads (and, when asked, downloads and prepares) a dataset through
``tfds.data_source``. ``tensorflow_datasets`` is imported only when a loader runs.
:func:`network_reachable` is the bounded probe that keeps an offline machine from hanging
on a download; :func:`missing_prepare_modules` tells whether preparing data is possible.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import socket
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from meshensemble.data import manifest
from meshensemble.data.dataset import (
    DATASETS,
    FULL_SIZES,
    IMAGE_SHAPE,
    PRETTY_NAMES,
    DataError,
    Dataset,
    check_name,
    first_line,
    split_counts,
    validate,
)
from meshensemble.data.npz import npz_fix
from meshensemble.runtime import storage

TFDS_HOST = "storage.googleapis.com"
"""The host TFDS downloads MNIST / Fashion-MNIST from; :func:`network_reachable` probes it."""
TFDS_CHUNK = 4096
"""Examples decoded per batched read of a TFDS data source."""
PREPARE_MODULES = ("tensorflow", "importlib_resources")
"""Python modules that TFDS needs to download and prepare the data, beyond
tensorflow-datasets itself; the pyproject extra ``tfds-prepare`` installs them."""
PREPARE_FIX = 'pip install "meshensemble[tfds-prepare]"'
"""The install command named in errors when :data:`PREPARE_MODULES` are missing."""


class NotPreparedError(DataError):
    """TFDS has no prepared data for the dataset in the data directory.

    Raised by :func:`load_tfds` with ``download=False``; ``source="auto"`` catches it and
    tries a download or the embedded sample next.

    Args:
      message: the full one-line message.
      reason: a short description of the problem.

    Example:
      >>> raise NotPreparedError("TFDS has no prepared mnist in /tmp/tfds")
      Traceback (most recent call last):
      ...
      meshensemble.data.tfds.NotPreparedError: TFDS has no prepared mnist in /tmp/tfds
    """


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
    check_name(name)
    tfds = _import_tfds(name)
    where = _tfds_where(name, data_dir)
    splits = open_or_download(tfds, name, data_dir, download)
    train = _tfds_read(splits[0], name, f"{where} [train]")
    test = _tfds_read(splits[1], name, f"{where} [test]")
    info = getattr(splits[0], "dataset_info", None)
    origin = os.fspath(getattr(info, "data_dir", "") or _tfds_dir_label(data_dir))
    full = "full " if (len(train[1]), len(test[1])) == FULL_SIZES else ""
    note = f"{full}{PRETTY_NAMES[name]} from TFDS in {origin} ({split_counts(train[1], test[1])})"
    return Dataset(name, *train, *test, source="tfds", note=note)


def load_tfds_dataset(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    *,
    download: bool = False,
    image_key: str | None = None,
    label_key: str | None = None,
    splits: Sequence[str] | None = None,
) -> Dataset:
    """Loads any TFDS dataset with an image and a label feature (``cifar10``, ``svhn_cropped``...).

    Reads ``tfds.data_source`` (no TensorFlow) like :func:`load_tfds`. The image and label
    features, the number of classes and their names come from the dataset's info; the
    splits are ``train`` and ``test`` (``validation`` when there is no ``test``) unless
    ``splits`` names them. MNIST and Fashion-MNIST (with no keys or splits given) are read
    by :func:`load_tfds`, exactly as before.

    Args:
      name: a TFDS name, e.g. ``"cifar10"``.
      data_dir: TFDS's data directory (default ``$TFDS_DATA_DIR`` or
        ``~/tensorflow_datasets``).
      download: download and prepare the data if it is not prepared (see :func:`load_tfds`).
      image_key: the image feature (default: the only ``tfds.features.Image`` one).
      label_key: the label feature (default: the only ``tfds.features.ClassLabel`` one).
      splits: ``(train split, test split)``, e.g. ``("train", "validation")``.

    Returns:
      A :class:`Dataset` with ``source="tfds"``: uint8 images ``[N, H, W, C]``, int32
      class ids, ``num_classes`` and ``class_names`` from the label feature.

    Raises:
      DataError: (one line) TFDS problems as :func:`load_tfds` says, no (or several)
        image or label features (naming those the dataset has), or images of more than
        one size (naming the first example of another size).

    Example:
      >>> ds = load_tfds_dataset("cifar10", download=True)  # doctest: +SKIP
      >>> ds.input_shape, ds.class_names[:2]  # doctest: +SKIP
      ((32, 32, 3), ('airplane', 'automobile'))
    """
    if name in DATASETS and image_key is label_key is splits is None:
        return load_tfds(name, data_dir, download)
    tfds = _import_tfds(name)
    where = _tfds_where(name, data_dir)
    splits = tuple(splits) if splits is not None else default_splits(tfds, name, data_dir)
    if len(splits) != 2:
        raise DataError(f"{where}: splits={splits!r}; pass (train split, test split)")
    sources = open_or_download(tfds, name, data_dir, download, splits)
    info = getattr(sources[0], "dataset_info", None)
    spec = image_label_features(tfds, info, image_key, label_key, where)
    arrays = [read_images(src, spec, f"{where} [{split}]") for src, split in zip(sources, splits)]
    origin = os.fspath(getattr(info, "data_dir", "") or _tfds_dir_label(data_dir))
    counts = split_counts(arrays[0][1], arrays[1][1])
    note = f"{name} from TFDS in {origin} ({counts}; splits {splits[0]}/{splits[1]})"
    return Dataset(
        name, *arrays[0], *arrays[1], source="tfds", note=note,
        num_classes=spec["num_classes"], class_names=spec["class_names"],
    )  # fmt: skip


def default_splits(tfds: Any, name: str, data_dir: Any) -> tuple[str, str]:
    """``("train", "test")``, or ``("train", "validation")`` when the info has no test split.

    Args:
      tfds: the ``tensorflow_datasets`` module.
      name: a TFDS name.
      data_dir: TFDS's data directory.

    Returns:
      The two split names (``("train", "test")`` when the info lists no splits, e.g.
      under ``tfds.testing.mock_data``).

    Example:
      >>> import tensorflow_datasets as tfds
      >>> default_splits(tfds, "cifar10", None)  # doctest: +SKIP
      ('train', 'test')
    """
    try:
        with _quiet_absl():
            dir_arg = os.path.expanduser(os.fspath(data_dir)) if data_dir is not None else None
            found = set(tfds.builder(name, data_dir=dir_arg).info.splits.keys())
    except Exception:  # an unknown name fails where the data is opened, with its message
        found = set()
    if found and "test" not in found and "validation" in found:
        return "train", "validation"
    return "train", "test"


def image_label_features(
    tfds: Any, info: Any, image_key: str | None, label_key: str | None, where: str
) -> dict[str, Any]:
    """The image and label features of a TFDS dataset's info, and what they say.

    Args:
      tfds: the ``tensorflow_datasets`` module.
      info: the dataset's ``DatasetInfo``.
      image_key: the image feature's name, or None for the only Image feature.
      label_key: the label feature's name, or None for the only ClassLabel feature.
      where: names the dataset in messages.

    Returns:
      ``{"image_key", "label_key", "shape", "num_classes", "class_names"}`` (``shape``
      may hold None for a size that varies).

    Raises:
      DataError: a missing feature, or not one feature of the kind (naming those found).

    Example:
      >>> spec = image_label_features(tfds, info, None, None, "TFDS cifar10")  # doctest: +SKIP
      >>> spec["shape"], spec["num_classes"]  # doctest: +SKIP
      ((32, 32, 3), 10)
    """
    features = dict(getattr(info, "features", {}) or {})

    def pick(key: str | None, kind: Any, what: str) -> str:
        found = [k for k, f in features.items() if isinstance(f, kind)]
        if key is None and len(found) == 1:
            return found[0]
        if key is not None and isinstance(features.get(key), kind):
            return key
        problem = f"no {what} feature {key!r}" if key else f"{len(found)} {what} features"
        held = ", ".join(f"{k} ({type(f).__name__})" for k, f in features.items()) or "none"
        raise DataError(
            f"{where}: {problem} (its features: {held}); pass the {what} feature's name"
        )

    image = pick(image_key, tfds.features.Image, "image")
    label = pick(label_key, tfds.features.ClassLabel, "label")
    names = tuple(str(n) for n in (features[label].names or ())) or None
    return {
        "image_key": image,
        "label_key": label,
        "shape": tuple(features[image].shape),
        "num_classes": int(features[label].num_classes),
        "class_names": names,
    }


def read_records(source: Any, keys: Sequence[int]) -> list[Any]:
    """``source[k] for k in keys``, in one batched read (``__getitems__``) where it works.

    ``tfds.testing.mock_data``'s sources (TFDS 4.9.x) set ``__getitems__`` as a plain
    attribute that is called without ``self`` and raises TypeError; their examples are
    then read one at a time.

    Args:
      source: a ``tfds.data_source`` (or any indexable source of examples).
      keys: the record indices.

    Returns:
      The examples, one per key, in the order of ``keys``.

    Raises:
      Exception: what the source raises for a key it does not have.

    Example:
      >>> read_records(["a", "b", "c"], [2, 0])
      ['c', 'a']
    """
    keys = [int(k) for k in keys]
    try:
        return list(source.__getitems__(keys))
    except (AttributeError, TypeError):
        return [source[k] for k in keys]


def read_images(source: Any, spec: dict[str, Any], where: str) -> tuple[np.ndarray, np.ndarray]:
    """Reads a TFDS data source's images and labels in batches of :data:`TFDS_CHUNK`.

    Args:
      source: a ``tfds.data_source`` of one split.
      spec: from :func:`image_label_features`.
      where: names the split in messages.

    Returns:
      uint8 images ``[N, H, W, C]`` (grayscale ``[N, H, W]`` gets its channel) and int32
      class ids ``[N]``.

    Raises:
      DataError: a failed read, or an image of another size than the first (naming it).

    Example:
      >>> src = tfds.data_source("cifar10", split="test")  # doctest: +SKIP
      >>> x, y = read_images(src, spec, "cifar10 [test]")  # doctest: +SKIP
    """
    images: list[np.ndarray] = []
    labels: list[int] = []
    try:
        with _quiet_absl():
            for start in range(0, len(source), TFDS_CHUNK):
                batch = read_records(source, range(start, min(start + TFDS_CHUNK, len(source))))
                images += [np.asarray(ex[spec["image_key"]], np.uint8) for ex in batch]
                labels += [int(ex[spec["label_key"]]) for ex in batch]
    except Exception as e:
        raise DataError(
            f"{where}: reading the prepared data failed ({type(e).__name__}: {first_line(e)})"
        ) from e
    if not images:
        raise DataError(f"{where}: no examples; expected a split with examples")
    images = [x[..., None] if x.ndim == 2 else x for x in images]
    odd = next((i for i, x in enumerate(images) if x.shape != images[0].shape), None)
    if odd is not None:
        raise DataError(
            f"{where}: example {odd} is a {images[odd].shape} image, example 0 a "
            f"{images[0].shape}; this source needs images of one size (resize them first)"
        )
    return np.stack(images), np.asarray(labels, np.int32)


def open_or_download(
    tfds: Any,
    name: str,
    data_dir: Any,
    download: bool,
    splits: Sequence[str] = ("train", "test"),
) -> Sequence[Any]:
    """TFDS's data sources of ``splits``; with ``download``, prepared first when they are not.

    Args:
      tfds: the ``tensorflow_datasets`` module.
      name: a TFDS name.
      data_dir: TFDS's data directory (None: its default).
      download: download and prepare unprepared data (after checking the packages and
        the network, so a failure is fast).
      splits: the split names to open.

    Returns:
      One ``tfds.data_source`` per split.

    Raises:
      DataError: as :func:`load_tfds` says (:class:`NotPreparedError` when not prepared
        and ``download`` is false).

    Example:
      >>> import tensorflow_datasets as tfds
      >>> train, test = open_or_download(tfds, "cifar10", None, False)  # doctest: +SKIP
    """
    where = _tfds_where(name, data_dir)
    try:
        return _tfds_open(tfds, name, data_dir, download=False, splits=splits)
    except NotPreparedError as e:
        if not download:
            raise
        missing = missing_prepare_modules()
        if missing:
            raise DataError(
                f"{where}: not prepared, and preparing it needs the missing Python "
                f"package(s) {', '.join(missing)} ({PREPARE_FIX}, or use {npz_fix(name)})",
                reason=f"preparing TFDS {name} needs {', '.join(missing)}",
            ) from e
        if not network_reachable():
            raise DataError(
                f"{where}: not prepared, and the network is unreachable ({TFDS_HOST}:443) "
                f"so it cannot be downloaded (connect, or use {npz_fix(name)})",
                reason="the network is unreachable",
            ) from e
        return _tfds_open(tfds, name, data_dir, download=True, splits=splits)


def open_data_sources(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    splits: Sequence[str] | None = None,
) -> tuple[Any, Sequence[Any]]:
    """TFDS's prepared data sources of a dataset's splits, without reading or downloading.

    Args:
      name: a TFDS name (MNIST's, or any other with an image and a label feature).
      data_dir: TFDS's data directory (default ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``).
      splits: ``(train split, test split)``; default ``("train", "test")`` for MNIST's
        names, else :func:`default_splits`.

    Returns:
      ``(tfds, [train, test])``: the ``tensorflow_datasets`` module and the two
      ``tfds.data_source`` splits (random access, records of the dataset's features).

    Raises:
      DataError: TFDS is missing, the data is not prepared (ArrayRecord format), or TFDS
        fails (:class:`NotPreparedError` when not prepared).

    Example:
      >>> tfds, (train, test) = open_data_sources("mnist")  # doctest: +SKIP
    """
    tfds = _import_tfds(name)
    if splits is None:
        splits = ("train", "test") if name in DATASETS else default_splits(tfds, name, data_dir)
    return tfds, _tfds_open(tfds, name, data_dir, download=False, splits=tuple(splits))


def _import_tfds(name: str) -> Any:
    """Imports ``tensorflow_datasets`` or raises a DataError naming the fix."""
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise DataError(
            f"tensorflow_datasets cannot be imported ({type(e).__name__}: {first_line(e)}); "
            f"pip install tensorflow-datasets, or use {npz_fix(name)}",
            reason="tensorflow_datasets is not installed",
        ) from e
    return tfds


def _tfds_open(
    tfds: Any,
    name: str,
    data_dir: Any,
    download: bool,
    splits: Sequence[str] = ("train", "test"),
) -> Sequence[Any]:
    """Returns the ``splits``' TFDS data sources; turns every failure into DataError."""
    where = _tfds_where(name, data_dir)
    dir_arg = os.path.expanduser(os.fspath(data_dir)) if data_dir is not None else None
    quiet = contextlib.nullcontext() if download else _quiet_absl()
    try:
        with quiet:
            return tfds.data_source(
                name,
                split=list(splits),
                data_dir=dir_arg,
                download=download,
                builder_kwargs={"file_format": "array_record"},
            )
    except ImportError as e:
        module = getattr(e, "name", None) or first_line(e)
        raise DataError(
            f"{where}: TFDS needs the missing Python package {module!r} "
            f"({PREPARE_FIX}, or use {npz_fix(name)})",
            reason=f"TFDS needs the missing package {module!r}",
        ) from e
    except Exception as e:  # TFDS raises many types; classify by message.
        text = str(e)
        if "not been generated" in text or "could not find data" in text:
            raise NotPreparedError(
                f"TFDS has no prepared {name} (ArrayRecord format) in "
                f"{_tfds_dir_label(data_dir)} (use {npz_fix(name)}, or prepare it once with "
                f"--source tfds, which downloads it and needs {PREPARE_FIX})",
                reason=f"TFDS has no prepared {name} in {_tfds_dir_label(data_dir)}",
            ) from e
        if "TFRECORD" in text or "File format is already set" in text:
            raise DataError(
                f"{where}: prepared in TFRecord format, which tfds.data_source cannot read "
                f"(prepare it in ArrayRecord format in another data_dir, or use {npz_fix(name)})",
                reason=f"TFDS {name} in {_tfds_dir_label(data_dir)} is in TFRecord format",
            ) from e
        if download and isinstance(e, OSError):
            raise DataError(
                f"{where}: download failed ({type(e).__name__}: {first_line(e)}) "
                f"(check the network, or use {npz_fix(name)})",
                reason=f"downloading TFDS {name} failed",
            ) from e
        raise DataError(
            f"{where}: TFDS failed ({type(e).__name__}: {first_line(e)}) (use {npz_fix(name)})",
            reason=f"TFDS {name} failed ({type(e).__name__})",
        ) from e


def _tfds_read(source: Any, name: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Reads a TFDS data source into uint8 ``[N, 28, 28, 1]`` and int32 ``[N]``."""
    try:
        n = len(source)
        images: list[np.ndarray] = []
        labels: list[np.ndarray] = []
        with _quiet_absl():
            for start in range(0, n, TFDS_CHUNK):
                batch = read_records(source, range(start, min(start + TFDS_CHUNK, n)))
                images.append(np.stack([np.asarray(ex["image"]) for ex in batch]))
                labels.append(np.asarray([np.asarray(ex["label"]) for ex in batch]))
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            f"{where}: reading the prepared data failed ({type(e).__name__}: "
            f"{first_line(e)}) (prepare it again, or use {npz_fix(name)})",
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


def missing_prepare_modules() -> list[str]:
    """The modules of :data:`PREPARE_MODULES` that cannot be imported here.

    Returns:
      Their names, e.g. ``["tensorflow"]``; empty when TFDS can download and prepare data.

    Example:
      >>> missing_prepare_modules()  # doctest: +SKIP
      ['tensorflow', 'importlib_resources']
    """
    return [m for m in PREPARE_MODULES if importlib.util.find_spec(m) is None]


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


def network_reachable(host: str | None = None, port: int = 443, timeout: float = 2.0) -> bool:
    """Whether a TCP connection to ``host:port`` opens within ``timeout`` seconds.

    DNS lookup and connect (``socket.create_connection``) run in a daemon thread named
    ``meshensemble-netcheck``; the caller waits for it with ``Thread.join(timeout)``, so the
    call returns after at most ``timeout`` seconds even when DNS or the connect hangs (a
    probe still running then counts as unreachable, and its thread is left to finish).

    Args:
      host: the host to probe. ``None``: TFDS's download host :data:`TFDS_HOST` on
        ``port``, or the HTTPS proxy (its host, and its port or 8080) when one is set.
      port: the TCP port.
      timeout: seconds to wait, for the connect and for the thread.

    Returns:
      True if the connection opened in time; False if it failed (any ``OSError``) or is
      still pending after ``timeout``.

    Example:
      >>> network_reachable(timeout=1.0)  # doctest: +SKIP
      False
    """
    if host is None:
        host = TFDS_HOST
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


def split_files(records: Any) -> list[tuple[str, int, int]]:
    """The prepared files a TFDS data source of one split reads, from TFDS's dataset_info.

    Args:
      records: a ``tfds.data_source(name, split=...)`` (its ``dataset_info`` and ``split``).

    Returns:
      ``[(path, skip, take)]`` in reading order; ``[]`` when TFDS does not say (e.g.
      ``tfds.testing.mock_data``, whose records come from no file) or a file is missing.

    Example:
      >>> split_files(tfds.data_source("mnist", split="train"))[0][1:]  # doctest: +SKIP
      (0, 60000)
    """
    try:
        info, split = records.dataset_info, records.split
        instructions = info.splits[split].file_instructions
        out = [(os.fspath(f.filename), int(f.skip), int(f.take)) for f in instructions]
    except Exception:  # TFDS's layouts vary by version; without files: no content identity
        return []
    return out if out and all(storage.isfile(p) for p, _, _ in out) else []


def split_content_id(records: Any) -> str | None:
    """What identifies every byte of a TFDS split without a manifest: ``"tfds:<64 hex>"``.

    A hash of TFDS's own dataset_info (name, version, split, example count) and of each
    file the split reads (name, the records taken, size and SHA-256). The SHA-256 comes
    from the host's cache (:func:`meshensemble.data.manifest.cached_digest`): the first
    start on a host hashes the split's files once (about 100 MB/s), later starts cost a
    ``stat`` per file until a file changes.

    Args:
      records: a ``tfds.data_source`` of one split.

    Returns:
      The identity, or None when TFDS names no files (:func:`split_files`).

    Example:
      >>> split_content_id(tfds.data_source("mnist", split="train"))[:5]  # doctest: +SKIP
      'tfds:'
    """
    files = split_files(records)
    if not files:
        return None
    info = records.dataset_info
    digest = hashlib.sha256(
        repr((str(info.name), str(info.version), str(records.split), len(records))).encode()
    )
    for path, skip, take in files:
        size, sha = storage.file_size(path), manifest.cached_digest(path)
        digest.update(f"{os.path.basename(path)}:{skip}:{take}:{size}:{sha}\0".encode())
    return "tfds:" + digest.hexdigest()
