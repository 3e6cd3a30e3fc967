"""The data every source returns: :class:`Dataset`, :class:`DataError`, checks, normalisation.

A :class:`Dataset` is ONE type for every task: features of any shape and dtype per split
(images ``[N, H, W, C]`` uint8 or float, tabular ``[N, F]`` float) and targets that are
either int class ids ``[N]`` (with ``num_classes`` and, where the source has them,
``class_names``) or float ``[N, T]`` (``num_classes`` None). Its checks are generic (the
same example shape and dtype in both splits, one target per example, no empty split,
class ids in range, finite floats), each a one-line :class:`DataError` naming the array,
its shape and the expected one. A name with a known layout (:data:`NAMED_SPECS`: MNIST
and Fashion-MNIST, 28x28x1 uint8 images of 10 classes) is checked against it by
:func:`validate`, with the messages MNIST data always had. The small helpers here
(:func:`check_name`, :func:`split_counts`, :func:`first_line`) are shared by the loaders
of this package.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshensemble.errors import DataError as DataError  # the kind; data.DataError stays

DATASETS = ("mnist", "fashion_mnist")
"""Dataset names that the MNIST loaders accept (TFDS names)."""
NUM_CLASSES = 10
"""Number of classes of MNIST and Fashion-MNIST; labels are ``0..NUM_CLASSES - 1``."""
IMAGE_SHAPE = (28, 28, 1)
"""Shape of one MNIST / Fashion-MNIST image (height, width, channels)."""
PRETTY_NAMES = {"mnist": "MNIST", "fashion_mnist": "Fashion-MNIST"}
"""How each of :data:`DATASETS` is written in notes and messages."""
FULL_SIZES = (60_000, 10_000)
"""``(train, test)`` sizes of the full datasets; notes call such data "full"."""
DATASET_SOURCES = (
    "npz", "tfds", "sample", "synthetic", "arrayrecord", "folder", "csv", "toy1d", "diabetes",
    "friedman1", "arrays",
)  # fmt: skip
"""Values of :attr:`Dataset.source`: where the data came from (``"arrays"``: arrays a user
passed from Python)."""
LAZY_CHECKED = 2
"""Examples of a lazy train split (``x_train.lazy``) a :class:`Dataset` reads to check
them (the first and the last); its targets are checked in full."""


@dataclasses.dataclass(frozen=True)
class NamedSpec:
    """The layout every dataset of one name has: uint8 images of one shape, its classes.

    Attributes:
      image_shape: ``(H, W, C)``.
      num_classes: the number of classes.

    Example:
      >>> NAMED_SPECS["mnist"]
      NamedSpec(image_shape=(28, 28, 1), num_classes=10)
    """

    image_shape: tuple[int, int, int]
    num_classes: int


NAMED_SPECS = {name: NamedSpec(IMAGE_SHAPE, NUM_CLASSES) for name in (*DATASETS, "synthetic")}
"""Dataset names with a known layout (MNIST, Fashion-MNIST and the MNIST-shaped bars of
:func:`~meshensemble.data.synthetic`): a :class:`Dataset` of such a name is checked
against it by :func:`validate` (the messages MNIST data always had) and gets its number
of classes."""

_ALIASES = {
    "train_images": "x_train",
    "train_labels": "y_train",
    "test_images": "x_test",
    "test_labels": "y_test",
}


def _alias(name: str, doc: str) -> property:
    """A read-only property that gives the attribute ``name`` (an old name of it)."""
    return property(lambda self: getattr(self, name), doc=doc)


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class Dataset:
    """Train and test splits of any dataset: features and targets as numpy arrays.

    One type for every task and source. Construction checks the arrays (generic checks,
    or :func:`validate` for a name in :data:`NAMED_SPECS`) and converts class ids to int32
    and float targets to float32. Instances are frozen; compare datasets by their arrays,
    not with ``==``. The old names ``train_images``, ``train_labels``, ``test_images``
    and ``test_labels`` are read-only aliases of the ``x_``/``y_`` fields, and are also
    accepted as keywords (where given they replace the field, so
    ``dataclasses.replace(ds, train_labels=y)`` works).

    Attributes:
      name: the dataset's name, e.g. ``"mnist"``, ``"cifar10"``, ``"wine"``.
      x_train: features ``[num_train, ...]`` of any numeric dtype (images ``[N, H, W, C]``
        uint8 or float, tabular ``[N, F]`` float), or a lazy array-like that reads
        examples only when indexed (:class:`meshensemble.data.lazy.SourceImages`: its
        targets are checked in full, its examples by :data:`LAZY_CHECKED` of them).
      y_train: int32 class ids ``[num_train]`` in ``[0, num_classes)``, or float32
        targets ``[num_train, T]``.
      x_test: features ``[num_test, ...]``, the same example shape and dtype as x_train.
      y_test: targets of the same kind (and ``T``) as y_train.
      source: where it came from, one of :data:`DATASET_SOURCES`.
      note: one line saying where the data came from, e.g.
        ``"full MNIST from /data/mnist.npz (60,000 train / 10,000 test)"``.
      num_classes: for class ids, the number of classes (default: from
        :data:`NAMED_SPECS`, else the largest id in either split + 1); None for float
        targets.
      class_names: a tuple of ``num_classes`` names, or None.

    Raises:
      DataError: one line naming the array, its shape and the expected one: an unknown
        ``source``, a missing array, features of another example shape or dtype than
        x_train's, a split without examples, a target count that is not one per example,
        a class id out of range, NaN or inf, or ``num_classes`` / ``class_names`` that do
        not fit the targets.

    Example:
      >>> ds = me.data.synthetic(num_train=20, num_test=10)
      >>> ds.x_train.shape, ds.num_classes, ds.input_shape
      ((20, 28, 28, 1), 10, (28, 28, 1))
      >>> ds.train_images is ds.x_train   # the old name
      True
      >>> reg = me.data.Dataset("toy", np.zeros((4, 2)), np.ones((4, 1)),
      ...                       np.zeros((2, 2)), np.ones((2, 1)), source="arrays")
      >>> reg.num_classes, reg.num_targets
      (None, 1)
    """

    name: str
    x_train: Any = dataclasses.field(repr=False)
    y_train: np.ndarray = dataclasses.field(repr=False)
    x_test: Any = dataclasses.field(repr=False)
    y_test: np.ndarray = dataclasses.field(repr=False)
    source: str
    note: str
    num_classes: int | None
    class_names: tuple[str, ...] | None

    def __init__(
        self,
        name: str = "data",
        x_train: Any = None,
        y_train: Any = None,
        x_test: Any = None,
        y_test: Any = None,
        source: str = "arrays",
        note: str = "",
        num_classes: int | None = None,
        class_names: Sequence[str] | None = None,
        **old_names: Any,
    ) -> None:
        arrays = {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}
        for old, value in old_names.items():
            if old not in _ALIASES:
                raise TypeError(f"Dataset() got an unexpected keyword argument {old!r}")
            if value is not None:
                arrays[_ALIASES[old]] = value
        if source not in DATASET_SOURCES:
            raise DataError(
                f"Dataset {name!r}: unknown source {source!r} "
                f"(use one of {', '.join(DATASET_SOURCES)})"
            )
        where = f"Dataset {name!r} ({source})"
        checked = _checked(arrays, where, NAMED_SPECS.get(name), num_classes, class_names)
        object.__setattr__(self, "name", name)
        for key, value in checked.items():
            object.__setattr__(self, key, value)
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "note", _one_line(note))

    train_images = _alias("x_train", "The old name of :attr:`x_train` (read-only).")
    train_labels = _alias("y_train", "The old name of :attr:`y_train` (read-only).")
    test_images = _alias("x_test", "The old name of :attr:`x_test` (read-only).")
    test_labels = _alias("y_test", "The old name of :attr:`y_test` (read-only).")

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one example's features, e.g. ``(28, 28, 1)`` or ``(13,)``."""
        return tuple(self.x_train.shape[1:])

    image_shape = _alias("input_shape", "The old name of :attr:`input_shape`.")

    @property
    def num_targets(self) -> int | None:
        """``T`` of float targets ``[N, T]``; None for class ids."""
        return None if self.num_classes is not None else int(self.y_train.shape[1])

    targets = _alias("num_targets", "The old (``RegressionData``) name of :attr:`num_targets`.")

    @property
    def num_train(self) -> int:
        """Number of training examples."""
        return int(self.y_train.shape[0])

    @property
    def num_test(self) -> int:
        """Number of test examples."""
        return int(self.y_test.shape[0])


