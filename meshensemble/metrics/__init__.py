"""Metrics for classifiers and deep ensembles: accuracy, NLL, Brier, calibration, uncertainty, OOD.

Conventions used throughout:

* Probabilities are ``[N, classes]`` (one model) or ``[members, N, classes]`` (an ensemble);
  rows are assumed to be normalised. The ensemble prediction is the mean of the member
  probabilities over members.
* Labels are integer class indices ``[N]``.
* ``mask`` is an optional ``[N]`` array of bools or 0/1 weights: only masked-in examples count,
  and averages are over masked-in examples (``sum(w * x) / sum(w)``). With no masked-in
  example an average is ``0 / 0 = nan``. Masked-out examples contribute exactly 0, even when
  their probabilities are NaN or garbage (padding).
* The prediction of a model is ``argmax`` over classes; on exact ties the lowest class index
  wins (``jnp.argmax``).
* Logs are natural logs. Where ``log(0)`` could occur (only the NLL), the probability is
  clipped from below at :data:`EPS` (``1e-12``; or ``jnp.finfo(dtype).tiny`` for dtypes where
  that is larger, e.g. float16), so a zero probability on the true class gives a large but
  finite NLL (``-log(1e-12) ~= 27.63``). Entropies use ``0 log 0 = 0`` and need no clip.
* The Brier score is the SUM over classes of ``(p - onehot)^2`` (in ``[0, 2]``), averaged over
  examples; it is not divided by the number of classes.
* Calibration uses ``num_bins`` equal-width bins on the confidence (the max probability) in
  ``[0, 1]``: bin ``b`` holds ``b / B <= conf < (b + 1) / B``, with a confidence of exactly
  ``1.0`` in the last bin (the index is ``clip(floor(conf * B), 0, B - 1)``).

Everything except :func:`auroc`, :func:`aupr`, :func:`reliability_diagram_data`,
:func:`ensemble_metrics` and :func:`finalize_stats` is written with ``jax.numpy`` and works on
numpy or jax input, under ``jit`` and inside ``shard_map`` (shape checks run at trace time; each
is jitted internally, so an eager call compiles once per input shape); those five are host
functions that return numpy arrays or python floats.

The streaming pair :func:`streaming_stats` / :func:`finalize_stats` lets a sharded evaluation
reduce per-shard SUMS with collectives (``psum`` over ``data``; the ``member_`` sums are
concatenated over ``ensemble``) and never gather ``[members, N, classes]`` to one place.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

__all__ = [
    "EPS",
    "OOD_KINDS",
    "accuracy",
    "aupr",
    "auroc",
    "brier",
    "calibration_bins",
    "disagreement",
    "ece",
    "ece_from_bins",
    "ensemble_metrics",
    "entropy",
    "ENSEMBLE_STAT_KEYS",
    "MEMBER_STAT_KEYS",
    "expected_entropy",
    "finalize_stats",
    "mutual_information",
    "nll",
    "ood_score",
    "prefix_metrics",
    "reliability_diagram_data",
    "reliability_from_bins",
    "streaming_stats",
]

EPS = 1e-12
"""Lower clip on the true-class probability in the NLL, so that ``log(0)`` never occurs."""

OOD_KINDS = ("max_prob", "entropy", "mutual_information")
"""The ``kind`` values that :func:`ood_score` accepts."""

MEMBER_STAT_KEYS = (
    "member_correct",
    "member_nll",
    "member_brier",
    "member_entropy",
    "member_disagree",
    "member_bin_count",
    "member_bin_conf",
    "member_bin_correct",
)
ENSEMBLE_STAT_KEYS = (
    "ensemble_correct",
    "ensemble_nll",
    "ensemble_brier",
    "ensemble_entropy",
    "ensemble_bin_count",
    "ensemble_bin_conf",
    "ensemble_bin_correct",
    "count",
)


# --------------------------------------------------------------------------- helpers


def _as_float(x: Any) -> jax.Array:
    """``x`` as a jax array of a floating dtype (integers become the default float)."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.result_type(float))
    return x


def _eps(dtype: Any) -> float:
    """The NLL clip for ``dtype``: ``max(EPS, finfo(dtype).tiny)``."""
    return max(EPS, float(jnp.finfo(dtype).tiny))


def _arr(x: Any) -> Any:
    """``x`` itself if it is an array (numpy, jax or tracer), else ``np.asarray(x)``.

    No device op runs here: conversion and casting happen inside the jitted cores, so eager
    calls compile once per shape instead of once per primitive.
    """
    return x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x)


def _check_probs(probs: Any, ndim: int, name: str) -> Any:
    """Returns ``probs`` as an array after checking its rank."""
    probs = _arr(probs)
    if probs.ndim != ndim:
        want = "[N, classes]" if ndim == 2 else "[members, N, classes]"
        raise ValueError(
            f"`{name}` must be {ndim}-D {want}, got shape {tuple(probs.shape)}; "
            f"reshape it to {want}."
        )
    return probs


def _check_labels(labels: Any, n: int) -> Any:
    """Returns ``labels`` as an array after checking it is ``[n]``."""
    labels = _arr(labels)
    if labels.ndim != 1 or labels.shape[0] != n:
        raise ValueError(
            f"`labels` must be 1-D of length N={n} (integer class indices), "
            f"got shape {tuple(labels.shape)}; pass one label per example."
        )
    return labels


