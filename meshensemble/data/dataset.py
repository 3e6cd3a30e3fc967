"""The data every source returns: :class:`Dataset`, :class:`DataError`, checks, normalisation.

A :class:`Dataset` holds uint8 images ``[N, 28, 28, 1]`` and int32 labels ``[N]`` in
``[0, NUM_CLASSES)`` per split; :func:`validate` checks and converts one split (every
loader calls it, so every loader range-checks its labels on the host). The small helpers
here (:func:`check_name`, :func:`split_counts`, :func:`first_line`) are shared by the
loaders of this package.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshensemble.errors import DataError as DataError  # the kind; data.DataError stays

DATASETS = ("mnist", "fashion_mnist")
"""Dataset names that the loaders accept (TFDS names)."""
NUM_CLASSES = 10
"""Number of classes of every dataset here; labels are ``0..NUM_CLASSES - 1``."""
IMAGE_SHAPE = (28, 28, 1)
"""Shape of one image (height, width, channels)."""
PRETTY_NAMES = {"mnist": "MNIST", "fashion_mnist": "Fashion-MNIST"}
"""How each of :data:`DATASETS` is written in notes and messages."""
FULL_SIZES = (60_000, 10_000)
"""``(train, test)`` sizes of the full datasets; notes call such data "full"."""

_DATASET_SOURCES = ("npz", "tfds", "sample", "synthetic", "arrayrecord")
LAZY_CHECKED = 2
"""Images of a lazy train split (``train_images.lazy``) a :class:`Dataset` reads to check
them (the first and the last); its labels are checked in full."""


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """Train and test splits of an image-classification dataset, as numpy arrays.

    Construction validates and normalizes the arrays (see :func:`validate`). Instances
    are frozen; compare datasets by their arrays, not with ``==``.

    Attributes:
      name: the dataset's name, e.g. ``"mnist"``.
      train_images: uint8 ``[num_train, 28, 28, 1]``, or a lazy array-like that reads
        examples only when indexed (:class:`meshensemble.data.lazy.SourceImages`: its
        labels are checked in full, its images by :data:`LAZY_CHECKED` of them).
      train_labels: int32 ``[num_train]``, values ``0..9``.
      test_images: uint8 ``[num_test, 28, 28, 1]``.
      test_labels: int32 ``[num_test]``, values ``0..9``.
      source: where it came from: ``"npz"``, ``"tfds"``, ``"sample"``, ``"synthetic"`` or
        ``"arrayrecord"``.
      note: one line saying where the data came from, e.g.
        ``"full MNIST from /data/mnist.npz (60,000 train / 10,000 test)"``.

    Raises:
      DataError: if ``source`` is unknown or an array is malformed.

    Example:
      >>> ds = me.data.synthetic(num_train=20, num_test=10)
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
        train = _validate_train(self.train_images, self.train_labels, f"{where} train split")
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


