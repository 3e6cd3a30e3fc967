"""The sums an evaluation streams over batches (per device, on the mesh) and their finalisation
on the host.

Each device calls :func:`streaming_stats` on its local members and its part of a batch; the
sums are ``psum``-ed over ``data`` (the ``member_*`` sums stay split over ``ensemble``) and
:func:`finalize_stats` turns the full-set sums into metrics on the host. The members'
``[members, N, classes]`` probabilities are never gathered to one place.

The helpers below (argument checks, per-example NLL / Brier / entropy, confidence bins,
weighted sums) are the math of those sums; :mod:`meshensemble.metrics` builds its
single-batch metrics from the same helpers, so both compute every quantity one way. The
conventions (masks, the NLL clip :data:`EPS`, the Brier sum over classes, the bin edges) are
those of :mod:`meshensemble.metrics`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

EPS = 1e-12
"""Lower clip on the true-class probability in the NLL, so that ``log(0)`` never occurs."""

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
"""Keys of :func:`streaming_stats` with a leading member axis (concatenated over ``ensemble``)."""

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
"""Keys of :func:`streaming_stats` that do not depend on which members a device holds."""


# --------------------------------------------------------------------------- argument checks


def as_array(x: Any) -> Any:
    """``x`` itself if it is an array (numpy, jax or tracer), else ``np.asarray(x)``.

    No device op runs here: conversion and casting happen inside the jitted cores, so eager
    calls compile once per shape instead of once per primitive.
    """
    return x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x)


def check_probs(probs: Any, ndim: int, name: str) -> Any:
    """``as_array(probs)`` after checking its rank: 2 (`[N, C]`) or 3 (`[members, N, C]`).

    Raises:
      ValueError: naming ``name``, if the rank is not ``ndim``.
    """
    probs = as_array(probs)
    if probs.ndim != ndim:
        want = "[N, classes]" if ndim == 2 else "[members, N, classes]"
        raise ValueError(
            f"`{name}` must be {ndim}-D {want}, got shape {tuple(probs.shape)}; "
            f"reshape it to {want}."
        )
    return probs


def check_labels(labels: Any, n: int) -> Any:
    """``as_array(labels)`` after checking it is `[n]` (the values are not checked here).

    Raises:
      ValueError: if ``labels`` is not 1-D of length ``n``.
    """
    labels = as_array(labels)
    if labels.ndim != 1 or labels.shape[0] != n:
        raise ValueError(
            f"`labels` must be 1-D of length N={n} (integer class indices), "
            f"got shape {tuple(labels.shape)}; pass one label per example."
        )
    return labels


def check_mask(mask: Any, n: int) -> Any:
    """``mask``: None, or ``as_array(mask)`` after checking it is `[n]`.

    Raises:
      ValueError: if ``mask`` is not 1-D of length ``n``.
    """
    if mask is None:
        return None
    mask = as_array(mask)
    if mask.ndim != 1 or mask.shape[0] != n:
        raise ValueError(
            f"`mask` must be 1-D of length N={n} (bools or 0/1 weights), "
            f"got shape {tuple(mask.shape)}; pass one weight per example."
        )
    return mask


def check_basic(probs: Any, labels: Any, mask: Any) -> tuple[Any, Any, Any]:
    """``(probs, labels, mask)`` after checking they are `[N, C]`, `[N]` and `[N]` or None.

    Raises:
      ValueError: if a shape is wrong.
    """
    probs = check_probs(probs, 2, "probs")
    n = probs.shape[0]
    return probs, check_labels(labels, n), check_mask(mask, n)


def check_num_bins(num_bins: int) -> int:
    """``int(num_bins)`` after checking it is a positive integer.

    Raises:
      ValueError: if it is not a positive int (bools and floats are rejected).
    """
    if isinstance(num_bins, bool) or not isinstance(num_bins, int | np.integer) or num_bins < 1:
        raise ValueError(f"`num_bins` must be a positive int, got {num_bins!r}.")
    return int(num_bins)


# --------------------------------------------------------------------------- traceable math


def as_float(x: Any) -> jax.Array:
    """``x`` as a jax array of a floating dtype (integers become the default float)."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.result_type(float))
    return x