def is_class_ids(targets: Any) -> bool:
    """Whether targets are class ids (an integer dtype) rather than float targets.

    Args:
      targets: ``[N]`` ints or ``[N, T]`` floats (any array-like).

    Returns:
      True for an integer dtype.

    Example:
      >>> is_class_ids(np.array([0, 2, 1])), is_class_ids(np.zeros((3, 1)))
      (True, False)
    """
    return bool(np.issubdtype(np.asarray(targets).dtype, np.integer))


def _checked(
    arrays: dict[str, Any],
    where: str,
    spec: NamedSpec | None,
    num_classes: Any,
    class_names: Any,
) -> dict[str, Any]:
    """The four arrays checked and converted, with ``num_classes`` and ``class_names``."""
    gone = [k for k, v in arrays.items() if v is None]
    if gone:
        raise DataError(f"{where}: no {', '.join(gone)}; pass x_train, y_train, x_test, y_test")
    if spec is not None:
        if num_classes is not None and num_classes != spec.num_classes:
            raise DataError(
                f"{where}: num_classes={num_classes!r}, but this dataset has "
                f"{spec.num_classes} classes; drop num_classes"
            )
        num_classes = spec.num_classes
        train = _validate_train(arrays["x_train"], arrays["y_train"], f"{where} train split", spec)
        test = validate(
            arrays["x_test"], arrays["y_test"], f"{where} test split", num_classes, spec.image_shape
        )
        arrays = {"x_train": train[0], "y_train": train[1], "x_test": test[0], "y_test": test[1]}
    elif getattr(arrays["x_train"], "lazy", False):
        _check_lazy_sample(arrays["x_train"], where)
    out = {k: _features(arrays[k], k, where) for k in ("x_train", "x_test")}
    out |= {k: _targets(arrays[k], k, where) for k in ("y_train", "y_test")}
    _check_pairs(out, where)
    classes = _num_classes(out, num_classes, where)
    if classes is not None:
        for k in ("y_train", "y_test"):
            out[k] = out[k].astype(np.int32, copy=False)
    out["num_classes"] = classes
    out["class_names"] = _class_names(class_names, classes, where)
    return out


