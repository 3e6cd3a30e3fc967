"""Temperature scaling (Guo et al. 2017): the ensemble's logits, fitting one ``T`` (or one
per member) on held-out labels, applying it.

Example:
  >>> logits = ensemble_logits(val_member_probs)      # [N, C]
  >>> t = fit_temperature(logits, val_labels)
  >>> calibrated = apply_temperature(logits, t)
  >>> logits.shape, calibrated.shape
  ((16, 10), (16, 10))
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from meshensemble.calibration import _rows as calibmath
from meshensemble.calibration._checks import GRID, check_labels, temperature_array
from meshensemble.numerics import statmath

# --------------------------------------------------------------------------- temperature


def ensemble_logits(member_probs: ArrayLike) -> jax.Array:
    """Logits of an ensemble's prediction: ``log(max(mean_m p^m, eps))``, for "pool, then
    calibrate".

    ``softmax`` of these logits is the ensemble's mean probability again (for normalised
    rows), so ``fit_temperature(ensemble_logits(member_probs), labels)`` fits the temperature
    of the ensemble's own prediction. ``eps`` = :data:`meshensemble.metrics.EPS` keeps
    zeros finite.

    Args:
      member_probs: `[members, N, classes]` member probabilities.

    Returns:
      `[N, classes]` logits (a jax array, sharded like the input's ``N`` axis).

    Raises:
      ValueError: if ``member_probs`` is not 3-D.

    Example:
      >>> z = ensemble_logits(np.array([[[0.9, 0.1]], [[0.5, 0.5]]]))
      >>> np.round(np.exp(np.asarray(z)), 4)
      array([[0.7, 0.3]], dtype=float32)
    """
    return _ensemble_logits_core(calibmath.check_rows(member_probs, 3, "member_probs", True))


@jax.jit
def _ensemble_logits_core(member_probs: Any) -> jax.Array:
    return statmath.clipped_log(jnp.mean(statmath.as_float(member_probs), axis=0))


def apply_temperature(logits: ArrayLike, temperature: ArrayLike) -> jax.Array:
    """Calibrated probabilities ``softmax(logits / T)``.

    Args:
      logits: `[..., classes]` logits, e.g. `[N, C]`, or member logits `[members, N, C]`.
      temperature: ``T > 0``: a scalar, or `[members]` (one per member) for
        `[members, N, C]` logits (as ``fit_temperature(..., per_member=True)`` returns).

    Returns:
      Probabilities of the shape of ``logits``.

    Raises:
      ValueError: if ``temperature`` has a shape other than those.

    Example:
      >>> np.round(np.asarray(apply_temperature([[2.0, 0.0]], 2.0)), 4)
      array([[0.7311, 0.2689]], dtype=float32)
    """
    logits = statmath.as_float(calibmath.check_rows(logits, None, "logits", False))
    return _apply_core(logits, temperature_array(temperature, logits))


@jax.jit
def _apply_core(logits: jax.Array, t: jax.Array) -> jax.Array:
    return jax.nn.softmax(logits / t.astype(logits.dtype), axis=-1)


def apply_temperature_to_probs(probs: ArrayLike, temperature: ArrayLike) -> jax.Array:
    """Temperature-scaled probabilities from probabilities: ``softmax(log max(p, eps) / T)``.

    Equal to ``p^(1/T)`` renormalised; use it when only probabilities are at hand (e.g.
    an ensemble's mean probability, where it equals
    ``apply_temperature(ensemble_logits(member_probs), T)``).

    Args:
      probs: `[..., classes]` probabilities.
      temperature: ``T > 0``: a scalar, or `[members]` for `[members, N, C]` input.

    Returns:
      Probabilities of the shape of ``probs``.

    Raises:
      ValueError: if ``temperature`` has a shape other than those.

    Example:
      >>> np.round(np.asarray(apply_temperature_to_probs([[0.8, 0.2]], 0.5)), 4)
      array([[0.9412, 0.0588]], dtype=float32)
    """
    probs = statmath.as_float(calibmath.check_rows(probs, None, "probs", True))
    return _apply_core(statmath.clipped_log(probs), temperature_array(temperature, probs))


def fit_temperature(
    logits: ArrayLike,
    labels: ArrayLike,
    per_member: bool = False,
    bounds: tuple[float, float] = (1e-3, 1e3),
    rtol: float = 1e-6,
    at_bound: str = "raise",
) -> float | np.ndarray:
    """The temperature ``T > 0`` that minimises the NLL of ``softmax(logits / T)``.

    ``NLL(T) = mean_i [logsumexp_c(z_ic / T) - z_{i,y_i} / T]`` is convex in ``beta = 1 / T``
    with derivative ``g(beta) = mean_i sum_c softmax(beta z_i)_c (z_ic - z_{i,y_i})``, which
    increases with ``beta``. The search brackets the root of ``g`` on ``log T`` inside
    ``bounds`` and narrows the bracket by evaluating ``g`` at 15 points per round (one
    device call each, only those 15 scalars come back) until it is narrower than
    ``rtol / 4`` in ``log T``, and returns its middle: 7 rounds for ``rtol=1e-6``. The
    derivative is computed from differences ``z_ic - z_{i,y_i}`` (no cancellation of large
    logits), so float32 logits give ``T`` to about ``1e-5`` relative or better.

    For an ensemble, fit on :func:`ensemble_logits` ("pool, then calibrate": the
    temperature of the ensemble's prediction); ``per_member=True`` fits each member's own.
    When the NLL still decreases at a bound, no temperature in ``bounds`` fits: at the
    lower bound every held-out example is right (sharper is then always better, and the
    bound would make every test mistake a confident one), at the upper bound the logits
    rank the labels worse than chance. Such a bound is refused (``at_bound="raise"``, the
    default), or returned with a warning (``at_bound="warn"``, for a caller that decides
    itself). On a model with error rate ``e`` a split of ``n`` examples is all right with
    probability ``(1 - e)^n``: hold out at least ``5 / e`` (500 for a 99% model).

    Args:
      logits: `[N, classes]` logits (numpy or jax, possibly a global array sharded over a
        mesh), or `[members, N, classes]` with ``per_member=True``.
      labels: `[N]` integer class indices.
      per_member: fit one temperature per member of `[members, N, classes]` logits.
      bounds: ``(lo, hi)`` the range searched, ``0 < lo < hi``.
      rtol: relative precision of ``T``.
      at_bound: ``"raise"`` or ``"warn"``: what a temperature at a bound does.

    Returns:
      ``T`` as a python float, or a float64 numpy array `[members]` with ``per_member``.

    Raises:
      ValueError: if the shapes, labels, bounds or ``rtol`` are invalid, the logits are
        empty or not finite, or (``at_bound="raise"``) the NLL still decreases at a bound.

    Example:
      >>> t = fit_temperature(val_logits, val_labels)
      >>> calibrated = apply_temperature(test_logits, t)
      >>> type(t), calibrated.shape
      (<class 'float'>, (16, 10))
      >>> member_logits_val = jnp.log(val_member_probs)                 # [members, N, C]
      >>> fit_temperature(member_logits_val, val_labels, per_member=True).shape
      (2,)
    """
    logits = calibmath.check_rows(logits, 3 if per_member else 2, "logits", False)
    member_logits = logits if per_member else logits[None]
    _, n, c = member_logits.shape
    labels = check_labels(labels, n, c)
    lo, hi = (float(b) for b in bounds)
    if not 0.0 < lo < hi or not math.isfinite(hi):
        raise ValueError(f"`bounds` must be (lo, hi) with 0 < lo < hi < inf, got {bounds!r}.")
    if not 0.0 < rtol < 1.0:
        raise ValueError(f"`rtol` must lie in (0, 1), got {rtol!r}.")
    if at_bound not in ("raise", "warn"):
        raise ValueError(f"`at_bound` must be 'raise' or 'warn', got {at_bound!r}.")

    def g(log_t: np.ndarray) -> np.ndarray:  # [M, K] log-temperatures -> [M, K] derivatives
        return np.asarray(jax.device_get(_dnll_dbeta(member_logits, labels, np.exp(-log_t))))

    m = member_logits.shape[0]
    a = np.full(m, math.log(lo))
    b = np.full(m, math.log(hi))
    ga, gb = g(np.stack([a, b], axis=1)).T  # g > 0 at small T (too sharp), < 0 at large T
    at_lo, at_hi = ga <= 0, gb >= 0
    calibmath.refuse_temperature_bound(at_lo, at_hi, lo, hi, n, at_bound)
    while np.max(b - a) > math.log1p(rtol) / 4:
        grid = a[:, None] + (b - a)[:, None] * np.arange(1, GRID + 1) / (GRID + 1)
        vals = g(grid)
        # the last grid point where g > 0 starts the new bracket; g decreases along log T
        pos = vals > 0
        k = pos.sum(axis=1)  # points with g > 0 come first
        pts = np.concatenate([a[:, None], grid, b[:, None]], axis=1)
        gs = np.concatenate([ga[:, None], vals, gb[:, None]], axis=1)
        rows = np.arange(m)
        a, ga = pts[rows, k], gs[rows, k]
        b, gb = pts[rows, k + 1], gs[rows, k + 1]
    t = np.exp((a + b) / 2)
    t = np.where(at_lo, lo, np.where(at_hi, hi, t))
    return t if per_member else float(t[0])


@jax.jit
def _dnll_dbeta(member_logits: Any, labels: Any, betas: Any) -> jax.Array:
    """``d NLL / d beta`` of each member at each ``beta``: `[M, K]` for ``betas`` `[M, K]`."""
    z = statmath.as_float(member_logits)  # [M, N, C]
    z_true = jnp.take_along_axis(z, labels[None, :, None], axis=-1)  # [M, N, 1]
    diff = z - z_true  # [M, N, C], no cancellation of large logits

    def one(beta: jax.Array) -> jax.Array:  # beta [M] -> [M]
        p = jax.nn.softmax(beta.astype(z.dtype)[:, None, None] * z, axis=-1)
        return jnp.mean(jnp.sum(p * diff, axis=-1), axis=-1)

    # lax.map: one [M, N, C] softmax at a time, not K of them at once.
    return jax.lax.map(one, jnp.asarray(betas).T).T


# --------------------------------------------------------------------------- conformal
