"""Small pieces of :class:`meshensemble.Ensemble`'s prediction and evaluation.

Temperatures (checked on the host, applied on device), the members' mean, the output
specs of the evaluation program, and the checks of an evaluation set. Kept apart so that
``core/ensemble.py`` stays a readable size.

Example:
  >>> t = check_temperature(2.0, num_members=8)
  >>> probs = tempered(member_probs, jnp.asarray(t))
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from meshensemble.core import inputs, statmath, stats
from meshensemble.core.mesh import BATCH, MEMBERS, REPLICATED


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


def check_eval_set(images: Any, labels: Any) -> tuple[Any, np.ndarray, int]:
    """Checks an evaluation set: one integer label per image, at least one image.

    Args:
      images: ``[N, ...]`` (numpy, a list or a ``jax.Array``).
      labels: ``[N]`` integer class indices.

    Returns:
      ``(images, labels, N)``: the images as an array, the labels as numpy.

    Raises:
      ValueError: no example, lengths differ, or labels that are not integers.

    Example:
      >>> images, labels, n = check_eval_set(test_images, test_labels)
    """
    images, labels = inputs.as_array(images, "images"), np.asarray(labels)
    n = int(np.shape(images)[0]) if np.ndim(images) else 0
    if labels.shape != (n,) or n == 0:
        raise ValueError(
            f"images of shape {np.shape(images)} and labels of shape {labels.shape}: "
            "give one integer label per image and at least one image"
        )
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"labels have dtype {labels.dtype}; give integer class indices")
    return images, labels, n


def eval_specs() -> tuple[dict[str, P], dict[str, P]]:
    """Output specs of :func:`meshensemble.core.steps.eval_stats`.

    Returns:
      ``(sums, per_example)``: per-member sums split over ``ensemble``, ensemble sums
      replicated; the per-example values ``[B]`` split over ``data``.

    Example:
      >>> sums, per_example = eval_specs()
    """
    names = stats.MEMBER_STAT_KEYS + stats.ENSEMBLE_STAT_KEYS
    sums = {k: (MEMBERS if k.startswith("member_") else REPLICATED) for k in names}
    return sums, {k: BATCH for k in stats.EXAMPLE_STAT_KEYS}


@jax.jit
def tempered(probs: jax.Array, t: jax.Array) -> jax.Array:
    """Probabilities at temperature ``T``: ``softmax(log max(p, eps) / T)``.

    Args:
      probs: ``[N, classes]`` or ``[members, N, classes]``.
      t: ``[]`` or ``[members]`` (with member probabilities).

    Returns:
      The tempered probabilities, the shape of ``probs``.

    Example:
      >>> tempered(member_probs, jnp.float32(1.5))
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
      >>> divided(member_logits, jnp.float32(2.0))
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
      >>> mean_members(tempered(member_probs, t))
    """
    return jnp.mean(probs, axis=0)