def _shape(a: Any) -> str:
    """``[N, d1, ...]`` as messages write an expected shape."""
    return "[" + ", ".join(["N", *(str(d) for d in a.shape[1:])]) + "]"


def _features(x: Any, key: str, where: str) -> Any:
    """Features ``[N, ...]`` of a numeric dtype, finite where float (a lazy split: as is)."""
    if getattr(x, "lazy", False):
        return x
    x = np.asarray(x)
    if x.ndim < 2:
        raise DataError(
            f"{where}: {key} has shape {x.shape}; expected [N, ...] features, one row per "
            "example (tabular [N, F], images [N, H, W, C])"
        )
    if not np.issubdtype(x.dtype, np.number) or np.issubdtype(x.dtype, np.complexfloating):
        raise DataError(
            f"{where}: {key} has dtype {x.dtype} (shape {x.shape}); expected real numbers "
            "(uint8 or float images, float features)"
        )
    _check_finite(x, key, where)
    return x


def _check_lazy_sample(x: Any, where: str) -> None:
    """Reads :data:`LAZY_CHECKED` examples of a lazy split: their layout is the declared one."""
    if not len(x):
        return
    picked = np.unique(np.linspace(0, len(x) - 1, LAZY_CHECKED).astype(np.int64))
    sample = np.asarray(x[picked])
    if sample.shape[1:] != tuple(x.shape[1:]) or sample.dtype != np.dtype(x.dtype):
        raise DataError(
            f"{where}: x_train (lazy, shape {tuple(x.shape)} {x.dtype}) reads examples of "
            f"shape {sample.shape[1:]} {sample.dtype}; expected {_shape(x)} {x.dtype}"
        )
    _check_finite(sample, "x_train", where)


