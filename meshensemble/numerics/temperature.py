"""A temperature ``T`` applied to an ensemble's probabilities or logits, and its check.

The arithmetic that :meth:`meshensemble.Ensemble.predict` (``temperature=``) and a trained
run's predictor apply; fitting ``T`` is :mod:`meshensemble.calibration.temperature`.

Example:
  >>> t = check_temperature(1.5, num_members=2)
  >>> member_probs.shape                                        # [members, N, classes]
  (2, 32, 10)
  >>> mean_members(tempered(member_probs, jnp.asarray(t))).shape  # [N, classes]
  (32, 10)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshensemble.numerics import statmath


def check_temperature(temperature: Any, num_members: int) -> np.ndarray | None:
    """A temperature as float32 numpy (a scalar or one per member), or None.

    Args:
      temperature: None, one ``T > 0`` or ``[members]`` of them.
      num_members: the ensemble's members.

    Returns:
      float32 ``[]`` or ``[members]``, or None when ``temperature`` is None.

    Raises:
      ValueError: a shape other than ``[]``/``[members]``, or a value not finite and > 0.

    Example:
      >>> check_temperature([1.0, 2.0], num_members=2)
      array([1., 2.], dtype=float32)
    """
    if temperature is None:
        return None
    try:
        t = np.asarray(temperature, np.float32)
    except (TypeError, ValueError):
        raise ValueError(
            f"temperature {temperature!r} must be a number > 0 or [members] of them; pass "
            "the T that me.calibration.fit_temperature returned"
        ) from None
    if t.ndim not in (0, 1) or (t.ndim == 1 and t.shape[0] != num_members):
        raise ValueError(
            f"temperature of shape {t.shape} must be a scalar or [members] = "
            f"[{num_members}]; give one T or one per member"
        )
    if not np.all(np.isfinite(t)) or not np.all(t > 0):
        raise ValueError(f"temperature {t.tolist()} must be finite and > 0")
    return t


@jax.jit
def tempered(probs: jax.Array, t: jax.Array) -> jax.Array:
    """Probabilities at temperature ``T``: ``softmax(log max(p, eps) / T)``.

    Args:
      probs: ``[N, classes]`` or ``[members, N, classes]``.
      t: ``[]`` or ``[members]`` (with member probabilities).

    Returns:
      The tempered probabilities, the shape of ``probs``.

    Example:
      >>> np.round(np.asarray(tempered(jnp.array([[0.8, 0.2]]), jnp.float32(2.0))), 4)
      array([[0.6667, 0.3333]], dtype=float32)
      >>> tempered(member_probs, jnp.float32(1.5)).shape
      (2, 32, 10)
    """
    t = t[:, None, None] if t.ndim == 1 else t
    logits = statmath.clipped_log(probs)
    return jax.nn.softmax(logits / t.astype(probs.dtype), axis=-1)


@jax.jit
def divided(logits: jax.Array, t: jax.Array) -> jax.Array:
    """Logits at temperature ``T``: ``z / T``.

    Args:
      logits: ``[members, N, classes]``.
      t: ``[]`` or ``[members]``.

    Returns:
      ``logits / T``, the shape of ``logits``.

    Example:
      >>> divided(jnp.array([[[2.0, -1.0]]]), jnp.float32(2.0))
      Array([[[ 1. , -0.5]]], dtype=float32)
      >>> divided(member_logits, jnp.array([1.0, 2.0])).shape  # one T per member
      (2, 32, 10)
    """
    t = t[:, None, None] if t.ndim == 1 else t
    return logits / t.astype(logits.dtype)


@jax.jit
def mean_members(probs: jax.Array) -> jax.Array:
    """The ensemble's probabilities: the mean over the leading member axis.

    Args:
      probs: ``[members, N, classes]``.

    Returns:
      ``[N, classes]``.

    Example:
      >>> mean_members(jnp.array([[[0.9, 0.1]], [[0.5, 0.5]]]))
      Array([[0.7, 0.3]], dtype=float32)
      >>> mean_members(tempered(member_probs, jnp.float32(1.5))).shape
      (32, 10)
    """
    return jnp.mean(probs, axis=0)
