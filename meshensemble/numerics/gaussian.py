"""Gaussian arithmetic of regression members and their uniform mixture (pure, no collectives).

Each regression member predicts, per target, a Gaussian ``N(mu_m, sigma_m^2)``; the
ensemble is their uniform mixture ``p(y) = 1/M sum_m N(y; mu_m, sigma_m^2)``. The
functions here are the per-member, per-example pieces that :mod:`meshensemble.core.steps`
reduces over the ``ensemble`` axis and that :mod:`meshensemble.metrics.regression`
applies to whole member arrays; the finalisation of the streamed sums is here too.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import ndtr

LOG_2PI = math.log(2.0 * math.pi)

INTERVALS = (0.5, 0.9, 0.95)
"""Central interval levels whose coverage and width :meth:`Ensemble.evaluate` reports."""

QUANTILE_LEVELS = tuple(p for c in INTERVALS for p in ((1 - c) / 2, (1 + c) / 2))
"""The mixture quantiles that bound those intervals: 0.25, 0.75, 0.05, 0.95, 0.025, 0.975."""

CALIBRATION_LEVELS = tuple(round(0.05 * j, 2) for j in range(1, 20))
"""Expected confidence levels ``p_j`` of the quantile calibration error: 0.05, ..., 0.95."""

BISECTION_STEPS = 40
"""Halvings of the bracket in the mixture-quantile bisection (bracket / 2^40: float32 exact)."""

BRACKET_SDS = 10.0
"""The bisection's bracket: every member's ``mu +/- 10 sigma`` (the mixture CDF's 1e-23 tails)."""

SUM_KEYS = ("count", "nll", "squared_error", "absolute_error", "crps", "variance",
            "aleatoric", "epistemic", "covered", "width", "pit_below")  # fmt: skip
"""The sums one evaluation batch streams (see :func:`finalize`)."""


def log_density(mean: jax.Array, variance: jax.Array, y: jax.Array) -> jax.Array:
    """``log N(y; mean, variance)`` elementwise (shapes broadcast).

    Example:
      >>> log_density(jnp.zeros(1), jnp.ones(1), jnp.zeros(1))  # -log(2 pi) / 2
      Array([-0.9189385], dtype=float32)
    """
    return -0.5 * (LOG_2PI + jnp.log(variance) + (y - mean) ** 2 / variance)


def moments(outputs: jax.Array, min_variance: float) -> tuple[jax.Array, jax.Array]:
    """Means and variances from raw outputs ``[..., 2T]``: ``softplus(scale) + min_variance``.

    Returns:
      ``(mean [..., T], variance [..., T])``.
    """
    t = outputs.shape[-1] // 2
    return outputs[..., :t], jax.nn.softplus(outputs[..., t:]) + min_variance


def abs_moment(mean: jax.Array, variance: jax.Array) -> jax.Array:
    """``E|X|`` for ``X ~ N(mean, variance)``: ``2 s phi(mu/s) + mu (2 Phi(mu/s) - 1)``."""
    s = jnp.sqrt(variance)
    z = mean / s
    return 2.0 * s * jnp.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi) + mean * (2.0 * ndtr(z) - 1.0)


def cdf(mean: jax.Array, variance: jax.Array, y: jax.Array) -> jax.Array:
    """``Phi((y - mean) / sqrt(variance))`` elementwise."""
    return ndtr((y - mean) / jnp.sqrt(variance))


def pair_abs_sum(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> jax.Array:
    """``sum_{i, j} E|X_i - X'_j|`` over members ``i`` of ``a`` and ``j`` of ``b``.

    Args:
      a: ``(mean [m, ...], variance [m, ...])``.
      b: ``(mean [k, ...], variance [k, ...])``.

    Returns:
      ``[...]``: the sum over the ``m * k`` pairs of ``abs_moment(mu_i - mu_j, var_i + var_j)``.
    """
    d = a[0][:, None] - b[0][None]
    v = a[1][:, None] + b[1][None]
    return jnp.sum(abs_moment(d, v), axis=(0, 1))


def finalize(sums: dict[str, Any]) -> dict[str, float]:
    """The regression scores from the streamed sums of every batch (on the host).

    Args:
      sums: the dict of :data:`SUM_KEYS` summed over all batches (numpy).

    Returns:
      ``nll``, ``rmse``, ``mae``, ``crps``, ``coverage_50/90/95``, ``width_50/90/95``,
      ``quantile_calibration_error``, ``mean_variance``, ``aleatoric``, ``epistemic``
      (floats, averaged over examples and targets) and ``count`` (examples x targets).
    """
    s = {k: np.asarray(v, np.float64) for k, v in sums.items()}
    n = float(s["count"])
    out = {
        "nll": s["nll"] / n,
        "rmse": math.sqrt(s["squared_error"] / n),
        "mae": s["absolute_error"] / n,
        "crps": s["crps"] / n,
    }
    for i, c in enumerate(INTERVALS):
        out[f"coverage_{round(100 * c)}"] = s["covered"][i] / n
        out[f"width_{round(100 * c)}"] = s["width"][i] / n
    observed = s["pit_below"] / n
    out["quantile_calibration_error"] = float(
        np.mean((np.asarray(CALIBRATION_LEVELS) - observed) ** 2)
    )
    out["mean_variance"] = s["variance"] / n
    out["aleatoric"] = s["aleatoric"] / n
    out["epistemic"] = s["epistemic"] / n
    out = {k: float(v) for k, v in out.items()}
    out["count"] = int(round(n))
    return out
