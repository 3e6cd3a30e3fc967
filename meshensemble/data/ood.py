"""Out-of-distribution inputs for any dataset: shifts of its own test inputs, or another dataset.

* :func:`shift_inputs`: shape-preserving synthetic shifts of any inputs (:data:`SHIFTS`):
  ``noise`` (uniform over the inputs' range, seeded), ``inverted`` (the range reversed),
  ``contrast`` (each example pulled towards its own mean), and for images ``hflip`` and
  ``vflip`` (mirrored left-right, upside down).
* :func:`load_ood`: the test inputs of another dataset of the same input shape and dtype,
  named by a TFDS name, an image folder or an npz file (:func:`ood_inputs` picks either).

For MNIST's uint8 images, ``noise`` and ``inverted`` are exactly the OOD sets
``meshensemble evaluate`` has always used (``noise`` with seed 0).

Example:
  >>> x = me.data.synthetic(20, 8).x_test                  # uint8 [8, 28, 28, 1]
  >>> bool((shift_inputs(x, "inverted") == 255 - x).all()), shift_inputs(x, "hflip").shape
  (True, (8, 28, 28, 1))
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from meshensemble.data import folder, npz, tfds
from meshensemble.data.dataset import DataError, Dataset
from meshensemble.runtime import storage

SHIFTS = ("noise", "inverted", "contrast", "hflip", "vflip")
"""Synthetic shifts :func:`shift_inputs` makes (``hflip``/``vflip`` need images)."""
CONTRAST = 0.3
"""The ``contrast`` shift keeps this share of each example's deviation from its mean."""


def _value_range(x: np.ndarray) -> tuple[Any, Any]:
    """The inputs' range: uint8's 0..255, else each feature's (channel's) own: ``[D]``
    arrays over the last axis, so a table's columns of different scales keep theirs."""
    if x.dtype == np.uint8:
        return 0.0, 255.0
    axes = tuple(range(x.ndim - 1))
    return x.min(axis=axes).astype(np.float64), x.max(axis=axes).astype(np.float64)


def shift_inputs(x: Any, kind: str, seed: int = 0) -> np.ndarray:
    """A shape- and dtype-preserving synthetic shift of inputs ``[N, ...]``.

    Args:
      x: the in-distribution inputs (usually the test split), images ``[N, H, W, C]`` or
        any ``[N, ...]``.
      kind: one of :data:`SHIFTS`.
      seed: the seed of ``np.random.default_rng`` for ``noise``.

    Returns:
      An array of ``x``'s shape and dtype: ``noise``: uniform values over the inputs'
      range (integers ``0..255`` for uint8; each feature's own range for floats);
      ``inverted``: ``low + high - x``;
      ``contrast``: ``mean + CONTRAST * (x - mean)`` per example; ``hflip``/``vflip``:
      images mirrored along their width/height.

    Raises:
      DataError: an unknown kind, or a flip of inputs that are not images ``[N, H, W, C]``.

    Example:
      >>> shift_inputs(np.zeros((2, 3)), "noise").shape
      (2, 3)
    """
    x = np.asarray(x)
    if kind not in SHIFTS:
        raise DataError(f"unknown OOD shift {kind!r}; choose one of {', '.join(SHIFTS)}")
    low, high = _value_range(x)
    if kind == "noise":
        rng = np.random.default_rng(seed)
        if np.issubdtype(x.dtype, np.integer):
            low, high = np.min(low), np.max(high)  # one range of pixels
            return rng.integers(int(low), int(high) + 1, size=x.shape, dtype=x.dtype)
        return rng.uniform(low, high, size=x.shape).astype(x.dtype)
    if kind == "inverted":
        flipped = (low + high) - x.astype(np.float64)
        return flipped.astype(x.dtype)
    if kind == "contrast":
        axes = tuple(range(1, x.ndim))
        mean = x.astype(np.float64).mean(axis=axes, keepdims=True)
        out = mean + CONTRAST * (x.astype(np.float64) - mean)
        out = np.rint(out) if np.issubdtype(x.dtype, np.integer) else out
        return np.clip(out, low, high).astype(x.dtype)
    if x.ndim != 4:
        raise DataError(
            f"OOD shift {kind!r} mirrors images [N, H, W, C]; these inputs have shape "
            f"{x.shape} (use noise, inverted or contrast)"
        )
    return np.ascontiguousarray(x[:, :, ::-1] if kind == "hflip" else x[:, ::-1])


def load_ood(
    spec: str | os.PathLike, like: Dataset, data_dir: str | os.PathLike | None = None
) -> tuple[np.ndarray, str]:
    """The test inputs of another dataset, checked to have ``like``'s input shape and dtype.

    Args:
      spec: an image folder (``ROOT/train/...``, ``ROOT/test/...``), an ``.npz`` file (its
        ``x_test``, as in the Keras layout, or its ``images`` or ``x``:
        :func:`~meshensemble.data.load_npz_inputs`), or a TFDS name (read from
        ``data_dir``, never downloaded).
      like: the in-distribution dataset.
      data_dir: TFDS's data directory for a TFDS name.

    Returns:
      ``(x, note)``: the other dataset's test inputs ``[M, *like.input_shape]`` and its
      one-line note.

    Raises:
      DataError: the other data cannot be loaded (its source's one line), or its inputs
        have another shape or dtype (naming both).

    Example:
      >>> ds = me.data.synthetic(20, 8)
      >>> path = me.data.save_npz(me.data.synthetic(20, 6, seed=3), "other.npz")
      >>> x, note = load_ood("other.npz", ds)
      >>> x.shape
      (6, 28, 28, 1)
    """
    text = os.fspath(spec)
    path = os.path.expanduser(text)
    if storage.isdir(path):
        other = folder.load_image_folder(path)
    elif storage.isfile(path) or text.endswith(".npz"):
        x, note = npz.load_npz_inputs(path)
        _check_like(text, like, x)
        return x, note
    else:
        other = tfds.load_tfds_dataset(text, data_dir, download=False)
    _check_like(text, like, other.x_test)
    return np.asarray(other.x_test), other.note


def _check_like(text: str, like: Dataset, x: np.ndarray) -> None:
    want = (tuple(like.input_shape), np.dtype(like.x_test.dtype))
    have = (tuple(x.shape[1:]), np.dtype(x.dtype))
    if have != want:
        raise DataError(
            f"OOD set {text}: inputs of shape {have[0]} {have[1]}; expected {want[0]} "
            f"{want[1]} like {like.name}'s (pick a dataset of the same input shape)"
        )


def ood_inputs(
    name: str, like: Dataset, seed: int = 0, data_dir: str | os.PathLike | None = None
) -> tuple[np.ndarray, str]:
    """The OOD inputs ``name`` means for ``like``: a shift of its test inputs, or other data.

    Args:
      name: one of :data:`SHIFTS`, or what :func:`load_ood` takes.
      like: the in-distribution dataset.
      seed: the seed of the ``noise`` shift.
      data_dir: TFDS's data directory.

    Returns:
      ``(x, note)``.

    Raises:
      DataError: as :func:`shift_inputs` and :func:`load_ood` say.

    Example:
      >>> x, note = ood_inputs("vflip", me.data.synthetic(20, 8))
      >>> x.shape, note
      ((8, 28, 28, 1), 'vflip shift of the synthetic test inputs')
    """
    if name in SHIFTS:
        return shift_inputs(like.x_test, name, seed), f"{name} shift of the {like.name} test inputs"
    return load_ood(name, like, data_dir)
