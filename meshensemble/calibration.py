"""Post-hoc calibration of a trained ensemble: temperature scaling and conformal prediction sets.

Both are fitted on held-out data (a validation split, never the test set) and applied to new
predictions:

* **Temperature scaling** (Guo et al. 2017, "On calibration of modern neural networks"):
  one scalar ``T > 0`` divides the logits, ``softmax(z / T)``, chosen to minimise the NLL
  of the held-out labels (:func:`fit_temperature`). Accuracy is unchanged (the argmax is
  the same); the confidence shrinks (``T > 1``) or grows (``T < 1``). For an ensemble,
  *pool, then calibrate*: fit one ``T`` on ``log(mean_m p^m)`` (:func:`ensemble_logits`),
  the logits of the ensemble's own prediction; ``fit_temperature(member_logits, labels,
  per_member=True)`` fits one ``T`` per member instead (calibrate, then pool).
* **Split conformal prediction** (Vovk et al. 2005; Angelopoulos & Bates 2021, "A gentle
  introduction to conformal prediction"): a score ``s(x, y)`` (large = the label looks
  unlikely), its finite-sample corrected quantile ``q`` over ``n`` calibration examples
  (:func:`conformal_quantile`), and the sets ``C(x) = {c : s(x, c) <= q}``
  (:func:`prediction_sets`). If calibration and test examples are exchangeable,
  ``P(y in C(x)) >= 1 - alpha`` whatever the model. Scores (:data:`METHODS`): ``"thr"``
  (``1 - p_y``; Sadinle et al. 2019: the smallest sets on average), ``"aps"`` (adaptive
  prediction sets, Romano et al. 2020: the probability mass of the classes ranked at or
  above ``y``) and ``"raps"`` (regularised APS, Angelopoulos et al. 2021: APS plus
  ``lam * max(0, rank(y) - k_reg)``, which discourages long tails of unlikely classes).

Everything runs with ``jax.numpy`` on numpy or jax input, including global ``jax.Array``
sharded over a mesh (the reductions run where the data is; only scalars such as the NLL's
derivative, the quantile or a mean set size come back to the host).

Example:
  >>> import meshensemble as me
  >>> logits = me.calibration.ensemble_logits(val_member_probs)        # [N, C]
  >>> t = me.calibration.fit_temperature(logits, val_labels)
  >>> val = me.calibration.apply_temperature(logits, t)               # calibrated [N, C]
  >>> q = me.calibration.conformal_quantile(val, val_labels, alpha=0.1)
  >>> test = me.calibration.apply_temperature(
  ...     me.calibration.ensemble_logits(test_member_probs), t)
  >>> sets = me.calibration.prediction_sets(test, q)                  # bool [N_test, C]
  >>> me.calibration.coverage(sets, test_labels), me.calibration.set_size(sets)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from meshensemble.core import calibmath, statmath

__all__ = [
    "METHODS",
    "apply_temperature",
    "apply_temperature_to_probs",
    "conformal_quantile",
    "conformal_scores",
    "coverage",
    "ensemble_logits",
    "fit_temperature",
    "prediction_sets",
    "set_size",
]

METHODS = ("thr", "aps", "raps")
"""Conformal scores that :func:`conformal_quantile` and :func:`prediction_sets` accept."""

_GRID = 15  # interior points per round of the temperature search (one device call each)


# --------------------------------------------------------------------------- checks


def _check_labels(labels: Any, n: int, classes: int) -> Any:
    """``labels`` as an integer `[n]` array with values in ``[0, classes)`` (one-line errors)."""
    labels = statmath.check_labels(labels, n)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(
            f"`labels` must be integer class indices, got dtype {labels.dtype}; "
            "use labels.astype(int)."
        )
    lo, hi = (int(v) for v in jax.device_get(_min_max(labels)))
    if lo < 0 or hi >= classes:
        raise ValueError(
            f"`labels` must lie in [0, {classes}) for {classes} classes, got range "
            f"[{lo}, {hi}]; fix the labels or the class count."
        )
    return labels


@jax.jit
def _min_max(labels: Any) -> tuple[jax.Array, jax.Array]:
    return jnp.min(labels), jnp.max(labels)


def _check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown conformal method {method!r}; use one of {METHODS}.")
    return method


def _check_score_kwargs(score_kwargs: dict[str, Any]) -> None:
    unknown = set(score_kwargs) - {"k_reg", "lam", "randomized", "seed"}
    if unknown:
        raise ValueError(
            f"unknown score arguments {sorted(unknown)}; use k_reg, lam, randomized or seed."
        )


def _check_sets(sets: Any) -> Any:
    sets = statmath.check_probs(sets, 2, "sets")
    if sets.shape[0] == 0:
        raise ValueError("`sets` holds no example; pass the sets of at least one example.")
    return sets


def _check_alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, int | float | np.floating):
        raise ValueError(f"`alpha` must be a float in (0, 1), got {alpha!r}.")
    if not 0.0 < float(alpha) < 1.0:
        raise ValueError(f"`alpha` must lie in (0, 1) (the miscoverage rate), got {alpha!r}.")
    return float(alpha)


def _temperature_array(temperature: Any, logits: Any) -> jax.Array:
    """``temperature`` broadcast against ``logits``: a scalar, or `[M]` for `[M, N, C]`."""
    try:
        t = jnp.asarray(temperature, dtype=jnp.result_type(float))
    except (TypeError, ValueError):
        raise ValueError(
            f"`temperature` must be a number > 0 (or [members] of them), got {temperature!r}."
        ) from None
    if t.ndim == 1 and logits.ndim == 3 and t.shape[0] == logits.shape[0]:
        t = t[:, None, None]
    elif t.ndim != 0:
        raise ValueError(
            f"`temperature` must be a scalar, or [members] = [{logits.shape[0]}] for member "
            f"logits [members, N, C]; got shape {tuple(t.shape)} for logits "
            f"{tuple(logits.shape)}."
        )
    if isinstance(temperature, jax.core.Tracer):  # inside jit: only the shape is known
        return t
    host = np.asarray(jax.device_get(temperature), np.float64)
    if not np.all((host > 0) & np.isfinite(host)):
        raise ValueError(
            f"`temperature` must be finite and > 0, got {host.ravel().tolist()}; "
            "pass the T that fit_temperature returned."
        )
    return t


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
      >>> np.round(np.exp(np.asarray(z)), 4).tolist()
      [[0.7, 0.3]]
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
      >>> np.round(np.asarray(apply_temperature([[2.0, 0.0]], 2.0)), 4).tolist()
      [[0.7311, 0.2689]]
    """
    logits = statmath.as_float(calibmath.check_rows(logits, None, "logits", False))
    return _apply_core(logits, _temperature_array(temperature, logits))


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
      >>> np.round(np.asarray(apply_temperature_to_probs([[0.8, 0.2]], 0.5)), 4).tolist()
      [[0.9412, 0.0588]]
    """
    probs = statmath.as_float(calibmath.check_rows(probs, None, "probs", True))
    return _apply_core(statmath.clipped_log(probs), _temperature_array(temperature, probs))


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
      >>> ts = fit_temperature(member_logits, val_labels, per_member=True)  # [members]
    """
    logits = calibmath.check_rows(logits, 3 if per_member else 2, "logits", False)
    member_logits = logits if per_member else logits[None]
    _, n, c = member_logits.shape
    labels = _check_labels(labels, n, c)
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
        grid = a[:, None] + (b - a)[:, None] * np.arange(1, _GRID + 1) / (_GRID + 1)
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
      >>> np.round(np.asarray(conformal_scores([[0.6, 0.1, 0.3]], "aps")), 4).tolist()
      [[0.6, 1.0, 0.9]]
    """
    return _scores(
        calibmath.check_rows(probs, 2, "probs", True), method, k_reg, lam, randomized, seed
    )


def _scores(
    probs: Any, method: str, k_reg: int, lam: float, randomized: bool, seed: int
) -> jax.Array:
    """:func:`conformal_scores` of already checked ``probs``."""
    _check_method(method)
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
    """
    alpha = _check_alpha(alpha)
    _check_method(method)
    _check_score_kwargs(score_kwargs)
    probs = calibmath.check_rows(probs, 2, "probs", True)
    n, c = probs.shape
    labels = _check_labels(labels, n, c)
    # The small slack keeps (n + 1)(1 - alpha) = 9.000000000000002 from rounding up to 10.
    k = math.ceil((n + 1) * (1.0 - alpha) - 1e-9)
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
    _check_method(method)
    _check_score_kwargs(score_kwargs)
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
    sets = _check_sets(sets)
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
    sets = _check_sets(sets)
    labels = _check_labels(labels, sets.shape[0], sets.shape[1])
    return float(jax.device_get(_covered(sets, labels)))


@jax.jit
def _covered(sets: Any, labels: Any) -> jax.Array:
    hit = jnp.take_along_axis(jnp.asarray(sets), labels[:, None], axis=-1)[:, 0]
    return jnp.mean(hit.astype(jnp.float32))


# --------------------------------------------------------------------------- regression
__all__ += ["conformal_interval_quantile", "fit_variance_scale"]


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
      >>> out = ens.predict(state, x_val)
      >>> s = me.calibration.fit_variance_scale(out["mean"], out["variance"], y_val)
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
      >>> q = me.calibration.conformal_interval_quantile(mu_cal, sd_cal, y_cal, alpha=0.1)
      >>> lo, hi = mu_test - q * sd_test, mu_test + q * sd_test
    """
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha!r} must be in (0, 1), e.g. 0.1 for 90% intervals")
    m, s, t = _regression_arrays(("mean", "std", "y"), mean, std, y)
    scores = np.sort((np.abs(t - m) / s).reshape(-1))
    k = math.ceil((scores.size + 1) * (1 - alpha))
    return float("inf") if k > scores.size else float(scores[k - 1])
