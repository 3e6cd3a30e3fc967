"""A validation split held out of the training examples: seeded, stratified by class.

:func:`split_validation` picks ``count`` training examples for calibration or early
stopping. For class-id targets it takes each class's proportion (largest remainders), at
random within each class; for float targets a seeded random subset. Both draw from
``np.random.default_rng([seed, VALIDATION_STREAM])``. The same ``(dataset, count, seed)``
always gives the same indices, so a run records only the count, the seed and a
fingerprint of the indices (:meth:`ValidationSplit.record`), and ``meshensemble evaluate``
rebuilds the split and checks the fingerprint.

Example:
  >>> split = split_validation(me.data.synthetic(200, 20), 50, seed=0)
  >>> split.train.num_train, split.y.shape
  (150, (50,))
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np

from meshensemble.data.dataset import Dataset, is_class_ids

VALIDATION_STREAM = 0x7A11D
"""Second word of the numpy seed of the split, so that it is independent of other uses of
the run's seed."""


@dataclasses.dataclass(frozen=True, eq=False)
class ValidationSplit:
    """A training set with a validation split held out of it.

    Attributes:
      train: the dataset without the held-out examples (the test split unchanged).
      x: ``[count, ...]`` held-out features (the dataset's example shape and dtype).
      y: ``[count]`` int32 class ids or ``[count, T]`` float32 targets, held out.
      indices: int64 ``[count]`` sorted positions of the held-out examples in the original
        training split.
      seed: the seed the split was drawn with.
    """

    train: Dataset
    x: Any = dataclasses.field(repr=False)
    y: np.ndarray = dataclasses.field(repr=False)
    indices: np.ndarray = dataclasses.field(repr=False)
    seed: int = 0

    @property
    def images(self) -> Any:
        """The old name of :attr:`x`."""
        return self.x

    @property
    def labels(self) -> np.ndarray:
        """The old name of :attr:`y`."""
        return self.y

    @property
    def count(self) -> int:
        """Number of held-out examples."""
        return int(self.indices.shape[0])

    @property
    def fingerprint(self) -> str:
        """16 hex digits of a SHA-256 over the held-out indices."""
        return indices_fingerprint(self.indices)

    def record(self) -> dict[str, Any]:
        """What ``config.json`` records of the split (``resolved.validation``).

        Returns:
          ``{"count", "seed", "fingerprint"}``, and for class-id targets ``"per_class"``
          (the held-out count of each class).

        Example:
          >>> split = split_validation(me.data.synthetic(200, 20), 50, seed=0)
          >>> split.record()["count"]
          50
        """
        out: dict[str, Any] = {
            "count": self.count,
            "seed": int(self.seed),
            "fingerprint": self.fingerprint,
        }
        if self.train.num_classes is not None:
            per_class = np.bincount(self.y, minlength=self.train.num_classes)
            out["per_class"] = [int(v) for v in per_class]
        return out


def indices_fingerprint(indices: Any) -> str:
    """16 hex digits of a SHA-256 over sorted int64 indices.

    Args:
      indices: ``[count]`` integer indices.

    Returns:
      The fingerprint, e.g. ``"9f86d081884c7d65"``.

    Example:
      >>> len(indices_fingerprint([3, 1, 2]))
      16
    """
    flat = np.sort(np.asarray(indices, np.int64).ravel())
    return hashlib.sha256(np.ascontiguousarray(flat).tobytes()).hexdigest()[:16]


def _per_class_counts(labels: np.ndarray, count: int, classes: int) -> np.ndarray:
    """``count`` split over classes in proportion to their sizes (largest remainders)."""
    sizes = np.bincount(labels, minlength=classes).astype(np.int64)
    exact = sizes * count / max(int(sizes.sum()), 1)
    take = np.floor(exact).astype(np.int64)
    rest = count - int(take.sum())
    # Largest remainders first; ties go to the lower class. Never more than a class holds.
    order = sorted(range(classes), key=lambda c: (-(exact[c] - take[c]), c))
    for c in order:
        if rest == 0:
            break
        if take[c] < sizes[c]:
            take[c] += 1
            rest -= 1
    return take


