"""Out-of-distribution detection: per-example OOD scores, AUROC and AUPR.

:func:`ood_score` (from probabilities) and :func:`ood_score_from_logits` (from logits, for
the max-logit and energy scores) are written with ``jax.numpy`` (jittable); :func:`auroc`
and :func:`aupr` are host functions on numpy that match ``sklearn.metrics``, with OOD as
the positive class.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from meshensemble.numerics import statmath

OOD_KINDS = ("max_prob", "entropy", "mutual_information")
"""The ``kind`` values that :func:`ood_score` accepts."""

LOGIT_OOD_KINDS = statmath.OOD_SCORE_KINDS  # (*OOD_KINDS, "max_logit", "energy")
"""The ``kind`` values that :func:`ood_score_from_logits` accepts (every kind of
:data:`OOD_KINDS`, from the softmax of the logits, and two that need the logits)."""


def ood_score(member_probs: ArrayLike, kind: str = "max_prob") -> jax.Array:
    """Per-example out-of-distribution score of an ensemble; higher means more OOD.

    With ``pbar_i = mean_m p^m_i`` the ensemble prediction:

    * ``"max_prob"``: ``1 - max_c pbar_ic`` (in ``[0, 1 - 1 / classes]``);
    * ``"entropy"``: ``H(pbar_i)``, the predictive entropy;
    * ``"mutual_information"``: :func:`meshensemble.metrics.mutual_information`.

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
    return _ood_score_core(statmath.check_probs(member_probs, 3, "member_probs"), kind=kind)


@functools.partial(jax.jit, static_argnames="kind")
def _ood_score_core(member_probs: Any, kind: str) -> jax.Array:
    p = statmath.as_float(member_probs)
    means = {"probs": jnp.mean(p, axis=0)}
    if kind == "mutual_information":
        means["expected_entropy"] = jnp.mean(statmath.shannon_entropy(p), axis=0)
    return statmath.ood_score_of(kind, means)


def ood_score_from_logits(member_logits: ArrayLike, kind: str = "energy") -> jax.Array:
    """Per-example OOD score of an ensemble from its members' logits; higher means more OOD.

    The two logit scores are each member's single-model score averaged over members
    (``z^m_i`` = member ``m``'s logits of example ``i``):

    * ``"max_logit"``: ``-(1 / M) sum_m max_c z^m_ic``, the negated maximum logit
      (MaxLogit, Hendrycks et al. 2022, "Scaling out-of-distribution detection for
      real-world settings");
    * ``"energy"``: ``(1 / M) sum_m E(z^m_i)`` with the free energy
      ``E(z) = -logsumexp_c z_c`` (Liu et al. 2020, "Energy-based out-of-distribution
      detection", temperature 1): in-distribution inputs get low energy;
    * the kinds of :data:`OOD_KINDS`: :func:`ood_score` of ``softmax(member_logits)``.

    Probabilities cannot give the two logit scores: the softmax is unchanged when a
    constant is added to all of an example's logits, and that constant is exactly what
    ``max_c z_c`` and ``logsumexp_c z_c`` keep (``log p_c = z_c - logsumexp(z)`` only holds
    differences of logits), so the overall logit magnitude these scores use is lost.

    Args:
      member_logits: `[members, N, classes]` member logits (``logits[None]`` for a single
        model).
      kind: one of :data:`LOGIT_OOD_KINDS`.

    Returns:
      `[N]` scores.

    Raises:
      ValueError: if ``kind`` is unknown or ``member_logits`` is not 3-D.

    Example:
      >>> z = [[[4.0, 0.0], [0.5, 0.0]]]
      >>> [round(float(v), 4) for v in ood_score_from_logits(z, "energy")]
      [-4.0181, -0.9741]
    """
    if kind not in LOGIT_OOD_KINDS:
        raise ValueError(f"unknown OOD score kind {kind!r}; use one of {LOGIT_OOD_KINDS}.")
    member_logits = statmath.check_probs(member_logits, 3, "member_logits")
    return _ood_logits_core(member_logits, kind=kind)


@functools.partial(jax.jit, static_argnames="kind")
def _ood_logits_core(member_logits: Any, kind: str) -> jax.Array:
    return statmath.ood_score_of(kind, statmath.logit_summaries(member_logits))


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
