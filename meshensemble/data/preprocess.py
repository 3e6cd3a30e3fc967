"""Preprocessing that follows the data: per-channel (or per-feature) standardisation.

:func:`fit_normalization` computes, from the TRAINING split only, the mean and standard
deviation of every channel of images ``[N, H, W, C]`` (or every feature of a table
``[N, F]``: the last axis either way), after scaling integer pixels to ``[0, 1]``. The
result, a :class:`Normalization`, is a small record (:meth:`Normalization.record`, JSON
for ``config.json``) that a run stores and that ``predict`` and an exported artifact
apply to raw inputs later (:meth:`Normalization.from_record`, :meth:`Normalization.apply`,
pure and jit-able: ``(x * scale - mean) / std`` over the last axis).

Example:
  >>> x = np.random.default_rng(0).integers(0, 256, (100, 8, 8, 3), dtype=np.uint8)
  >>> norm = fit_normalization(x)
  >>> len(norm.mean), norm.scale == 1 / 255
  (3, True)
  >>> y = norm.apply(x)                      # float32, mean ~0 and std ~1 per channel
  >>> np.allclose(np.asarray(y).mean((0, 1, 2)), 0, atol=1e-5)
  True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshensemble.data.dataset import DataError

NORMALIZATION_KIND = "standardize_last_axis"
"""The ``kind`` a :meth:`Normalization.record` carries (what :meth:`Normalization.apply` does)."""
CHUNK = 4096
"""Examples summed at a time by :func:`fit_normalization` (float64 sums, bounded memory)."""


@dataclasses.dataclass(frozen=True)
class Normalization:
    """``(x * scale - mean) / std`` over the last axis (channels, or tabular features).

    Attributes:
      mean: per channel / feature, in scaled units (a tuple of floats).
      std: per channel / feature (a tuple of floats, each > 0).
      scale: multiplies the raw inputs first: ``1 / 255`` for uint8 pixels, 1 for floats.

    Example:
      >>> norm = Normalization(mean=(0.5,), std=(0.25,), scale=1 / 255)
      >>> float(norm.apply(np.full((1, 2, 2, 1), 255, np.uint8))[0, 0, 0, 0])
      2.0
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]
    scale: float = 1.0

    def apply(self, x: Any) -> jax.Array:
        """Normalises raw inputs ``[..., D]``; pure and jit-able (inside an artifact too).

        Args:
          x: raw features whose last axis has ``len(mean)`` entries (any numeric dtype).

        Returns:
          float32 ``[..., D]``.

        Raises:
          ValueError: the last axis has another size (at trace time).

        Example:
          >>> Normalization((1.0, 2.0), (2.0, 4.0)).apply(np.array([[3.0, 2.0]])).tolist()
          [[1.0, 0.0]]
        """
        x = jnp.asarray(x)
        if x.shape[-1] != len(self.mean):
            raise ValueError(
                f"normalization of {len(self.mean)} channels got inputs of shape {x.shape}; "
                f"their last axis must have {len(self.mean)} entries"
            )
        row = (1,) * (x.ndim - 1) + (len(self.mean),)  # [D] over [..., D], ranks explicit
        mean = jnp.asarray(self.mean, jnp.float32).reshape(row)
        std = jnp.asarray(self.std, jnp.float32).reshape(row)
        return (x.astype(jnp.float32) * jnp.float32(self.scale) - mean) / std

    def record(self) -> dict[str, Any]:
        """The JSON record a run stores (``config.json``) and :meth:`from_record` reads.

        Returns:
          ``{"kind", "mean", "std", "scale"}``.

        Example:
          >>> Normalization((0.5,), (0.25,)).record()["kind"]
          'standardize_last_axis'
        """
        return {
            "kind": NORMALIZATION_KIND,
            "mean": [float(v) for v in self.mean],
            "std": [float(v) for v in self.std],
            "scale": float(self.scale),
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Normalization:
        """The normalisation a :meth:`record` describes.

        Args:
          record: ``{"kind", "mean", "std", "scale"}``.

        Returns:
          A :class:`Normalization`.

        Raises:
          DataError: another kind, or a malformed record (one line naming it).

        Example:
          >>> n = Normalization((0.5, 0.1), (0.2, 0.3), 1 / 255)
          >>> Normalization.from_record(n.record()) == n
          True
        """
        try:
            if record["kind"] != NORMALIZATION_KIND:
                raise ValueError(f"kind {record['kind']!r} is not {NORMALIZATION_KIND!r}")
            mean = tuple(float(v) for v in record["mean"])
            std = tuple(float(v) for v in record["std"])
            scale = float(record["scale"])
            if len(mean) != len(std) or not mean or min(std) <= 0:
                raise ValueError("mean and std need one entry each per channel, std > 0")
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(f"normalization record {dict(record)!r}: {err}") from None
        return cls(mean, std, scale)


def fit_normalization(
    x_train: Any, scale: float | None = None, min_std: float = 1e-6
) -> Normalization:
    """Per-channel (last axis) mean and standard deviation of the training features.

    Sums in float64 over chunks of :data:`CHUNK` examples, so a CIFAR-sized split never
    needs a float copy of itself. A constant channel gets std 1 (it is only centred).

    Args:
      x_train: the TRAINING split only, ``[N, ..., D]`` (images ``[N, H, W, C]`` or a
        table ``[N, F]``); a lazy split is read a chunk at a time.
      scale: multiplies the raw values first; default ``1 / 255`` for integer pixels,
        else 1.
      min_std: a standard deviation below this counts as a constant channel.

    Returns:
      A :class:`Normalization` with ``D`` means and standard deviations.

    Raises:
      DataError: no examples, a non-numeric dtype, or non-finite values.

    Example:
      >>> fit_normalization(np.array([[0.0, 10.0], [2.0, 10.0]])).std
      (1.0, 1.0)
    """
    n = len(x_train)
    dtype = np.dtype(x_train.dtype)
    if n == 0 or not np.issubdtype(dtype, np.number):
        raise DataError(
            f"fit_normalization: features of shape {tuple(x_train.shape)} and dtype {dtype}; "
            "expected at least one example of numbers [N, ..., D]"
        )
    if scale is None:
        scale = 1 / 255 if np.issubdtype(dtype, np.integer) else 1.0
    depth = int(x_train.shape[-1])
    total, squares, count = np.zeros(depth), np.zeros(depth), 0
    for start in range(0, n, CHUNK):
        chunk = np.asarray(x_train[start : start + CHUNK], np.float64).reshape(-1, depth) * scale
        total += chunk.sum(0)
        squares += np.square(chunk).sum(0)
        count += chunk.shape[0]
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - np.square(mean), 0.0))
    if not (np.isfinite(mean).all() and np.isfinite(std).all()):
        raise DataError("fit_normalization: the features hold NaN or inf; clean them first")
    std = np.where(std < min_std, 1.0, std)
    return Normalization(tuple(mean.tolist()), tuple(std.tolist()), float(scale))


def standardize_features(
    x_train: Any, x_test: Any, norm: Normalization | None = None
) -> tuple[np.ndarray, np.ndarray, Normalization]:
    """Tabular standardisation: both splits by the training split's per-feature statistics.

    Args:
      x_train: training features ``[N, F]``.
      x_test: test features ``[M, F]``.
      norm: statistics to use (default :func:`fit_normalization` of ``x_train``).

    Returns:
      ``(x_train, x_test, norm)``: float32 standardised features and the statistics (store
      ``norm.record()`` to apply the same to new inputs).

    Example:
      >>> a, b, norm = standardize_features(np.array([[1.0], [3.0]]), np.array([[5.0]]))
      >>> a.ravel().tolist(), b.ravel().tolist()
      ([-1.0, 1.0], [3.0])
    """
    norm = norm or fit_normalization(x_train)
    return np.asarray(norm.apply(x_train)), np.asarray(norm.apply(x_test)), norm