def _check_mask(mask: Any, n: int) -> Any:
    """Returns ``mask`` (None or an array) after checking it is ``[n]``."""
    if mask is None:
        return None
    mask = _arr(mask)
    if mask.ndim != 1 or mask.shape[0] != n:
        raise ValueError(
            f"`mask` must be 1-D of length N={n} (bools or 0/1 weights), "
            f"got shape {tuple(mask.shape)}; pass one weight per example."
        )
    return mask


def _check_basic(probs: Any, labels: Any, mask: Any) -> tuple[Any, Any, Any]:
    """Checks ``probs`` `[N, C]`, ``labels`` `[N]` and ``mask`` `[N]` or None."""
    probs = _check_probs(probs, 2, "probs")
    n = probs.shape[0]
    return probs, _check_labels(labels, n), _check_mask(mask, n)


def _weights(mask: Any, n: int, dtype: Any) -> jax.Array:
    """The ``[n]`` float weights of a checked ``mask`` (all ones when ``mask`` is None)."""
    if mask is None:
        return jnp.ones((n,), dtype)
    return jnp.asarray(mask).astype(dtype)


def _onehot(labels: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """One-hot labels ``[N, C]`` broadcast explicitly to ``shape`` ``[..., N, C]``."""
    return jnp.broadcast_to(jax.nn.one_hot(labels, shape[-1], dtype=dtype), shape)


def _per_example(probs: jax.Array, labels: jax.Array, num_bins: int) -> dict[str, jax.Array]:
    """Per-example quantities for ``probs`` ``[..., N, C]`` and ``labels`` ``[N]``.

    Returns ``[..., N]`` arrays ``correct``, ``nll``, ``brier``, ``entropy``, ``conf`` and the
    int ``bin`` index of the confidence.
    """
    dtype = probs.dtype
    onehot = _onehot(labels, probs.shape, dtype)
    true_p = jnp.sum(probs * onehot, axis=-1)
    pred = jnp.argmax(probs, axis=-1)
    correct = (pred == jnp.broadcast_to(labels, pred.shape)).astype(dtype)
    conf = jnp.max(probs, axis=-1)
    return {
        "correct": correct,
        "nll": -jnp.log(jnp.maximum(true_p, _eps(dtype))),
        "brier": jnp.sum(jnp.square(probs - onehot), axis=-1),
        "entropy": _entropy(probs),
        "conf": conf,
        "bin": _bin_index(conf, num_bins),
    }


def _bin_index(conf: jax.Array, num_bins: int) -> jax.Array:
    """Equal-width bin index in ``[0, num_bins)`` of confidences in ``[0, 1]``."""
    idx = jnp.floor(conf * num_bins).astype(jnp.int32)
    return jnp.clip(idx, 0, num_bins - 1)


def _bin_sums(
    conf: jax.Array, correct: jax.Array, idx: jax.Array, w: jax.Array, num_bins: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Weighted per-bin ``(count, confidence_sum, correct_sum)``, each ``[..., num_bins]``.

    ``conf``, ``correct`` and ``idx`` are ``[..., N]``; ``w`` is ``[N]``.
    """
    w = jnp.broadcast_to(w, conf.shape)
    keep = w != 0
    conf = jnp.where(keep, conf, 0.0)  # a masked-out NaN must not leak through 0 * NaN
    correct = jnp.where(keep, correct, 0.0)
    onehot = jax.nn.one_hot(idx, num_bins, dtype=conf.dtype) * w[..., None]  # [..., N, B]
    count = jnp.sum(onehot, axis=-2)
    conf_sum = jnp.sum(onehot * conf[..., None], axis=-2)
    correct_sum = jnp.sum(onehot * correct[..., None], axis=-2)
    return count, conf_sum, correct_sum


def _check_num_bins(num_bins: int) -> int:
    """Returns ``num_bins`` as an int after checking it is a positive integer."""
    if isinstance(num_bins, bool) or not isinstance(num_bins, int | np.integer) or num_bins < 1:
        raise ValueError(f"`num_bins` must be a positive int, got {num_bins!r}.")
    return int(num_bins)


def _wsum(x: jax.Array, w: jax.Array) -> jax.Array:
    """``sum(w * x)`` over the last axis; ``w`` is ``[N]``, ``x`` is ``[..., N]``.

    Masked-out entries (``w == 0``) contribute exactly 0 even if ``x`` is NaN/inf there.
    """
    w = jnp.broadcast_to(w, x.shape)
    return jnp.sum(jnp.where(w != 0, x * w, 0.0), axis=-1)


def _wmean(x: jax.Array, w: jax.Array) -> jax.Array:
    """``sum(w * x) / sum(w)`` over the last axis."""
    return _wsum(x, w) / jnp.sum(w, axis=-1)


# --------------------------------------------------------------------------- basic metrics


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
    return _accuracy_core(*_check_basic(probs, labels, mask))


@jax.jit
def _accuracy_core(probs: Any, labels: Any, mask: Any) -> jax.Array:
    probs = _as_float(probs)
    w = _weights(mask, probs.shape[0], probs.dtype)
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
    return _nll_core(*_check_basic(probs, labels, mask))


@jax.jit
def _nll_core(probs: Any, labels: Any, mask: Any) -> jax.Array:
    probs = _as_float(probs)
    w = _weights(mask, probs.shape[0], probs.dtype)
    true_p = jnp.sum(probs * _onehot(labels, probs.shape, probs.dtype), axis=-1)
    return _wmean(-jnp.log(jnp.maximum(true_p, _eps(probs.dtype))), w)


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
    return _brier_core(*_check_basic(probs, labels, mask))


@jax.jit
def _brier_core(probs: Any, labels: Any, mask: Any) -> jax.Array:
    probs = _as_float(probs)
    w = _weights(mask, probs.shape[0], probs.dtype)
    sq = jnp.sum(jnp.square(probs - _onehot(labels, probs.shape, probs.dtype)), axis=-1)
    return _wmean(sq, w)


# --------------------------------------------------------------------------- calibration


def calibration_bins(
    probs: ArrayLike, labels: ArrayLike, num_bins: int = 15, mask: ArrayLike | None = None
) -> dict[str, jax.Array]:
    """Per-bin SUMS for the expected calibration error; sums from shards can be added.

    The confidence of an example is ``conf_i = max_c p_ic``; it falls in bin
    ``b = clip(floor(conf_i * num_bins), 0, num_bins - 1)`` (equal-width bins on ``[0, 1]``;
    ``conf = 1.0`` goes into the last bin, ``0`` into the first). Per bin:
    ``count_b = sum_{i in b} w_i``, ``confidence_sum_b = sum_{i in b} w_i conf_i`` and
    ``correct_sum_b = sum_{i in b} w_i 1[argmax_c p_ic == y_i]``.

    Args:
      probs: `[N, classes]` predicted probabilities.
      labels: `[N]` integer class indices.
      num_bins: number of equal-width bins ``B``.
      mask: optional `[N]` bools or 0/1 weights; only masked-in examples count.

    Returns:
      Dict with ``count``, ``confidence_sum``, ``correct_sum`` (each `[num_bins]`) and
      ``bin_edges`` `[num_bins + 1]` (``linspace(0, 1, num_bins + 1)``).

    Raises:
      ValueError: if the shapes are wrong or ``num_bins < 1``.

    Example:
      >>> bins = calibration_bins([[0.9, 0.1], [0.3, 0.7]], [0, 0], num_bins=10)
      >>> bins["count"].tolist()
      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    """
    num_bins = _check_num_bins(num_bins)
    return _calibration_bins_core(*_check_basic(probs, labels, mask), num_bins=num_bins)


@functools.partial(jax.jit, static_argnames="num_bins")
def _calibration_bins_core(probs: Any, labels: Any, mask: Any, num_bins: int) -> dict:
    probs = _as_float(probs)
    w = _weights(mask, probs.shape[0], probs.dtype)
    conf = jnp.max(probs, axis=-1)
    correct = (jnp.argmax(probs, axis=-1) == labels).astype(probs.dtype)
    count, conf_sum, correct_sum = _bin_sums(conf, correct, _bin_index(conf, num_bins), w, num_bins)
    return {
        "count": count,
        "confidence_sum": conf_sum,
        "correct_sum": correct_sum,
        "bin_edges": jnp.linspace(0.0, 1.0, num_bins + 1, dtype=probs.dtype),
    }


def ece_from_bins(bins: Mapping[str, Any]) -> jax.Array:
    """Expected calibration error from (possibly shard-summed) :func:`calibration_bins` sums.

    ``ece = sum_b (count_b / N) * |acc_b - conf_b| = sum_b |correct_sum_b - confidence_sum_b| / N``
    with ``N = sum_b count_b``, ``acc_b = correct_sum_b / count_b`` and
    ``conf_b = confidence_sum_b / count_b``; empty bins contribute 0.

    Args:
      bins: mapping with ``count``, ``confidence_sum`` and ``correct_sum``, each
        `[..., num_bins]` (leading axes, e.g. members, are kept).

    Returns:
      ECE `[...]` (a scalar for `[num_bins]` input; ``nan`` if all counts are 0).

    Example:
      >>> bins = calibration_bins([[0.9, 0.1], [0.3, 0.7]], [0, 0], num_bins=10)
      >>> round(float(ece_from_bins(bins)), 4)  # (|1 - 0.9| + |0 - 0.7|) / 2
      0.4
    """
    return _ece_core(bins["count"], bins["confidence_sum"], bins["correct_sum"])


@jax.jit
def _ece_core(count: Any, confidence_sum: Any, correct_sum: Any) -> jax.Array:
    gap = jnp.abs(jnp.asarray(correct_sum) - jnp.asarray(confidence_sum))
    return jnp.sum(gap, axis=-1) / jnp.sum(jnp.asarray(count), axis=-1)


def ece(
    probs: ArrayLike, labels: ArrayLike, num_bins: int = 15, mask: ArrayLike | None = None
) -> jax.Array:
    """Expected calibration error with ``num_bins`` equal-width confidence bins.

    ``ece = sum_b (count_b / N) * |acc_b - conf_b|``; see :func:`calibration_bins` for the
    binning and :func:`ece_from_bins` for the formula.

    Args:
      probs: `[N, classes]` predicted probabilities.
      labels: `[N]` integer class indices.
      num_bins: number of equal-width bins.
      mask: optional `[N]` bools or 0/1 weights; only masked-in examples count.

    Returns:
      Scalar `[]` ECE in ``[0, 1]`` (``nan`` if no example is masked in).

    Raises:
      ValueError: if the shapes are wrong or ``num_bins < 1``.

    Example:
      >>> round(float(ece([[0.9, 0.1], [0.3, 0.7]], [0, 0], num_bins=10)), 4)
      0.4
    """
    return ece_from_bins(calibration_bins(probs, labels, num_bins=num_bins, mask=mask))


def reliability_diagram_data(
    probs: ArrayLike, labels: ArrayLike, num_bins: int = 15, mask: ArrayLike | None = None
) -> dict[str, np.ndarray]:
    """Per-bin accuracy, confidence and count as numpy arrays, for a reliability diagram.

    ``accuracy_b = correct_sum_b / count_b`` and ``confidence_b = confidence_sum_b / count_b``
    (``nan`` for empty bins, so plots skip them); binning as in :func:`calibration_bins`.

    Args:
      probs: `[N, classes]` predicted probabilities.
      labels: `[N]` integer class indices.
      num_bins: number of equal-width bins.
      mask: optional `[N]` bools or 0/1 weights; only masked-in examples count.

    Returns:
      Dict of numpy float64 arrays: ``accuracy``, ``confidence``, ``count`` (each
      `[num_bins]`) and ``bin_edges`` `[num_bins + 1]`.

    Raises:
      ValueError: if the shapes are wrong or ``num_bins < 1``.

    Example:
      >>> d = reliability_diagram_data([[0.9, 0.1], [0.3, 0.7]], [0, 0], num_bins=10)
      >>> d["accuracy"][[7, 9]].tolist(), float(d["count"].sum())
      ([0.0, 1.0], 2.0)
    """
    bins = calibration_bins(probs, labels, num_bins=num_bins, mask=mask)
    return reliability_from_bins(bins, num_bins)


def reliability_from_bins(bins: Mapping[str, Any], num_bins: int) -> dict[str, np.ndarray]:
    """Per-bin accuracy and confidence from bin sums (e.g. summed over shards).

    Args:
      bins: ``count``, ``confidence_sum``, ``correct_sum``, each ``[num_bins]``.
      num_bins: number of equal-width bins.

    Returns:
      numpy ``accuracy`` and ``confidence`` ``[num_bins]`` (NaN for empty bins), ``count``
      ``[num_bins]`` and ``bin_edges`` ``[num_bins + 1]``.

    Example:
      >>> reliability_from_bins(calibration_bins(probs, labels), 15)["accuracy"]
    """
    count = np.asarray(bins["count"], np.float64)
    nonempty = count > 0

    def per_bin(key: str) -> np.ndarray:
        total = np.asarray(bins[key], np.float64)
        return np.divide(total, count, out=np.full_like(total, np.nan), where=nonempty)

    return {
        "accuracy": per_bin("correct_sum"),
        "confidence": per_bin("confidence_sum"),
        "count": count,
        "bin_edges": np.linspace(0.0, 1.0, num_bins + 1),
    }


# --------------------------------------------------------------------------- uncertainty


def entropy(probs: ArrayLike) -> jax.Array:
    """Shannon entropy (natural log) of each probability vector, with ``0 log 0 = 0``.

    ``H(p) = -sum_c p_c log p_c``; no clip is used (zero entries contribute exactly 0), so a
    one-hot vector has entropy 0.

    Args:
      probs: `[..., classes]` probabilities, typically `[N, classes]`.

    Returns:
      `[...]` entropies in nats, typically `[N]`.

    Example:
      >>> [round(float(v), 4) for v in entropy([[1.0, 0.0], [0.5, 0.5]])]
      [0.0, 0.6931]
    """
    return _entropy_core(_arr(probs))


def _entropy(probs: Any) -> jax.Array:
    probs = _as_float(probs)
    pos = probs > 0
    plogp = jnp.where(pos, probs * jnp.log(jnp.where(pos, probs, 1.0)), 0.0)
    return 0.0 - jnp.sum(plogp, axis=-1)  # 0 - x, not -x: a one-hot gives +0.0, not -0.0


_entropy_core = jax.jit(_entropy)


def expected_entropy(member_probs: ArrayLike) -> jax.Array:
    """Mean over members of each member's predictive entropy (the aleatoric part).

    ``EH_i = (1 / M) sum_m H(p^m_i)``.

    Args:
      member_probs: `[members, N, classes]` member probabilities.

    Returns:
      `[N]` expected entropies in nats.

    Raises:
      ValueError: if ``member_probs`` is not 3-D.

    Example:
      >>> [round(float(v), 4) for v in expected_entropy([[[1.0, 0.0]], [[0.5, 0.5]]])]
      [0.3466]
    """
    return _expected_entropy_core(_check_probs(member_probs, 3, "member_probs"))


@jax.jit
def _expected_entropy_core(member_probs: Any) -> jax.Array:
    return jnp.mean(_entropy(member_probs), axis=0)


def mutual_information(member_probs: ArrayLike) -> jax.Array:
    """Mutual information between prediction and member (the epistemic part, BALD).

    ``MI_i = max(H(mean_m p^m_i) - (1 / M) sum_m H(p^m_i), 0)``; the clip only removes
    floating-point round-off, since the difference is >= 0 by Jensen's inequality.

    Args:
      member_probs: `[members, N, classes]` member probabilities.

    Returns:
      `[N]` mutual information in nats.

    Raises:
      ValueError: if ``member_probs`` is not 3-D.

    Example:
      >>> [round(float(v), 4) for v in mutual_information([[[1.0, 0.0]], [[0.0, 1.0]]])]
      [0.6931]
    """
    return _mutual_information_core(_check_probs(member_probs, 3, "member_probs"))


@jax.jit
def _mutual_information_core(member_probs: Any) -> jax.Array:
    member_probs = _as_float(member_probs)
    mi = _entropy(jnp.mean(member_probs, axis=0)) - jnp.mean(_entropy(member_probs), axis=0)
    return jnp.maximum(mi, 0.0)


def disagreement(member_probs: ArrayLike) -> jax.Array:
    """Fraction of members whose argmax differs from the ensemble's argmax.

    ``D_i = (1 / M) sum_m 1[argmax_c p^m_ic != argmax_c pbar_ic]`` where
    ``pbar_i = mean_m p^m_i`` is the ensemble (mean-probability) prediction. It is 0 when every
    member's argmax equals the ensemble's, and can reach 1 when the ensemble's argmax is no
    member's argmax.

    Args:
      member_probs: `[members, N, classes]` member probabilities.

    Returns:
      `[N]` disagreement fractions in ``[0, 1]``.

    Raises:
      ValueError: if ``member_probs`` is not 3-D.

    Example:
      >>> [round(float(v), 4) for v in disagreement([[[0.9, 0.1]], [[0.8, 0.2]], [[0.4, 0.6]]])]
      [0.3333]
    """
    return _disagreement_core(_check_probs(member_probs, 3, "member_probs"))


@jax.jit
def _disagreement_core(member_probs: Any) -> jax.Array:
    member_probs = _as_float(member_probs)
    ens_pred = jnp.argmax(jnp.mean(member_probs, axis=0), axis=-1)  # [N]
    member_pred = jnp.argmax(member_probs, axis=-1)  # [M, N]
    differs = member_pred != jnp.broadcast_to(ens_pred, member_pred.shape)
    return jnp.mean(differs.astype(member_probs.dtype), axis=0)


def ood_score(member_probs: ArrayLike, kind: str = "max_prob") -> jax.Array:
    """Per-example out-of-distribution score of an ensemble; higher means more OOD.

    With ``pbar_i = mean_m p^m_i`` the ensemble prediction:

    * ``"max_prob"``: ``1 - max_c pbar_ic`` (in ``[0, 1 - 1 / classes]``);
    * ``"entropy"``: ``H(pbar_i)``, the predictive entropy;
    * ``"mutual_information"``: :func:`mutual_information`.

    Args:
      member_probs: `[members, N, classes]` member probabilities (use ``probs[None]`` for a
        single model).
      kind: one of :data:`OOD_KINDS`.

    Returns:
      `[N]` scores.

    Raises:
      ValueError: if ``kind`` is unknown or ``member_probs`` is not 3-D.

    Example:
      >>> [round(float(v), 4) for v in ood_score([[[0.9, 0.1], [0.5, 0.5]]], "max_prob")]
      [0.1, 0.5]
    """
    if kind not in OOD_KINDS:
        raise ValueError(f"unknown OOD score kind {kind!r}; use one of {OOD_KINDS}.")
    return _ood_score_core(_check_probs(member_probs, 3, "member_probs"), kind=kind)


@functools.partial(jax.jit, static_argnames="kind")
def _ood_score_core(member_probs: Any, kind: str) -> jax.Array:
    if kind == "mutual_information":
        return _mutual_information_core(member_probs)
    mean_probs = jnp.mean(_as_float(member_probs), axis=0)
    if kind == "entropy":
        return _entropy(mean_probs)
    return 1.0 - jnp.max(mean_probs, axis=-1)


# --------------------------------------------------------------------------- OOD detection


def _check_scores(scores_in: Any, scores_out: Any) -> tuple[np.ndarray, np.ndarray]:
    """Both score sets as float64 numpy vectors, after checking they are usable."""
    out = []
    for name, s in (("scores_in", scores_in), ("scores_out", scores_out)):
        s = np.asarray(s, dtype=np.float64)
        if s.ndim != 1:
            raise ValueError(f"`{name}` must be 1-D [N], got shape {s.shape}; flatten it.")
        if s.size == 0:
            raise ValueError(f"`{name}` is empty; AUROC/AUPR need at least one score per set.")
        if np.isnan(s).any():
            raise ValueError(f"`{name}` contains NaN; drop or replace those scores.")
        out.append(s)
    return out[0], out[1]


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of ``x``, ties given the average of the ranks they span."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], xs.size]  # exclusive
    avg = (starts + 1 + ends) / 2.0  # mean of ranks starts+1 .. ends
    ranks = np.empty(x.size, np.float64)
    ranks[order] = np.repeat(avg, ends - starts)
    return ranks


def auroc(scores_in: ArrayLike, scores_out: ArrayLike) -> float:
    """Area under the ROC curve for separating out-of-distribution from in-distribution.

    OOD (``scores_out``) is the positive class and higher scores mean more OOD. Mann-Whitney U
    form, ties counted 1/2 (equal to ``sklearn.metrics.roc_auc_score``):
    ``AUROC = P(s_out > s_in) + P(s_out == s_in) / 2
    = (R_out - n_out (n_out + 1) / 2) / (n_in n_out)``
    with ``R_out`` the sum of the (tie-averaged) ranks of the OOD scores in the pooled set.

    Args:
      scores_in: `[n_in]` scores of in-distribution examples.
      scores_out: `[n_out]` scores of OOD examples.

    Returns:
      AUROC in ``[0, 1]`` as a python float (0.5 = chance, 1 = perfect separation).

    Raises:
      ValueError: if either set is empty, not 1-D, or contains NaN.

    Example:
      >>> auroc([0.1, 0.2, 0.3], [0.25, 0.9])
      0.8333333333333334
    """
    s_in, s_out = _check_scores(scores_in, scores_out)
    ranks = _average_ranks(np.concatenate([s_in, s_out]))
    n_in, n_out = s_in.size, s_out.size
    u = ranks[n_in:].sum() - n_out * (n_out + 1) / 2.0
    return float(u / (n_in * n_out))


def aupr(scores_in: ArrayLike, scores_out: ArrayLike) -> float:
    """Area under the precision-recall curve (average precision), OOD as the positive class.

    Equal to ``sklearn.metrics.average_precision_score`` with OOD labelled 1: over the distinct
    score thresholds ``t`` in decreasing order,
    ``AP = sum_t (R_t - R_{t-1}) P_t`` with ``P_t``/``R_t`` the precision/recall of
    ``score >= t`` and ``R_0 = 0`` (a step function, no interpolation).

    Args:
      scores_in: `[n_in]` scores of in-distribution examples.
      scores_out: `[n_out]` scores of OOD examples.

    Returns:
      Average precision in ``[0, 1]`` as a python float (chance level is the OOD fraction).

    Raises:
      ValueError: if either set is empty, not 1-D, or contains NaN.

    Example:
      >>> round(aupr([0.1, 0.2, 0.3], [0.25, 0.9]), 4)  # (1/2)*1 + (1/2)*(2/3)
      0.8333
    """
    s_in, s_out = _check_scores(scores_in, scores_out)
    scores = np.concatenate([s_in, s_out])
    positive = np.concatenate([np.zeros(s_in.size), np.ones(s_out.size)])
    order = np.argsort(-scores, kind="mergesort")
    scores, positive = scores[order], positive[order]
    last_of_tie = np.r_[scores[1:] != scores[:-1], True]  # threshold = each distinct score
    tp = np.cumsum(positive)[last_of_tie]
    seen = (np.flatnonzero(last_of_tie) + 1).astype(np.float64)
    precision = tp / seen
    recall = tp / s_out.size
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


# --------------------------------------------------------------------------- streaming form


def streaming_stats(
    member_probs: ArrayLike,
    ensemble_probs: ArrayLike,
    labels: ArrayLike,
    mask: ArrayLike,
    num_bins: int = 15,
) -> dict[str, jax.Array]:
    """Masked SUMS over one batch shard, to be reduced over shards and finalised.

    Designed for on-mesh evaluation: each device calls it on its local members and local
    batch, then

    * ``ensemble_*`` keys and ``count`` are summed over data shards (``psum`` over ``data``);
      they do not depend on which members a device holds (they are computed from
      ``ensemble_probs``, ``labels`` and ``mask`` only, so ``shard_map`` sees them as invariant
      over the member axis and they may leave with ``out_specs=P()``), so they are NOT summed
      over member shards;
    * ``member_*`` keys (leading axis ``m``) are summed over data shards and concatenated over
      member shards in member order;

    and :func:`finalize_stats` turns the full-set sums into metrics. Per masked-in example
    ``i`` (weight ``w_i``) and member ``k``, with ``pbar`` the full ensemble mean:

    * ``member_correct[k] = sum_i w_i 1[argmax p^k_i == y_i]``;
      ``member_nll[k] = sum_i w_i (-log max(p^k_{i,y_i}, eps))``;
      ``member_brier[k] = sum_i w_i sum_c (p^k_ic - 1[c == y_i])^2``;
      ``member_entropy[k] = sum_i w_i H(p^k_i)``;
      ``member_disagree[k] = sum_i w_i 1[argmax p^k_i != argmax pbar_i]``;
      ``member_bin_count/conf/correct[k, b]``: the :func:`calibration_bins` sums of member k;
    * ``ensemble_correct``, ``ensemble_nll``, ``ensemble_brier``, ``ensemble_entropy``,
      ``ensemble_bin_count/conf/correct`` `[bins]`: the same sums for ``pbar``;
    * ``count = sum_i w_i``.

    Args:
      member_probs: `[m, b, C]` probabilities of this device's local members (``m`` may be a
        subset of all members).
      ensemble_probs: `[b, C]` full ensemble mean over ALL members (averaged by the caller).
      labels: `[b]` integer class indices.
      mask: `[b]` float 0/1 weights (or bools); padding examples must be 0.
      num_bins: number of calibration bins (static under ``jit``).

    Returns:
      Dict of float arrays: ``member_*`` of shape `[m]` or `[m, num_bins]`; ``ensemble_*`` of
      shape `[]` or `[num_bins]`; ``count`` `[]`.

    Raises:
      ValueError: if the shapes disagree or ``num_bins < 1``.

    Example:
      >>> mp = jnp.array([[[0.9, 0.1], [0.2, 0.8]], [[0.6, 0.4], [0.6, 0.4]]])
      >>> s = streaming_stats(mp, mp.mean(0), jnp.array([0, 1]), jnp.array([1.0, 0.0]))
      >>> s["member_correct"].tolist(), float(s["count"])
      ([1.0, 1.0], 1.0)
    """
    num_bins = _check_num_bins(num_bins)
    member_probs = _check_probs(member_probs, 3, "member_probs")
    ensemble_probs = _check_probs(ensemble_probs, 2, "ensemble_probs")
    _, b, c = member_probs.shape
    if ensemble_probs.shape != (b, c):
        raise ValueError(
            f"`ensemble_probs` must be [b, C] = {(b, c)} to match `member_probs` "
            f"{tuple(member_probs.shape)}, got {tuple(ensemble_probs.shape)}."
        )
    labels = _check_labels(labels, b)
    if mask is None:
        raise ValueError("`mask` is required: pass jnp.ones(b) when there is no padding.")
    mask = _check_mask(mask, b)
    return _streaming_stats_core(member_probs, ensemble_probs, labels, mask, num_bins=num_bins)


@functools.partial(jax.jit, static_argnames="num_bins")
def _streaming_stats_core(
    member_probs: Any, ensemble_probs: Any, labels: Any, mask: Any, num_bins: int
) -> dict[str, jax.Array]:
    member_probs = _as_float(member_probs)
    ensemble_probs = jnp.asarray(ensemble_probs).astype(member_probs.dtype)
    w = _weights(mask, member_probs.shape[1], member_probs.dtype)

    # The ensemble sums use only ensemble_probs, labels and mask (not member_probs), so inside
    # shard_map they stay invariant over the member axis and can leave with out_specs P().
    mem = _per_example(member_probs, labels, num_bins)  # each [m, b]
    ens = _per_example(ensemble_probs, labels, num_bins)  # each [b]
    ens_pred = jnp.argmax(ensemble_probs, axis=-1)
    member_pred = jnp.argmax(member_probs, axis=-1)
    disagree = (member_pred != jnp.broadcast_to(ens_pred, member_pred.shape)).astype(w.dtype)
    names = ("correct", "nll", "brier", "entropy")
    m_sums = _wsum(jnp.stack([*(mem[k] for k in names), disagree]), w)  # [5, m]
    e_sums = _wsum(jnp.stack([ens[k] for k in names]), w)  # [4]
    m_count, m_conf, m_correct = _bin_sums(mem["conf"], mem["correct"], mem["bin"], w, num_bins)
    e_count, e_conf, e_correct = _bin_sums(ens["conf"], ens["correct"], ens["bin"], w, num_bins)
    return {
        **{f"member_{k}": m_sums[i] for i, k in enumerate(names)},
        "member_disagree": m_sums[len(names)],
        "member_bin_count": m_count,
        "member_bin_conf": m_conf,
        "member_bin_correct": m_correct,
        **{f"ensemble_{k}": e_sums[i] for i, k in enumerate(names)},
        "ensemble_bin_count": e_count,
        "ensemble_bin_conf": e_conf,
        "ensemble_bin_correct": e_correct,
        "count": jnp.sum(w),
    }


def finalize_stats(stats: Mapping[str, Any], num_bins: int = 15) -> dict[str, float | list[float]]:
    """Metrics from full-set :func:`streaming_stats` sums (host side, float64).

    With ``n = count`` and ``M`` = the length of the ``member_*`` arrays (ALL members):
    ``accuracy = ensemble_correct / n``, ``nll = ensemble_nll / n``,
    ``brier = ensemble_brier / n``, ``entropy = ensemble_entropy / n``,
    ``ece = sum_b |ensemble_bin_correct_b - ensemble_bin_conf_b| / n``;
    ``expected_entropy = sum_k member_entropy[k] / (M n)``;
    ``mutual_information = max(entropy - expected_entropy, 0)`` (equal to the mean over
    examples of the per-example MI, as both terms are means);
    ``disagreement = sum_k member_disagree[k] / (M n)``;
    ``member_<x>[k] = member_<x>[k] / n`` for ``x`` in accuracy (from ``member_correct``), nll,
    brier, and ``member_ece[k]`` from the member bin sums; ``mean_member_<x>`` = the mean of
    the member list.

    Args:
      stats: full-set sums with the keys of :func:`streaming_stats`; ``member_*`` arrays
        `[members]` / `[members, num_bins]`, the rest `[]` / `[num_bins]`.
      num_bins: the number of bins the stats were made with (checked against the arrays).

    Returns:
      The same dict as :func:`ensemble_metrics`: python floats ``accuracy``, ``nll``,
      ``brier``, ``ece``, ``entropy``, ``expected_entropy``, ``mutual_information``,
      ``disagreement``, ``mean_member_accuracy``, ``mean_member_nll``, ``mean_member_brier``,
      ``mean_member_ece`` and python lists (length members) ``member_accuracy``,
      ``member_nll``, ``member_brier``, ``member_ece``.

    Raises:
      ValueError: if keys are missing, shapes disagree, or ``count`` is not positive.

    Example:
      >>> mp = jnp.array([[[0.9, 0.1], [0.2, 0.8]], [[0.6, 0.4], [0.6, 0.4]]])
      >>> s = streaming_stats(mp, mp.mean(0), jnp.array([0, 1]), jnp.ones(2), num_bins=10)
      >>> finalize_stats(s, num_bins=10)["member_accuracy"]
      [1.0, 0.5]
    """
    num_bins = _check_num_bins(num_bins)
    missing = [k for k in (*MEMBER_STAT_KEYS, *ENSEMBLE_STAT_KEYS) if k not in stats]
    if missing:
        raise ValueError(f"`stats` lacks keys {missing}; pass the output of streaming_stats.")
    s = {
        k: np.asarray(stats[k], dtype=np.float64) for k in (*MEMBER_STAT_KEYS, *ENSEMBLE_STAT_KEYS)
    }
    n = float(s["count"])
    if not n > 0:
        raise ValueError(f"`stats['count']` is {n}; at least one example must be masked in.")
    m = s["member_correct"].shape[0] if s["member_correct"].ndim == 1 else -1
    want = {
        **{k: (m,) for k in MEMBER_STAT_KEYS if not k.startswith("member_bin_")},
        **{k: (m, num_bins) for k in MEMBER_STAT_KEYS if k.startswith("member_bin_")},
        **{k: (num_bins,) for k in ENSEMBLE_STAT_KEYS if k.startswith("ensemble_bin_")},
    }
    for k, shape in want.items():
        if s[k].shape != shape or m < 1:
            raise ValueError(
                f"`stats[{k!r}]` has shape {s[k].shape}, expected {shape} "
                f"(members={m}, num_bins={num_bins}); check num_bins and the member concat."
            )

    def ece_np(correct: np.ndarray, conf: np.ndarray) -> np.ndarray:
        return np.abs(correct - conf).sum(axis=-1) / n

    ens_entropy = float(s["ensemble_entropy"]) / n
    exp_entropy = float(s["member_entropy"].sum()) / (m * n)
    member = {
        "member_accuracy": s["member_correct"] / n,
        "member_nll": s["member_nll"] / n,
        "member_brier": s["member_brier"] / n,
        "member_ece": ece_np(s["member_bin_correct"], s["member_bin_conf"]),
    }
    out: dict[str, float | list[float]] = {
        "accuracy": float(s["ensemble_correct"]) / n,
        "nll": float(s["ensemble_nll"]) / n,
        "brier": float(s["ensemble_brier"]) / n,
        "ece": float(ece_np(s["ensemble_bin_correct"], s["ensemble_bin_conf"])),
        "entropy": ens_entropy,
        "expected_entropy": exp_entropy,
        "mutual_information": max(ens_entropy - exp_entropy, 0.0),
        "disagreement": float(s["member_disagree"].sum()) / (m * n),
    }
    for key, values in member.items():
        out[key] = [float(v) for v in values]
        out[f"mean_{key}"] = float(values.mean())
    return out


def ensemble_metrics(
    member_probs: ArrayLike, labels: ArrayLike, num_bins: int = 15, mask: ArrayLike | None = None
) -> dict[str, float | list[float]]:
    """All ensemble and per-member metrics of a deep ensemble (host function).

    The ensemble prediction is ``pbar = mean_m member_probs[m]``. Computed as
    ``finalize_stats(streaming_stats(member_probs, pbar, labels, mask))``; see
    :func:`finalize_stats` for every formula. Averages are over masked-in examples.

    Args:
      member_probs: `[members, N, classes]` member probabilities.
      labels: `[N]` integer class indices in ``[0, classes)``.
      num_bins: number of equal-width calibration bins for the ECEs.
      mask: optional `[N]` bools or 0/1 weights (default: all ones).

    Returns:
      Dict of python floats ``accuracy``, ``nll``, ``brier``, ``ece``, ``entropy`` (mean
      predictive entropy), ``expected_entropy``, ``mutual_information``, ``disagreement``
      (all means over examples), ``mean_member_accuracy``, ``mean_member_nll``,
      ``mean_member_brier``, ``mean_member_ece``; and python lists of length members
      ``member_accuracy``, ``member_nll``, ``member_brier``, ``member_ece``.

    Raises:
      ValueError: if ``member_probs`` is not 3-D, ``labels`` is not integer `[N]`, a label is
        out of range, ``mask`` is not `[N]`, or no example is masked in.

    Example:
      >>> mp = np.array([[[0.9, 0.1], [0.2, 0.8]], [[0.6, 0.4], [0.6, 0.4]]])
      >>> r = ensemble_metrics(mp, np.array([0, 1]))
      >>> r["accuracy"], r["member_accuracy"]
      (1.0, [1.0, 0.5])
    """
    num_bins = _check_num_bins(num_bins)
    member_probs = _check_probs(member_probs, 3, "member_probs")
    _, n, c = member_probs.shape
    labels_np = np.asarray(labels)
    if labels_np.ndim != 1 or labels_np.shape[0] != n:
        raise ValueError(
            f"`labels` must be 1-D of length N={n} to match member_probs "
            f"{tuple(member_probs.shape)}, got shape {labels_np.shape}."
        )
    if not np.issubdtype(labels_np.dtype, np.integer):
        raise ValueError(
            f"`labels` must be integer class indices, got dtype {labels_np.dtype}; "
            "use labels.astype(int)."
        )
    if n and (labels_np.min() < 0 or labels_np.max() >= c):
        raise ValueError(
            f"`labels` must lie in [0, {c}) for {c} classes, got range "
            f"[{labels_np.min()}, {labels_np.max()}]; fix the labels or the class count."
        )
    # One host dtype for the mask, so that None, bool and float masks share one compilation.
    mask = np.ones(n, np.float32) if mask is None else np.asarray(_check_mask(mask, n), np.float32)
    stats = _ensemble_stats_core(member_probs, labels_np, mask, num_bins=num_bins)
    return finalize_stats(stats, num_bins=num_bins)


@functools.partial(jax.jit, static_argnames="num_bins")
def _ensemble_stats_core(
    member_probs: Any, labels: Any, mask: Any, num_bins: int
) -> dict[str, jax.Array]:
    member_probs = _as_float(member_probs)
    ensemble_probs = jnp.mean(member_probs, axis=0)
    return _streaming_stats_core(member_probs, ensemble_probs, labels, mask, num_bins=num_bins)


def prefix_metrics(ev: Mapping[str, Any], split: str = "test") -> dict[str, Any]:
    """Names the metrics of :meth:`meshensemble.Ensemble.evaluate` as ``metrics.jsonl`` does.

    ``member_<x>`` becomes ``{split}_member_<x>``, ``mean_member_<x>`` becomes
    ``{split}_mean_member_<x>`` and every other key ``<x>`` (the ensemble's) becomes
    ``{split}_ensemble_<x>``. This is the scheme of the training loop's records.

    Args:
      ev: the dict returned by ``Ensemble.evaluate``.
      split: the data split, e.g. ``"test"``.

    Returns:
      A new dict with the prefixed keys and the same values.

    Example:
      >>> prefix_metrics({"accuracy": 0.9, "member_nll": [0.3, 0.4], "mean_member_nll": 0.35})
      {'test_ensemble_accuracy': 0.9, 'test_member_nll': [0.3, 0.4], 'test_mean_member_nll': 0.35}
    """
    out: dict[str, Any] = {}
    for name, value in ev.items():
        if name.startswith(("member_", "mean_member_")):
            out[f"{split}_{name}"] = value
        else:
            out[f"{split}_ensemble_{name}"] = value
    return out