def validation_indices(labels: Any, count: int, seed: int = 0, classes: int = 10) -> np.ndarray:
    """The sorted positions :func:`split_validation` holds out, from the targets alone.

    Class ids (an integer dtype) are split by class (:func:`split_validation`); float
    targets give a seeded random subset of the rows.

    Args:
      labels: int ``[N]`` training class ids, or float ``[N, T]`` targets.
      count: examples to hold out, ``0 < count <= N``.
      seed: the run's seed.
      classes: the number of classes (class ids only).

    Returns:
      int64 ``[count]`` sorted indices (no features are read: a lazy split stays unread).

    Example:
      >>> ds = me.data.synthetic(200, 20)
      >>> validation_indices(ds.y_train, 50, seed=0).shape
      (50,)
      >>> validation_indices(np.zeros((20, 1), np.float32), 5, seed=0).tolist()
      [0, 4, 6, 13, 18]
    """
    labels = np.asarray(labels)
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, VALIDATION_STREAM])
    if not is_class_ids(labels):
        return np.sort(rng.permutation(len(labels))[: int(count)].astype(np.int64))
    take = _per_class_counts(labels, int(count), classes)
    picked = [
        rng.choice(np.flatnonzero(labels == c), size=int(k), replace=False)
        for c, k in enumerate(take)
    ]
    return np.sort(np.concatenate(picked).astype(np.int64))


def split_validation(
    dataset: Dataset, count: int, seed: int = 0, *, batch_size: int = 1
) -> ValidationSplit:
    """Holds ``count`` training examples out: stratified by class (class ids), seeded.

    For class ids each class gives ``count * n_c / n`` examples (rounded by largest
    remainders so the total is exactly ``count``), drawn without replacement from
    ``np.random.default_rng([seed, VALIDATION_STREAM])``, class by class in label order.
    For float targets the first ``count`` rows of a permutation drawn from the same
    generator are held out. The remaining examples keep their original order.

    Args:
      dataset: the data; only its training split is divided.
      count: examples to hold out, ``0 <= count <= num_train - batch_size``.
      seed: the run's seed.
      batch_size: the training batch; at least one batch must remain.

    Returns:
      A :class:`ValidationSplit` (``count == 0`` gives the dataset itself and empty
      arrays). A lazy train split (:mod:`meshensemble.data.lazy`) gives a lazy train split
      and in-memory held-out arrays.

    Raises:
      ValueError: ``count`` is negative, not an integer, or leaves fewer training
        examples than one batch (one line with the largest allowed value).

    Example:
      >>> ds = me.data.synthetic(200, 20)
      >>> split = split_validation(ds, 50, seed=0, batch_size=32)
      >>> split.train.num_train + split.count == ds.num_train
      True
    """
    if isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 0:
        raise ValueError(
            f"validation={count!r} must be an integer >= 0 (training examples held out)"
        )
    n = dataset.num_train
    if n - int(count) < batch_size:
        raise ValueError(
            f"validation={count} leaves {n - int(count)} of the {n} training examples, fewer "
            f"than one batch (batch_size={batch_size}); use --validation "
            f"{max(n - batch_size, 0)} or less"
        )
    labels = dataset.y_train
    if count == 0:
        empty = np.zeros((0,), np.int64)
        return ValidationSplit(dataset, dataset.x_train[:0], labels[:0], empty, int(seed))
    indices = validation_indices(labels, int(count), seed, dataset.num_classes or 0)
    keep = np.ones(n, bool)
    keep[indices] = False
    x = dataset.x_train  # a lazy split stays lazy (an index-remapped view)
    train = dataclasses.replace(
        dataset,
        x_train=x.subset(keep) if getattr(x, "lazy", False) else x[keep],
        y_train=labels[keep],
    )
    return ValidationSplit(train, x[indices], labels[indices], indices, int(seed))
