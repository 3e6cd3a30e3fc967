"""Per-example classification metrics of one model: accuracy, NLL and Brier score.

Each takes probabilities `[N, classes]`, integer labels `[N]` and an optional mask `[N]`,
and returns the mean over masked-in examples (conventions: :mod:`meshensemble.metrics`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from meshensemble.numerics import statmath


def _wmean(x: jax.Array, w: jax.Array) -> jax.Array:
    """``sum(w * x) / sum(w)`` over the last axis."""
    return statmath.wsum(x, w) / jnp.sum(w, axis=-1)


def accuracy(probs: ArrayLike, labels: ArrayLike, mask: ArrayLike | None = None) -> jax.Array:
    """Fraction of (masked-in) examples whose argmax class equals the label.

    ``accuracy = sum_i w_i 1[argmax_c p_ic == y_i] / sum_i w_i``; ties in the argmax go to the
    lowest class index.

    Args:
      probs: `[N, classes]` predicted probabilities.
      labels: `[N]` integer class indices.
      mask: optional `[N]` bools or 0/1 weights; only masked-in examples count.

    Returns:
      Scalar `[]` accuracy in ``[0, 1]`` (``nan`` if no example is masked in).

    Raises:
      ValueError: if the shapes are not `[N, classes]`, `[N]`, `[N]`.

    Example:
      >>> float(accuracy([[0.9, 0.1], [0.3, 0.7]], [0, 0]))
      0.5
    """
    return _accuracy_core(*statmath.check_basic(probs, labels, mask))


@jax.jit
def _accuracy_core(probs: Any, labels: Any, mask: Any) -> jax.Array:
    probs = statmath.as_float(probs)
    w = statmath.weights(mask, probs.shape[0], probs.dtype)
    pred = jnp.argmax(probs, axis=-1)
    return _wmean((pred == labels).astype(probs.dtype), w)


def nll(probs: ArrayLike, labels: ArrayLike, mask: ArrayLike | None = None) -> jax.Array:
    """Mean negative log-likelihood of the labels.

    ``nll = sum_i w_i * -log(max(p_{i, y_i}, eps)) / sum_i w_i`` with ``eps = EPS = 1e-12``
    (``finfo(dtype).tiny`` if larger), so a zero probability on the label gives a finite
    ``-log(eps)`` instead of ``inf``.

    Args:
      probs: `[N, classes]` predicted probabilities.
      labels: `[N]` integer class indices.
      mask: optional `[N]` bools or 0/1 weights; only masked-in examples count.

    Returns:
      Scalar `[]` mean NLL in nats (``nan`` if no example is masked in).

    Raises:
      ValueError: if the shapes are not `[N, classes]`, `[N]`, `[N]`.

    Example:
      >>> round(float(nll([[0.5, 0.5], [1.0, 0.0]], [0, 0])), 4)
      0.3466
    """
    return _nll_core(*statmath.check_basic(probs, labels, mask))


@jax.jit
def _nll_core(probs: Any, labels: Any, mask: Any) -> jax.Array:
    probs = statmath.as_float(probs)
    w = statmath.weights(mask, probs.shape[0], probs.dtype)
    true_p = jnp.sum(probs * statmath.onehot(labels, probs.shape, probs.dtype), axis=-1)
    return _wmean(-jnp.log(jnp.maximum(true_p, statmath.nll_clip(probs.dtype))), w)


def brier(probs: ArrayLike, labels: ArrayLike, mask: ArrayLike | None = None) -> jax.Array:
    """Mean Brier score, summed over classes (not divided by the number of classes).

    ``brier = sum_i w_i * sum_c (p_ic - 1[c == y_i])^2 / sum_i w_i``, in ``[0, 2]``.

    Args:
      probs: `[N, classes]` predicted probabilities.
      labels: `[N]` integer class indices.
      mask: optional `[N]` bools or 0/1 weights; only masked-in examples count.

    Returns:
      Scalar `[]` mean Brier score (``nan`` if no example is masked in).

    Raises:
      ValueError: if the shapes are not `[N, classes]`, `[N]`, `[N]`.

    Example:
      >>> round(float(brier([[0.5, 0.5], [1.0, 0.0]], [0, 0])), 4)
      0.25
    """
    return _brier_core(*statmath.check_basic(probs, labels, mask))


@jax.jit
def _brier_core(probs: Any, labels: Any, mask: Any) -> jax.Array:
    probs = statmath.as_float(probs)
    w = statmath.weights(mask, probs.shape[0], probs.dtype)
    sq = jnp.sum(jnp.square(probs - statmath.onehot(labels, probs.shape, probs.dtype)), axis=-1)
    return _wmean(sq, w)
