"""Scores of a uniform Gaussian mixture from whole member arrays (host functions, numpy out).

The functions take each member's Gaussians, ``mean`` and ``variance`` of shape
``[members, N, T]`` (what ``ens.predict_members`` returns for a regression ensemble; one
model is ``[1, N, T]``), and targets ``y`` ``[N, T]`` (or ``[N]`` for ``T = 1``), and
return python floats averaged over examples and targets. They compute what
:meth:`meshensemble.Ensemble.evaluate` streams on the mesh (the same definitions, see
:mod:`meshensemble.numerics.gaussian` and docs/regression.md), for arrays already on the host:
models trained elsewhere, baselines, or a saved prediction.

For a regression ensemble, ``pm = me.distributed.fetch(ens.predict_members(state, x))``
gives ``pm["mean"]`` and ``pm["variance"]``; the example writes two members' Gaussians.

Example:
  >>> mean = np.array([[[0.0], [1.0]], [[0.2], [0.8]]])      # [members=2, N=2, T=1]
  >>> variance = np.full_like(mean, 0.1)
  >>> s = me.metrics.regression.scores(mean, variance, np.array([0.1, 0.9]))
  >>> round(s["rmse"], 4), round(s["epistemic"], 4), s["count"]
  (0.0, 0.01, 2)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp

from meshensemble.numerics import gaussian

__all__ = ["mixture_nll", "mixture_crps", "mixture_quantiles", "scores"]


def _arrays(mean: Any, variance: Any, y: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``[M, N, T]`` float64 member arrays and ``[N, T]`` targets; ValueError otherwise."""
    m, v = np.asarray(mean, np.float64), np.asarray(variance, np.float64)
    t = np.asarray(y, np.float64)
    t = t[:, None] if t.ndim == 1 else t
    if m.ndim != 3 or m.shape != v.shape or m.shape[1:] != t.shape:
        raise ValueError(
            f"mean {m.shape}, variance {v.shape} and y {t.shape} must be [members, N, T], "
            "[members, N, T] and [N, T] (or [N] for one target)"
        )
    if m.size == 0 or np.any(v <= 0) or not np.all(np.isfinite(v)):
        raise ValueError("give at least one example and finite variances > 0")
    return m, v, t


def mixture_nll(mean: Any, variance: Any, y: Any) -> float:
    """The mixture's NLL ``-log (1/M sum_m N(y; mu_m, var_m))``, a log-sum-exp over members.

    Args:
      mean: ``[members, N, T]`` member means; variance: the same shape, > 0.
      y: ``[N, T]`` or ``[N]`` targets.

    Returns:
      The mean over examples and targets (nats).

    Raises:
      ValueError: shapes that do not match, or non-positive variances.
    """
    m, v, t = _arrays(mean, variance, y)
    log_p = np.asarray(gaussian.log_density(m, v, t[None]))
    return float(-np.mean(logsumexp(log_p, axis=0) - math.log(m.shape[0])))


def mixture_crps(mean: Any, variance: Any, y: Any) -> float:
    """The mixture's CRPS, closed form: ``E|X - y| - E|X - X'| / 2`` (see docs/regression.md).

    Args:
      mean: ``[members, N, T]``; variance: the same shape; y: ``[N, T]`` or ``[N]``.

    Returns:
      The mean over examples and targets, in the units of ``y``.
    """
    m, v, t = _arrays(mean, variance, y)
    to_y = np.mean(np.asarray(gaussian.abs_moment(t[None] - m, v)), axis=0)
    pairs = np.asarray(gaussian.pair_abs_sum((m, v), (m, v))) / m.shape[0] ** 2
    return float(np.mean(to_y - 0.5 * pairs))


@jax.jit
def _bisect(mean: jax.Array, variance: jax.Array, p: jax.Array) -> jax.Array:
    sd = jnp.sqrt(variance)
    lo = jnp.min(mean - gaussian.BRACKET_SDS * sd, 0)[..., None] + 0 * p
    hi = jnp.max(mean + gaussian.BRACKET_SDS * sd, 0)[..., None] + 0 * p

    def halve(_, bracket):
        lo, hi = bracket
        mid = 0.5 * (lo + hi)
        below = jnp.mean(gaussian.cdf(mean[..., None], variance[..., None], mid[None]), 0) < p
        return jnp.where(below, mid, lo), jnp.where(below, hi, mid)

    lo, hi = jax.lax.fori_loop(0, gaussian.BISECTION_STEPS, halve, (lo, hi))
    return 0.5 * (lo + hi)


def mixture_quantiles(mean: Any, variance: Any, levels: Any) -> np.ndarray:
    """The mixture's quantiles by bisection on its CDF (as ``evaluate`` computes them).

    Args:
      mean: ``[members, N, T]``; variance: the same shape.
      levels: ``[K]`` probabilities in ``(0, 1)``.

    Returns:
      ``[N, T, K]`` quantiles (float32).

    Raises:
      ValueError: a level outside ``(0, 1)``.
    """
    p = np.asarray(levels, np.float32).reshape(-1)
    if not np.all((p > 0) & (p < 1)):
        raise ValueError(f"levels {p.tolist()} must lie in (0, 1)")
    m = np.asarray(mean, np.float32)
    p = p.reshape((1,) * (m.ndim - 1) + (-1,))
    return np.asarray(_bisect(m, np.asarray(variance, np.float32), p))


def scores(mean: Any, variance: Any, y: Any) -> dict[str, float]:
    """Every score :meth:`meshensemble.Ensemble.evaluate` reports, from member arrays.

    Args:
      mean: ``[members, N, T]``; variance: the same shape; y: ``[N, T]`` or ``[N]``.

    Returns:
      ``nll``, ``rmse``, ``mae``, ``crps``, ``coverage_50/90/95``, ``width_50/90/95``,
      ``quantile_calibration_error`` (Kuleshov et al., 2018), ``mean_variance``,
      ``aleatoric``, ``epistemic`` and ``count``.

    Example:
      >>> mu, var, y = np.zeros((2, 1)), np.ones((2, 1)), np.zeros(2)
      >>> s = me.metrics.regression.scores(np.stack([mu, mu]), np.stack([var, var]), y)
      >>> round(s["nll"], 4), s["coverage_90"], round(s["epistemic"], 4)  # members agree
      (0.9189, 1.0, 0.0)
    """
    m, v, t = _arrays(mean, variance, y)
    mix = m.mean(0)
    q = mixture_quantiles(m, v, gaussian.QUANTILE_LEVELS)
    pit = np.asarray(gaussian.cdf(m, v, t[None])).mean(0)
    epistemic = ((m - mix[None]) ** 2).mean(0)
    sums = {
        "count": t.size,
        "nll": mixture_nll(m, v, t) * t.size,
        "squared_error": np.sum((mix - t) ** 2),
        "absolute_error": np.sum(np.abs(mix - t)),
        "crps": mixture_crps(m, v, t) * t.size,
        "variance": np.sum(v.mean(0) + epistemic),
        "aleatoric": np.sum(v.mean(0)),
        "epistemic": np.sum(epistemic),
        "covered": np.sum((q[..., 0::2] <= t[..., None]) & (t[..., None] <= q[..., 1::2]), (0, 1)),
        "width": np.sum(q[..., 1::2] - q[..., 0::2], axis=(0, 1)),
        "pit_below": np.sum(pit[..., None] <= np.asarray(gaussian.CALIBRATION_LEVELS), (0, 1)),
    }
    return gaussian.finalize(sums)