def validate(
    images: Any, labels: Any, where: str, num_classes: int = NUM_CLASSES
) -> tuple[np.ndarray, np.ndarray]:
    """Checks one split and returns it as uint8 images and int32 labels.

    Every loader (:func:`~meshensemble.data.load_npz`, :func:`~meshensemble.data.load_tfds`,
    :func:`~meshensemble.data.load_sample`, :func:`~meshensemble.data.synthetic`) and
    :class:`Dataset` itself pass each split through here, so labels are range-checked on the
    host before anything reaches a device (where an out-of-range label would silently give a
    zero one-hot row).

    Args:
      images: ``[N, 28, 28]`` or ``[N, 28, 28, 1]`` uint8, or another integer dtype with
        values in ``0..255`` (converted). Floats are rejected.
      labels: ``[N]`` integers in ``[0, num_classes)``.
      where: names the data in error messages, e.g. a file path and its keys.
      num_classes: the number of classes (default :data:`NUM_CLASSES`, 10).

    Returns:
      ``(images, labels)``: uint8 ``[N, 28, 28, 1]`` and int32 ``[N]``. Arrays that are
      already in that form are returned without a copy.

    Raises:
      DataError: (one line, starting with ``where``) for a wrong ndim or shape, a
        non-integer dtype, pixels outside ``0..255``, a label outside
        ``[0, num_classes)`` (naming the first bad value and its index, the range of the
        labels found, the classes expected and the fix), different lengths, or no examples.

    Example:
      >>> x = np.zeros((3, 28, 28), np.uint8)
      >>> x, y = validate(x, np.array([0, 1, 9]), "example")
      >>> x.shape, x.dtype, y.dtype
      ((3, 28, 28, 1), dtype('uint8'), dtype('int32'))
    """
    if (
        isinstance(num_classes, bool)
        or not isinstance(num_classes, int | np.integer)
        or num_classes < 1
    ):
        raise DataError(f"{where}: num_classes={num_classes!r}; pass a positive int")
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
            f"0..{num_classes - 1}"
        )
    if images.shape[0] != labels.shape[0]:
        raise DataError(
            f"{where}: {images.shape[0]} images but {labels.shape[0]} labels; "
            "expected one label per image"
        )
    if images.shape[0] == 0:
        raise DataError(f"{where}: no examples (0 images); expected at least one")
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if bad.size:
        i, top = int(bad[0]), num_classes - 1
        more = f" ({bad.size} labels out of range)" if bad.size > 1 else ""
        raise DataError(
            f"{where}: label {labels[i]} at index {i} is outside 0..{top}{more}; the labels "
            f"span {labels.min()}..{labels.max()} but there are {num_classes} classes "
            f"(integer labels in [0, {num_classes})); map the labels to 0..{top} or drop "
            "the examples with other labels"
        )
    return images, labels.astype(np.int32, copy=False)


def _validate_train(images: Any, labels: Any, where: str) -> tuple[Any, np.ndarray]:
    """:func:`validate`, or for a lazy split: all labels and a sample of the images."""
    if not getattr(images, "lazy", False):
        return validate(images, labels, where)
    n, labels = len(images), np.asarray(labels)
    if labels.ndim != 1 or len(labels) != n:
        raise DataError(
            f"{where}: labels of shape {labels.shape} for {n} lazy images; expected [N] "
            "integer class ids, one per image"
        )
    stand_in = np.broadcast_to(np.zeros(IMAGE_SHAPE, np.uint8), (n, *IMAGE_SHAPE))
    _, labels = validate(stand_in, labels, where)  # every label (no image is read)
    picked = np.unique(np.linspace(0, n - 1, LAZY_CHECKED).astype(np.int64))
    validate(images[picked], labels[picked], where)  # a sample of the images, read
    return images, labels


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


def check_name(name: str) -> None:
    """Checks that ``name`` is one of :data:`DATASETS`.

    Args:
      name: a dataset name.

    Raises:
      DataError: (one line) naming the unknown name and the known ones.

    Example:
      >>> check_name("mnist")
    """
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r} (use one of {', '.join(DATASETS)})")


def split_counts(train_labels: np.ndarray, test_labels: np.ndarray) -> str:
    """The sizes of two splits as notes write them.

    Args:
      train_labels: the train split's labels ``[N]``.
      test_labels: the test split's labels ``[M]``.

    Returns:
      E.g. ``"4,000 train / 1,000 test"``.

    Example:
      >>> split_counts(np.zeros(4000), np.zeros(1000))
      '4,000 train / 1,000 test'
    """
    return f"{len(train_labels):,} train / {len(test_labels):,} test"


def first_line(error: BaseException, limit: int = 200) -> str:
    """The first non-empty line of an exception's message, shortened to ``limit``.

    Args:
      error: an exception.
      limit: the most characters returned.

    Returns:
      The line, or the exception's type name when its message is empty.

    Example:
      >>> first_line(OSError("disk full\\ntraceback..."))
      'disk full'
    """
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())