def _check_finite(a: np.ndarray, key: str, where: str) -> None:
    """A one-line DataError naming the first example with NaN or inf (floats only)."""
    if not np.issubdtype(a.dtype, np.floating) or not a.size:
        return
    bad = ~np.isfinite(a.reshape(len(a), -1)).all(axis=1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise DataError(
            f"{where}: {key} (shape {a.shape}) holds NaN or inf in {int(bad.sum())} "
            f"example(s), the first at index {i}; expected finite values (clean the data)"
        )


def _targets(y: Any, key: str, where: str) -> np.ndarray:
    """Class ids ``[N]`` (integers) or float targets ``[N, T]`` (float32, finite)."""
    y = np.asarray(y)
    if np.issubdtype(y.dtype, np.integer) and not np.issubdtype(y.dtype, np.bool_):
        if y.ndim != 1:
            raise DataError(
                f"{where}: {key} has shape {y.shape}; expected [N] integer class ids "
                "(or float targets [N, T])"
            )
        return y
    if not np.issubdtype(y.dtype, np.floating):
        raise DataError(
            f"{where}: {key} has dtype {y.dtype} (shape {y.shape}); expected integer class "
            "ids [N] or float targets [N, T]"
        )
    if y.ndim != 2:
        fix = " (reshape float targets [N] to [N, 1]; class ids are integers)"
        raise DataError(
            f"{where}: {key} has float dtype and shape {y.shape}; expected float targets "
            f"[N, T]{fix if y.ndim == 1 else ''}"
        )
    _check_finite(y, key, where)
    return y.astype(np.float32, copy=False)


def _check_pairs(out: dict[str, Any], where: str) -> None:
    """One target per example, no empty split, the same example layout in both splits."""
    for split in ("train", "test"):
        x, y = out[f"x_{split}"], out[f"y_{split}"]
        if len(x) != len(y):
            raise DataError(
                f"{where}: x_{split} has {len(x)} examples (shape {tuple(x.shape)}) but "
                f"y_{split} has {len(y)} (shape {y.shape}); expected one target per example"
            )
        if len(x) == 0:
            raise DataError(
                f"{where}: x_{split} has no examples (shape {tuple(x.shape)}); expected at "
                "least one"
            )
    a, b = out["x_train"], out["x_test"]
    if tuple(a.shape[1:]) != tuple(b.shape[1:]) or np.dtype(a.dtype) != np.dtype(b.dtype):
        raise DataError(
            f"{where}: x_test has shape {tuple(b.shape)} and dtype {b.dtype}; expected "
            f"{_shape(a)} {a.dtype}, the example shape and dtype of x_train"
        )
    ya, yb = out["y_train"], out["y_test"]
    if ya.dtype.kind != yb.dtype.kind and "f" in (ya.dtype.kind, yb.dtype.kind):
        raise DataError(
            f"{where}: y_test has dtype {yb.dtype} (shape {yb.shape}) but y_train "
            f"{ya.dtype}; expected the same kind of targets in both splits"
        )
    if ya.ndim == 2 and yb.shape[1:] != ya.shape[1:]:
        raise DataError(
            f"{where}: y_test has shape {yb.shape}; expected {_shape(ya)}, the targets "
            "per example of y_train"
        )


def _num_classes(out: dict[str, Any], num_classes: Any, where: str) -> int | None:
    """The number of classes of class-id targets (checked against them); None for floats."""
    ys = (out["y_train"], out["y_test"])
    if not is_class_ids(ys[0]):
        if num_classes is not None:
            raise DataError(
                f"{where}: num_classes={num_classes!r} for float targets of shape "
                f"{ys[0].shape}; drop num_classes (or pass integer class ids)"
            )
        return None
    if num_classes is None:  # from the data: the largest id + 1 (negative ids refused below)
        num_classes = max(1, *(int(y.max()) + 1 for y in ys))
    _check_num_classes(num_classes, where)
    for key, y in zip(("y_train", "y_test"), ys, strict=True):
        bad = np.flatnonzero((y < 0) | (y >= num_classes))
        if bad.size:
            i, top = int(bad[0]), int(num_classes) - 1
            raise DataError(
                f"{where}: {key} (shape {y.shape}) has class id {y[i]} at index {i}, outside "
                f"0..{top} ({bad.size} out of range; the ids span {y.min()}..{y.max()}); "
                f"expected ids in [0, {num_classes}): map them to 0..{top} or pass num_classes"
            )
    return int(num_classes)


def _check_num_classes(num_classes: Any, where: str) -> None:
    """A one-line DataError unless ``num_classes`` is a positive int."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, int | np.integer):
        raise DataError(f"{where}: num_classes={num_classes!r}; pass a positive int")
    if num_classes < 1:
        raise DataError(f"{where}: num_classes={num_classes!r}; pass a positive int")


def _class_names(names: Any, classes: int | None, where: str) -> tuple[str, ...] | None:
    """``names`` as a tuple of ``classes`` strings, or None."""
    if names is None:
        return None
    if isinstance(names, str) or classes is None:
        raise DataError(
            f"{where}: class_names={names!r}; pass a sequence of one name per class, only "
            "with class-id targets"
        )
    names = tuple(str(n) for n in names)
    if len(names) != classes:
        raise DataError(
            f"{where}: {len(names)} class_names for {classes} classes; pass one name per "
            "class, in class-id order"
        )
    return names


def validate(
    images: Any,
    labels: Any,
    where: str,
    num_classes: int = NUM_CLASSES,
    image_shape: tuple[int, int, int] = IMAGE_SHAPE,
) -> tuple[np.ndarray, np.ndarray]:
    """Checks one split of uint8 images and class ids; returns uint8 images, int32 labels.

    The check of the MNIST sources (and of any source of uint8 images of one known shape).

    Every loader (:func:`~meshensemble.data.load_npz`, :func:`~meshensemble.data.load_tfds`,
    :func:`~meshensemble.data.load_sample`, :func:`~meshensemble.data.synthetic`) and
    :class:`Dataset` itself pass each split through here, so labels are range-checked on the
    host before anything reaches a device (where an out-of-range label would silently give a
    zero one-hot row).

    Args:
      images: ``[N, H, W, C]`` (or ``[N, H, W]`` when ``C`` is 1) uint8, or another
        integer dtype with values in ``0..255`` (converted). Floats are rejected.
      labels: ``[N]`` integers in ``[0, num_classes)``.
      where: names the data in error messages, e.g. a file path and its keys.
      num_classes: the number of classes (default :data:`NUM_CLASSES`, 10).
      image_shape: ``(H, W, C)`` (default :data:`IMAGE_SHAPE`, MNIST's ``(28, 28, 1)``).

    Returns:
      ``(images, labels)``: uint8 ``[N, H, W, C]`` and int32 ``[N]``. Arrays that are
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
    _check_num_classes(num_classes, where)
    images = np.asarray(images)
    labels = np.asarray(labels)
    h, w, c = image_shape = tuple(image_shape)
    if c == 1 and images.ndim == 3 and images.shape[1:] == (h, w):
        images = images[..., None]
    elif images.ndim != 4 or images.shape[1:] != image_shape:
        grey = f"[N, {h}, {w}] or " if c == 1 else ""
        kind = "grayscale" if c == 1 else ("RGB" if c == 3 else f"{c}-channel")
        raise DataError(
            f"{where}: images have shape {images.shape}; expected {grey}"
            f"[N, {h}, {w}, {c}] ({h}x{w} {kind} images)"
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


def _validate_train(
    images: Any, labels: Any, where: str, spec: NamedSpec
) -> tuple[Any, np.ndarray]:
    """:func:`validate`, or for a lazy split: all labels and a sample of the images."""
    classes, shape = spec.num_classes, spec.image_shape
    if not getattr(images, "lazy", False):
        return validate(images, labels, where, classes, shape)
    n, labels = len(images), np.asarray(labels)
    if labels.ndim != 1 or len(labels) != n:
        raise DataError(
            f"{where}: labels of shape {labels.shape} for {n} lazy images; expected [N] "
            "integer class ids, one per image"
        )
    stand_in = np.broadcast_to(np.zeros(shape, np.uint8), (n, *shape))
    _, labels = validate(stand_in, labels, where, classes, shape)  # every label, no image read
    picked = np.unique(np.linspace(0, n - 1, LAZY_CHECKED).astype(np.int64))
    validate(images[picked], labels[picked], where, classes, shape)  # a sample, read
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
        raise DataError(
            f"unknown dataset {name!r} (use one of {', '.join(DATASETS)}, or --source tfds "
            "for any TFDS name)"
        )


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
