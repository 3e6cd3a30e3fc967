"""Split conformal prediction sets for classification: scores (THR, APS, RAPS), the
finite-sample quantile, the sets, their coverage and size.

Example:
  >>> q = conformal_quantile(val_probs, val_labels, alpha=0.1)   # probabilities [N, C]
  >>> sets = prediction_sets(test_probs, q)            # bool [N, C]
  >>> sets.shape
  (16, 10)
  >>> coverage(sets, test_labels) >= 0.5, set_size(sets) <= 10   # floats; 0.9 expected
  (True, True)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from meshensemble.calibration import _rows as calibmath
from meshensemble.calibration._checks import (
    check_alpha,
    check_labels,
    check_method,
    check_score_kwargs,
    check_sets,
    conformal_rank,
)
from meshensemble.numerics import statmath


def conformal_scores(
    probs: ArrayLike,
    method: str = "thr",
    *,
    k_reg: int = 5,
    lam: float = 0.01,
    randomized: bool = False,
    seed: int = 0,
) -> jax.Array:
    """The nonconformity score ``s(x, c)`` of every class: large means ``c`` looks unlikely.

    With ``p`` one example's probabilities, ``pi`` the classes sorted by decreasing ``p``
    (ties: the lower class index first) and ``rank(c)`` the 1-based position of ``c``:

    * ``"thr"``: ``s(x, c) = 1 - p_c``;
    * ``"aps"``: ``s(x, c) = sum_{c' ranked at or above c} p_c'`` (the cumulative mass down
      to ``c``); with ``randomized`` ``u * p_c`` is subtracted, ``u`` in ``[0, 1)`` per
      example (coverage close to ``1 - alpha`` instead of above it; the default,
      non-randomised score gives larger, deterministic sets);
    * ``"raps"``: the APS score plus ``lam * max(0, rank(c) - k_reg)``.

    The randomisation ``u`` is a function of the example, not of its position: a 32-bit
    hash of the bytes of its probability row (``-0.0`` read as ``0.0``) and of ``seed``,
    scaled to ``[0, 1)``. An example therefore gets the same scores alone, in any batch or
    on any mesh, and the score is one fixed function of ``(x, y)``: split conformal's
    ``>= 1 - alpha`` guarantee holds for one-at-a-time calls exactly as for batched ones.
    Identical rows share their ``u``.

    Args:
      probs: `[N, classes]` probabilities (e.g. temperature-scaled); each row non-negative
        and summing to 1.
      method: one of :data:`METHODS`.
      k_reg: RAPS: the number of top classes free of the penalty (defaults from
        Angelopoulos & Bates' RAPS example; tune on held-out data).
      lam: RAPS: the penalty per class ranked below ``k_reg``.
      randomized: APS/RAPS: subtract ``u * p_c`` (``u`` the hash of the row and ``seed``).
      seed: an int, the seed of the randomisation (use the same one to calibrate and
        predict).

    Returns:
      `[N, classes]` float scores (the dtype of ``probs``: float64 stays float64 under
      ``jax_enable_x64``).

    Raises:
      ValueError: if ``probs`` is not 2-D, empty, not finite, negative or its rows do not
        sum to 1, ``method`` is unknown, ``k_reg < 0``, ``lam < 0`` or ``seed`` not an int.

    Example:
      >>> np.round(np.asarray(conformal_scores([[0.6, 0.1, 0.3]], "aps")), 4)
      array([[0.6, 1. , 0.9]], dtype=float32)
    """
    return _scores(
        calibmath.check_rows(probs, 2, "probs", True), method, k_reg, lam, randomized, seed
    )


def _scores(
    probs: Any, method: str, k_reg: int, lam: float, randomized: bool, seed: int
) -> jax.Array:
    """:func:`conformal_scores` of already checked ``probs``."""
    check_method(method)
    if isinstance(k_reg, bool) or not isinstance(k_reg, int | np.integer) or k_reg < 0:
        raise ValueError(f"`k_reg` must be an int >= 0, got {k_reg!r}.")
    if not float(lam) >= 0.0 or not math.isfinite(float(lam)):
        raise ValueError(f"`lam` must be finite and >= 0, got {lam!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise ValueError(f"`seed` must be an int, got {seed!r}.")
    words = np.array([int(seed) & 0xFFFFFFFF, (int(seed) >> 32) & 0xFFFFFFFF], np.uint32)
    use_u = bool(randomized) and method != "thr"
    return _scores_core(
        probs, words, method=method, k_reg=int(k_reg), lam=float(lam), randomized=use_u
    )


@functools.partial(jax.jit, static_argnames=("method", "k_reg", "lam", "randomized"))
def _scores_core(
    probs: Any, words: Any, method: str, k_reg: int, lam: float, randomized: bool
) -> jax.Array:
    p = statmath.as_float(probs)
    if method == "thr":
        return 1.0 - p
    order = jnp.argsort(-p, axis=-1, stable=True)  # descending, ties: lower class first
    ranked = jnp.take_along_axis(p, order, axis=-1)
    score = jnp.cumsum(ranked, axis=-1)
    if randomized:
        score = score - calibmath.row_uniform(p, words).astype(p.dtype)[:, None] * ranked
    if method == "raps":
        rank = jnp.arange(1, p.shape[-1] + 1, dtype=p.dtype)[None, :]
        score = score + lam * jnp.maximum(rank - k_reg, 0.0)
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(score, inverse, axis=-1)


def conformal_quantile(
    probs: ArrayLike,
    labels: ArrayLike,
    alpha: float,
    method: str = "thr",
    **score_kwargs: Any,
) -> float:
    """The split-conformal threshold ``q``: the ``ceil((n + 1)(1 - alpha))``-th smallest score.

    The calibration scores are ``s_i = s(x_i, y_i)`` (:func:`conformal_scores`). With the
    finite-sample correction ``k = ceil((n + 1)(1 - alpha))``, ``q = s_(k)`` (the k-th
    smallest) gives ``P(s_test <= q) >= 1 - alpha`` for an exchangeable test example, so
    :func:`prediction_sets` with this ``q`` covers the true label with probability at least
    ``1 - alpha`` (and at most ``1 - alpha + 1 / (n + 1)`` when scores have no ties).
    ``q`` is exactly one of the scores, in their dtype (float64 under ``jax_enable_x64``
    with float64 input), so every calibration example whose score is ``<= q`` is in its
    own set.

    Args:
      probs: `[n, classes]` probabilities of the calibration examples (held out; the same
        model and temperature as the test predictions); rows non-negative, summing to 1.
      labels: `[n]` integer class indices.
      alpha: the miscoverage rate in ``(0, 1)``, e.g. ``0.1`` for 90% coverage.
      method: one of :data:`METHODS`.
      **score_kwargs: ``k_reg``, ``lam``, ``randomized``, ``seed`` of
        :func:`conformal_scores` (pass the same to :func:`prediction_sets`).

    Returns:
      ``q`` as a python float.

    Raises:
      ValueError: if ``alpha`` is not in ``(0, 1)`` or too small for ``n``
        (``k > n``, i.e. ``n < 1 / alpha - 1``), ``probs`` is empty, not finite, negative
        or its rows do not sum to 1, or the shapes, labels or score arguments are invalid.

    Example:
      >>> q = conformal_quantile(val_probs, val_labels, alpha=0.1)
      >>> sets = prediction_sets(test_probs, q)
      >>> type(q), sets.shape
      (<class 'float'>, (16, 10))
    """
    alpha = check_alpha(alpha)
    check_method(method)
    check_score_kwargs(score_kwargs)
    probs = calibmath.check_rows(probs, 2, "probs", True)
    n, c = probs.shape
    labels = check_labels(labels, n, c)
    k = conformal_rank(n, alpha)
    if k > n:
        need = math.ceil((1.0 - alpha) / alpha - 1e-9)
        raise ValueError(
            f"alpha={alpha} is too small for n={n} calibration examples: split conformal "
            f"needs n >= 1/alpha - 1 = {need}; use more calibration examples or a larger alpha."
        )
    kw = {"k_reg": 5, "lam": 0.01, "randomized": False, "seed": 0} | score_kwargs
    scores = _scores(probs, method, **kw)
    return float(jax.device_get(_kth_true_score(scores, labels, k=max(k, 1))))


@functools.partial(jax.jit, static_argnames="k")
def _kth_true_score(scores: Any, labels: Any, k: int) -> jax.Array:
    true = jnp.take_along_axis(scores, labels[:, None], axis=-1)[:, 0]
    return calibmath.kth_smallest(true, k)


def prediction_sets(
    probs: ArrayLike, q: float, method: str = "thr", **score_kwargs: Any
) -> jax.Array:
    """Conformal prediction sets ``C(x) = {c : s(x, c) <= q}``.

    With ``q`` from :func:`conformal_quantile` (same ``method`` and score arguments),
    ``P(y in C(x)) >= 1 - alpha``. ``"thr"`` sets are ``{c : p_c >= 1 - q}`` and may be
    empty when no class is that likely; ``"aps"`` / ``"raps"`` sets are the top classes
    whose cumulative mass stays within ``q`` (empty when the top class alone exceeds it).
    Each row's set depends on that row alone (the randomisation too): an example gets the
    same set alone or in any batch.

    Args:
      probs: `[N, classes]` probabilities of the test examples; rows non-negative,
        summing to 1.
      q: the threshold, a finite scalar (a python float, or an array of shape `[]`).
      method: one of :data:`METHODS`.
      **score_kwargs: ``k_reg``, ``lam``, ``randomized``, ``seed`` of
        :func:`conformal_scores`.

    Returns:
      `[N, classes]` bool jax array: True where the class is in the set.

    Raises:
      ValueError: if ``probs`` is not 2-D, empty, not finite, negative or its rows do not
        sum to 1, ``q`` is not a finite scalar, or ``method`` is unknown.

    Example:
      >>> prediction_sets(np.array([[0.7, 0.2, 0.1]]), q=0.85).tolist()
      [[True, True, False]]
    """
    traced = isinstance(q, jax.core.Tracer)
    q_arr = q if traced else np.asarray(jax.device_get(q))
    if q_arr.shape not in ((), (1,)) or not jnp.issubdtype(q_arr.dtype, jnp.number):
        raise ValueError(
            f"`q` must be one threshold (a float from conformal_quantile), got an array of "
            f"shape {q_arr.shape} and dtype {q_arr.dtype}; pass float(q)."
        )
    if not traced and not np.isfinite(q_arr).all():
        raise ValueError(f"`q` must be finite, got {q_arr.item()}; recompute it on finite data.")
    check_method(method)
    check_score_kwargs(score_kwargs)
    scores = conformal_scores(probs, method, **score_kwargs)
    return _within(scores, jnp.asarray(q_arr, scores.dtype).reshape(()))


@jax.jit
def _within(scores: jax.Array, q: jax.Array) -> jax.Array:
    return scores <= q


def set_size(sets: ArrayLike) -> float:
    """Mean prediction-set size: ``mean_i |C(x_i)|``.

    Args:
      sets: `[N, classes]` bools from :func:`prediction_sets`.

    Returns:
      The mean number of classes per set, a python float.

    Raises:
      ValueError: if ``sets`` is not 2-D or holds no example.

    Example:
      >>> set_size(np.array([[True, False], [True, True]]))
      1.5
    """
    sets = check_sets(sets)
    return float(jax.device_get(_mean_size(sets)))


@jax.jit
def _mean_size(sets: Any) -> jax.Array:
    return jnp.mean(jnp.sum(jnp.asarray(sets, jnp.float32), axis=-1))


def coverage(sets: ArrayLike, labels: ArrayLike) -> float:
    """Empirical coverage: the fraction of examples whose label is in their set.

    Args:
      sets: `[N, classes]` bools from :func:`prediction_sets`.
      labels: `[N]` integer class indices.

    Returns:
      ``mean_i 1[y_i in C(x_i)]``, a python float.

    Raises:
      ValueError: if the shapes or labels are invalid.

    Example:
      >>> coverage(np.array([[True, False], [False, True]]), np.array([0, 0]))
      0.5
    """
    sets = check_sets(sets)
    labels = check_labels(labels, sets.shape[0], sets.shape[1])
    return float(jax.device_get(_covered(sets, labels)))


@jax.jit
def _covered(sets: Any, labels: Any) -> jax.Array:
    hit = jnp.take_along_axis(jnp.asarray(sets), labels[:, None], axis=-1)[:, 0]
    return jnp.mean(hit.astype(jnp.float32))