def nll_clip(dtype: Any) -> float:
    """The NLL's lower clip for ``dtype``: ``max(EPS, finfo(dtype).tiny)``."""
    return max(EPS, float(jnp.finfo(dtype).tiny))


def weights(mask: Any, n: int, dtype: Any) -> jax.Array:
    """The `[n]` float weights of a checked ``mask`` (all ones when ``mask`` is None)."""
    if mask is None:
        return jnp.ones((n,), dtype)
    return jnp.asarray(mask).astype(dtype)


def onehot(labels: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """One-hot ``labels`` `[N]` as `[N, C]`, broadcast explicitly to ``shape`` `[..., N, C]`."""
    return jnp.broadcast_to(jax.nn.one_hot(labels, shape[-1], dtype=dtype), shape)


def shannon_entropy(probs: Any) -> jax.Array:
    """``-sum_c p_c log p_c`` over the last axis, with ``0 log 0 = 0`` (no clip): `[...]`."""
    probs = as_float(probs)
    pos = probs > 0
    plogp = jnp.where(pos, probs * jnp.log(jnp.where(pos, probs, 1.0)), 0.0)
    return 0.0 - jnp.sum(plogp, axis=-1)  # 0 - x, not -x: a one-hot gives +0.0, not -0.0


def bin_index(conf: jax.Array, num_bins: int) -> jax.Array:
    """Equal-width bin index in ``[0, num_bins)`` of confidences in ``[0, 1]`` (same shape)."""
    idx = jnp.floor(conf * num_bins).astype(jnp.int32)
    return jnp.clip(idx, 0, num_bins - 1)


def bin_sums(
    conf: jax.Array, correct: jax.Array, idx: jax.Array, w: jax.Array, num_bins: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Weighted per-bin ``(count, confidence_sum, correct_sum)``, each `[..., num_bins]`.

    ``conf``, ``correct`` and ``idx`` are `[..., N]`; ``w`` is `[N]`. Masked-out entries
    contribute exactly 0, even when their confidence is NaN.
    """
    w = jnp.broadcast_to(w, conf.shape)
    keep = w != 0
    conf = jnp.where(keep, conf, 0.0)  # a masked-out NaN must not leak through 0 * NaN
    correct = jnp.where(keep, correct, 0.0)
    hot = jax.nn.one_hot(idx, num_bins, dtype=conf.dtype) * w[..., None]  # [..., N, B]
    count = jnp.sum(hot, axis=-2)
    conf_sum = jnp.sum(hot * conf[..., None], axis=-2)
    correct_sum = jnp.sum(hot * correct[..., None], axis=-2)
    return count, conf_sum, correct_sum


def wsum(x: jax.Array, w: jax.Array) -> jax.Array:
    """``sum(w * x)`` over the last axis of ``x`` `[..., N]` with ``w`` `[N]`: `[...]`.

    Masked-out entries (``w == 0``) contribute exactly 0 even if ``x`` is NaN/inf there.
    """
    w = jnp.broadcast_to(w, x.shape)
    return jnp.sum(jnp.where(w != 0, x * w, 0.0), axis=-1)


def per_example(probs: jax.Array, labels: jax.Array, num_bins: int) -> dict[str, jax.Array]:
    """Per-example quantities of ``probs`` `[..., N, C]` (float) and ``labels`` `[N]`.

    Args:
      probs: `[..., N, C]` float probabilities.
      labels: `[N]` integer class indices.
      num_bins: the number of confidence bins.

    Returns:
      `[..., N]` arrays ``correct`` (1 where the argmax is the label), ``nll``
      (``-log max(p_y, nll_clip)``), ``brier`` (summed over classes), ``entropy``, ``conf``
      (the max probability) and the int ``bin`` of the confidence.
    """
    dtype = probs.dtype
    hot = onehot(labels, probs.shape, dtype)
    true_p = jnp.sum(probs * hot, axis=-1)
    pred = jnp.argmax(probs, axis=-1)
    conf = jnp.max(probs, axis=-1)
    return {
        "correct": (pred == jnp.broadcast_to(labels, pred.shape)).astype(dtype),
        "nll": -jnp.log(jnp.maximum(true_p, nll_clip(dtype))),
        "brier": jnp.sum(jnp.square(probs - hot), axis=-1),
        "entropy": shannon_entropy(probs),
        "conf": conf,
        "bin": bin_index(conf, num_bins),
    }


# --------------------------------------------------------------------------- streaming sums


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
      ``member_bin_count/conf/correct[k, b]``: the calibration bin sums of member k;
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
    num_bins = check_num_bins(num_bins)
    member_probs = check_probs(member_probs, 3, "member_probs")
    ensemble_probs = check_probs(ensemble_probs, 2, "ensemble_probs")
    _, b, c = member_probs.shape
    if ensemble_probs.shape != (b, c):
        raise ValueError(
            f"`ensemble_probs` must be [b, C] = {(b, c)} to match `member_probs` "
            f"{tuple(member_probs.shape)}, got {tuple(ensemble_probs.shape)}."
        )
    labels = check_labels(labels, b)
    if mask is None:
        raise ValueError("`mask` is required: pass jnp.ones(b) when there is no padding.")
    mask = check_mask(mask, b)
    return _streaming_sums_jit(member_probs, ensemble_probs, labels, mask, num_bins=num_bins)


def streaming_sums(
    member_probs: Any, ensemble_probs: Any, labels: Any, mask: Any, num_bins: int
) -> dict[str, jax.Array]:
    """The traceable body of :func:`streaming_stats` (same arguments, ``mask`` not None).

    For callers that have checked the arguments and trace it inside their own ``jit``.
    """
    member_probs = as_float(member_probs)
    ensemble_probs = jnp.asarray(ensemble_probs).astype(member_probs.dtype)
    w = weights(mask, member_probs.shape[1], member_probs.dtype)

    # The ensemble sums use only ensemble_probs, labels and mask (not member_probs), so inside
    # shard_map they stay invariant over the member axis and can leave with out_specs P().
    mem = per_example(member_probs, labels, num_bins)  # each [m, b]
    ens = per_example(ensemble_probs, labels, num_bins)  # each [b]
    ens_pred = jnp.argmax(ensemble_probs, axis=-1)
    member_pred = jnp.argmax(member_probs, axis=-1)
    disagree = (member_pred != jnp.broadcast_to(ens_pred, member_pred.shape)).astype(w.dtype)
    names = ("correct", "nll", "brier", "entropy")
    m_sums = wsum(jnp.stack([*(mem[k] for k in names), disagree]), w)  # [5, m]
    e_sums = wsum(jnp.stack([ens[k] for k in names]), w)  # [4]
    m_count, m_conf, m_correct = bin_sums(mem["conf"], mem["correct"], mem["bin"], w, num_bins)
    e_count, e_conf, e_correct = bin_sums(ens["conf"], ens["correct"], ens["bin"], w, num_bins)
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


_streaming_sums_jit = functools.partial(jax.jit, static_argnames="num_bins")(streaming_sums)


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
      The dict of :func:`meshensemble.metrics.ensemble_metrics`: python floats ``accuracy``,
      ``nll``, ``brier``, ``ece``, ``entropy``, ``expected_entropy``, ``mutual_information``,
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
    num_bins = check_num_bins(num_bins)
    keys = (*MEMBER_STAT_KEYS, *ENSEMBLE_STAT_KEYS)
    missing = [k for k in keys if k not in stats]
    if missing:
        raise ValueError(f"`stats` lacks keys {missing}; pass the output of streaming_stats.")
    s = {k: np.asarray(stats[k], dtype=np.float64) for k in keys}
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
