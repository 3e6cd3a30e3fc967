"""Calibration: confidence bins, the expected calibration error and reliability diagrams.

Bins are ``num_bins`` equal-width bins on the confidence (the max probability) in ``[0, 1]``;
a confidence of exactly ``1.0`` falls in the last bin (conventions:
:mod:`meshensemble.metrics`). :func:`calibration_bins` returns SUMS, so bins from shards or
batches can be added before :func:`ece_from_bins` / :func:`reliability_from_bins`.
:func:`adaptive_ece` uses equal-mass bins instead (equal counts of examples); those need
every example's confidence, so it is a host function (:func:`adaptive_ece_from_examples`
takes the per-example values that a sharded evaluation brings back).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from meshensemble.numerics import statmath, sums
from meshensemble.numerics.sums import adaptive_ece_from_examples as adaptive_ece_from_examples


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
    num_bins = statmath.check_num_bins(num_bins)
    return _calibration_bins_core(*statmath.check_basic(probs, labels, mask), num_bins=num_bins)


@functools.partial(jax.jit, static_argnames="num_bins")
def _calibration_bins_core(probs: Any, labels: Any, mask: Any, num_bins: int) -> dict:
    probs = statmath.as_float(probs)
    w = statmath.weights(mask, probs.shape[0], probs.dtype)
    ex = statmath.per_example(probs, labels, num_bins)  # XLA drops the parts not used here
    count, conf_sum, correct_sum = statmath.bin_sums(
        ex["conf"], ex["correct"], ex["bin"], w, num_bins
    )
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
      >>> bins = {"count": [0, 2], "confidence_sum": [0.0, 1.5], "correct_sum": [0.0, 1.0]}
      >>> reliability_from_bins(bins, 2)["accuracy"]      # bin 0 is empty
      array([nan, 0.5])
      >>> reliability_from_bins(calibration_bins(probs, labels), 15)["accuracy"].shape
      (15,)
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


def adaptive_ece(
    probs: ArrayLike, labels: ArrayLike, num_bins: int = 15, mask: ArrayLike | None = None
) -> float:
    """Adaptive (equal-mass) expected calibration error of one model (host function).

    The masked-in examples are sorted by confidence ``conf_i = max_c p_ic`` (ties keep their
    example order) and cut into ``num_bins`` groups of equal counts (``np.array_split``:
    the first ``n % num_bins`` groups hold one more); then
    ``ace = sum_b (n_b / n) |acc_b - conf_b|`` (Nixon et al. 2019, "Measuring calibration
    in deep learning"; top-label and L1 as torch-uncertainty's
    ``AdaptiveCalibrationError``). Unlike :func:`ece`, every bin holds about ``n / B``
    examples, so the error is not dominated by the few bins where confident predictions
    pile up. See :func:`adaptive_ece_from_examples` for the weighted form.

    Args:
      probs: `[N, classes]` predicted probabilities.
      labels: `[N]` integer class indices.
      num_bins: number of equal-mass bins ``B``.
      mask: optional `[N]` bools or 0/1 weights; only masked-in examples count.

    Returns:
      The adaptive ECE in ``[0, 1]`` as a python float (``nan`` if no example is masked in).

    Raises:
      ValueError: if the shapes are wrong or ``num_bins < 1``.

    Example:
      >>> round(adaptive_ece([[0.9, 0.1], [0.4, 0.6], [0.8, 0.2], [0.3, 0.7]], [0, 0, 0, 1], 2), 4)
      0.15
    """
    num_bins = statmath.check_num_bins(num_bins)
    probs, labels, mask = statmath.check_basic(probs, labels, mask)
    ex = jax.device_get(_examples_core(probs, labels, mask))
    return adaptive_ece_from_examples(ex["confidence"], ex["correct"], num_bins, ex["weight"])


@jax.jit
def _examples_core(probs: Any, labels: Any, mask: Any) -> dict[str, jax.Array]:
    return sums.example_stats(probs, labels, mask)
