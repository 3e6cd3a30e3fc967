"""The argument checks and per-example math of the evaluation statistics.

Shared by :mod:`meshensemble.numerics.sums` (the streamed sums) and :mod:`meshensemble.metrics`
(the single-batch metrics), so that every quantity is computed one way. The conventions
(masks, the NLL clip :data:`EPS`, the Brier sum over classes, the bin edges) are those of
:mod:`meshensemble.metrics`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

EPS = 1e-12
"""Lower clip on the true-class probability in the NLL, so that ``log(0)`` never occurs."""


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
    return _check_rows(labels, n, "labels", "integer class indices", "label")


def check_mask(mask: Any, n: int) -> Any:
    """``mask``: None, or ``as_array(mask)`` after checking it is `[n]`.

    Raises:
      ValueError: if ``mask`` is not 1-D of length ``n``.
    """
    return None if mask is None else _check_rows(mask, n, "mask", "bools or 0/1 weights", "weight")


def _check_rows(x: Any, n: int, name: str, what: str, one: str) -> Any:
    """``as_array(x)`` after checking it is `[n]`: one ``one`` per example."""
    x = as_array(x)
    if x.ndim != 1 or x.shape[0] != n:
        raise ValueError(
            f"`{name}` must be 1-D of length N={n} ({what}), "
            f"got shape {tuple(x.shape)}; pass one {one} per example."
        )
    return x


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
    """``-sum_c p_c log p_c`` over the last axis, with ``0 log 0 = 0`` (no clip): `[...]`.

    Only exact zeros count as 0: a NaN or negative entry gives NaN, never a false 0.0.
    """
    probs = as_float(probs)
    zero = probs == 0
    plogp = jnp.where(zero, 0.0, probs * jnp.log(jnp.where(zero, 1.0, probs)))
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


def clipped_log(probs: jax.Array) -> jax.Array:
    """``log(max(p, nll_clip(dtype)))`` elementwise: the log the pairwise KL uses (finite)."""
    return jnp.log(jnp.maximum(probs, nll_clip(probs.dtype)))


# --------------------------------------------------------------------------- OOD scores

OOD_SCORE_KINDS = ("max_prob", "entropy", "mutual_information", "max_logit", "energy")
"""The per-example OOD scores :func:`ood_score_of` computes from :func:`logit_summaries`."""
MEMBER_OOD_KINDS = ("max_prob", "entropy", "max_logit", "energy")
"""OOD scores of a single member (its mutual information is 0)."""
OOD_BIN_KEYS = ("count", "confidence_sum", "correct_sum")
"""The reliability-diagram sums per confidence bin (:func:`bin_sums`' three results)."""


def logit_summaries(member_logits: jax.Array) -> dict[str, jax.Array]:
    """The members' means that every OOD score needs, from ``[members, N, C]`` logits.

    Means over the members axis (0) only, so a device can take them over its local members
    and ``pmean`` them over ``ensemble`` (:func:`meshensemble.core.steps.ood_stats`).

    Returns:
      ``probs`` ``[N, C]`` (the mean softmax), ``expected_entropy`` ``[N]`` (the members'
      mean entropy), ``max_logit`` and ``logsumexp`` ``[N]`` (the members' mean max logit
      and log-sum-exp).

    Example:
      >>> s = logit_summaries(jnp.zeros((2, 3, 4)))
      >>> s["probs"].shape, float(s["expected_entropy"][0]) == float(jnp.log(4.0))
      ((3, 4), True)
    """
    z = as_float(member_logits)
    p = jax.nn.softmax(z, axis=-1)
    return {
        "probs": jnp.mean(p, axis=0),
        "expected_entropy": jnp.mean(shannon_entropy(p), axis=0),
        "max_logit": jnp.mean(jnp.max(z, axis=-1), axis=0),
        "logsumexp": jnp.mean(jax.nn.logsumexp(z, axis=-1), axis=0),
    }


def ood_score_of(kind: str, summaries: dict[str, jax.Array]) -> jax.Array:
    """One OOD score per example (higher: more OOD) from the members' means.

    ``max_prob``: ``1 - max_c pbar_c``; ``entropy``: ``H(pbar)``; ``mutual_information``:
    ``max(H(pbar) - E_m H(p_m), 0)``; ``max_logit``: ``-E_m max_c z_c``; ``energy``:
    ``-E_m logsumexp_c z_c``. ``summaries`` holds ``probs`` (and ``expected_entropy``,
    ``max_logit``, ``logsumexp`` for the kinds that use them), as
    :func:`logit_summaries` returns.

    Example:
      >>> float(ood_score_of("max_prob", {"probs": jnp.array([0.75, 0.25])}))
      0.25
    """
    if kind == "max_logit":
        return 0.0 - summaries["max_logit"]
    if kind == "energy":
        return 0.0 - summaries["logsumexp"]
    if kind == "max_prob":
        return 1.0 - jnp.max(summaries["probs"], axis=-1)
    entropy = shannon_entropy(summaries["probs"])
    if kind == "entropy":
        return entropy
    return jnp.maximum(entropy - summaries["expected_entropy"], 0.0)


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Default per-example loss: softmax cross-entropy with integer labels.

    Computed as the Flax HOWTO computes it, against one-hot labels
    (``optax.softmax_cross_entropy``): the same value as
    ``optax.softmax_cross_entropy_with_integer_labels`` up to float rounding, without
    its gather and scatter, which XLA:CPU runs slowly (2-3% of the user CNN's step on 8
    CPU devices).

    Args:
      logits: ``[B, classes]``.
      labels: ``[B]`` integer class indices.

    Returns:
      ``[B]`` losses.

    Example:
      >>> me.softmax_cross_entropy(jnp.zeros((2, 10)), jnp.array([1, 2]))  # log 10 each
      Array([2.3025851, 2.3025851], dtype=float32)
    """
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, logits.shape[-1]))
