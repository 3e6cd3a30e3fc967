"""Calibrating a regression ensemble's Gaussian predictions: the variance scale and the
conformal interval quantile.

Example:
  >>> val_mean, val_variance = np.zeros(20), np.full(20, 0.25)   # a model's Gaussians
  >>> val_y = np.linspace(-1.0, 1.0, 20)                          # the held-out targets
  >>> s = fit_variance_scale(val_mean, val_variance, val_y)
  >>> s > 1   # residuals wider than the predicted spread 0.5: intervals were too narrow
  True
  >>> q = conformal_interval_quantile(val_mean, np.sqrt(s * val_variance), val_y, alpha=0.1)
"""

from __future__ import annotations

import numpy as np
from jax.typing import ArrayLike

from meshensemble.calibration._checks import conformal_rank


def _regression_arrays(names: tuple[str, ...], *arrays: ArrayLike) -> list[np.ndarray]:
    """``arrays`` as float64 numpy of one shape, finite, non-empty; ValueError otherwise."""
    out = [np.asarray(a, np.float64) for a in arrays]
    for name, a in zip(names, out):
        if a.shape != out[0].shape:
            raise ValueError(
                f"{name} has shape {a.shape} but {names[0]} has {out[0].shape}; give one "
                "value per example (and target)"
            )
        if not np.all(np.isfinite(a)):
            raise ValueError(f"{name} holds non-finite values; give finite numbers")
    if out[0].size == 0:
        raise ValueError(f"{names[0]} is empty; give at least one validation example")
    if np.any(out[1] <= 0):
        raise ValueError(f"{names[1]} has values <= 0; give positive {names[1]}")
    return out


def fit_variance_scale(mean: ArrayLike, variance: ArrayLike, y: ArrayLike) -> float:
    """The factor ``s`` on the predicted variance that minimises the validation Gaussian NLL.

    The NLL of ``N(y; mean, s * variance)`` summed over the examples is minimised in
    closed form at ``s = mean((y - mean)^2 / variance)``. For an ensemble pass the
    mixture's mean and variance (``ens.predict``'s ``mean`` and ``variance``): the
    mixture is then treated as the Gaussian with its moments, and the calibrated
    prediction is ``N(mean, s * variance)``.

    Args:
      mean: ``[N]`` or ``[N, T]`` predicted means on a validation split.
      variance: the predicted variances, the shape of ``mean`` (positive).
      y: the targets, the shape of ``mean``.

    Returns:
      ``s > 0``, a python float (1: already calibrated; > 1: the intervals were too narrow).

    Raises:
      ValueError: shapes differ, empty, non-finite values, non-positive variances, or
        every residual is zero.

    Example:
      >>> me.calibration.fit_variance_scale([0.0, 0.0], [1.0, 1.0], [2.0, -2.0])
      4.0
    """
    m, v, t = _regression_arrays(("mean", "variance", "y"), mean, variance, y)
    s = float(np.mean((t - m) ** 2 / v))
    if s <= 0:
        raise ValueError("every residual y - mean is zero; the variance scale is undefined")
    return s


def conformal_interval_quantile(
    mean: ArrayLike, std: ArrayLike, y: ArrayLike, alpha: float
) -> float:
    """Split-conformal quantile ``q`` of normalised residuals: intervals ``mean +/- q * std``.

    The scores are ``|y - mean| / std`` on a calibration split of ``n`` examples (each
    target a score); ``q`` is the ``ceil((n + 1)(1 - alpha))``-th smallest (the
    finite-sample correction), ``inf`` when that exceeds ``n``. On a new example
    exchangeable with the calibration split, ``mean +/- q * std`` covers ``y`` with
    probability at least ``1 - alpha`` (Lei et al., 2018; Angelopoulos and Bates, 2021).

    Args:
      mean: ``[n]`` or ``[n, T]`` predicted means on the calibration split.
      std: predicted standard deviations, the shape of ``mean`` (positive), e.g.
        ``sqrt(ens.predict(...)["variance"])``.
      y: the targets, the shape of ``mean``.
      alpha: the miscoverage, in ``(0, 1)`` (0.1 for 90% intervals).

    Returns:
      ``q``, a python float (``inf`` if the split is too small for ``alpha``).

    Raises:
      ValueError: ``alpha`` outside ``(0, 1)``, shapes differ, empty, non-finite values or
        non-positive ``std``.

    Example:
      >>> mu_cal, sd_cal, y_cal = np.zeros(19), np.ones(19), np.arange(19.0) / 10
      >>> q = me.calibration.conformal_interval_quantile(mu_cal, sd_cal, y_cal, alpha=0.1)
      >>> round(q, 4)  # the ceil(0.9 * 20) = 18th smallest |y - mu| / sd
      1.7
      >>> mu_test, sd_test = np.zeros(3), np.ones(3)
      >>> lo, hi = mu_test - q * sd_test, mu_test + q * sd_test
    """
    if isinstance(alpha, bool) or not isinstance(alpha, int | float | np.floating):
        raise ValueError(f"alpha={alpha!r} must be a number in (0, 1), e.g. 0.1")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha!r} must be in (0, 1), e.g. 0.1 for 90% intervals")
    m, s, t = _regression_arrays(("mean", "std", "y"), mean, std, y)
    scores = np.sort((np.abs(t - m) / s).reshape(-1))
    k = conformal_rank(scores.size, float(alpha))
    return float("inf") if k > scores.size else float(scores[k - 1])
