"""Uncertainty and diversity of an ensemble: entropies, mutual information, disagreement, KL.

Entropies are in nats with ``0 log 0 = 0`` (no clip). Ensemble functions take member
probabilities `[members, N, classes]`; the ensemble prediction is their mean over members.
:func:`disagreement` and :func:`pairwise_kl` are pairwise diversity measures, as
robustness_metrics (uncertainty-baselines) and torch-uncertainty define them;
:func:`disagreement_vs_ensemble` compares each member with the ensemble instead.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from meshensemble.numerics import statmath, sums


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
    return _entropy_core(statmath.as_array(probs))


_entropy_core = jax.jit(statmath.shannon_entropy)


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
    return _expected_entropy_core(statmath.check_probs(member_probs, 3, "member_probs"))


@jax.jit
def _expected_entropy_core(member_probs: Any) -> jax.Array:
    return jnp.mean(statmath.shannon_entropy(member_probs), axis=0)


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
    return _mutual_information_core(statmath.check_probs(member_probs, 3, "member_probs"))


@jax.jit
def _mutual_information_core(member_probs: Any) -> jax.Array:
    member_probs = statmath.as_float(member_probs)
    entropy_of_mean = statmath.shannon_entropy(jnp.mean(member_probs, axis=0))
    mi = entropy_of_mean - jnp.mean(statmath.shannon_entropy(member_probs), axis=0)
    return jnp.maximum(mi, 0.0)


def disagreement(member_probs: ArrayLike) -> jax.Array:
    """Pairwise disagreement: the fraction of member pairs whose argmax differ, per example.

    ``D_i = sum_{j<k} 1[a^j_i != a^k_i] / (M (M - 1) / 2) = (M^2 - sum_c n_ic^2) / (M (M - 1))``
    with ``a^j_i = argmax_c p^j_ic`` and ``n_ic`` the number of members whose argmax is ``c``
    (robustness_metrics' ``average_pairwise_diversity`` disagreement, torch-uncertainty's
    ``Disagreement``). 0 for a single member (no pairs). Its mean over examples is
    ``ensemble_metrics(...)["disagreement"]``.

    Args:
      member_probs: `[members, N, classes]` member probabilities.

    Returns:
      `[N]` disagreement fractions in ``[0, 1]``.

    Raises:
      ValueError: if ``member_probs`` is not 3-D.

    Example:
      >>> [round(float(v), 4) for v in disagreement([[[0.9, 0.1]], [[0.8, 0.2]], [[0.4, 0.6]]])]
      [0.6667]
    """
    return _disagreement_core(statmath.check_probs(member_probs, 3, "member_probs"))


@jax.jit
def _disagreement_core(member_probs: Any) -> jax.Array:
    every = sums.member_summaries(member_probs)
    return sums.pairwise_terms(every["probs"], every["votes"], None)[0]


def pairwise_kl(member_probs: ArrayLike) -> jax.Array:
    """Mean KL divergence between members over ordered pairs ``j != k``, per example.

    ``K_i = (1 / (M (M - 1))) sum_{j != k} KL(p^j_i || p^k_i)`` with
    ``KL(p || q) = sum_c p_c (log p_c - log max(q_c, eps))`` (``0 log 0 = 0``, ``eps`` =
    :data:`~meshensemble.metrics.EPS`, so a zero in ``q`` gives a large finite value).
    Computed as ``M / (M - 1) * (mean_{j,k} H(p^j, p^k) - mean_j H(p^j))`` (cross-entropy
    minus entropy), clipped at 0 against round-off; 0 for a single member.
    robustness_metrics averages ``KL(p^j || p^k)`` over ``j < k`` only (one direction of
    each pair); this averages both directions.

    Args:
      member_probs: `[members, N, classes]` member probabilities.

    Returns:
      `[N]` mean pairwise KL divergences in nats.

    Raises:
      ValueError: if ``member_probs`` is not 3-D.

    Example:
      >>> [round(float(v), 4) for v in pairwise_kl([[[0.5, 0.5]], [[0.9, 0.1]]])]
      [0.4394]
    """
    return _pairwise_kl_core(statmath.check_probs(member_probs, 3, "member_probs"))


@jax.jit
def _pairwise_kl_core(member_probs: Any) -> jax.Array:
    member_probs = statmath.as_float(member_probs)
    m = member_probs.shape[0]
    if m < 2:
        return jnp.zeros(member_probs.shape[1], member_probs.dtype)
    every = sums.member_summaries(member_probs)
    cross = sums.pairwise_terms(every["probs"], None, every["log_probs"])[1]
    mean_entropy = jnp.mean(statmath.shannon_entropy(member_probs), axis=0)
    return m / (m - 1) * jnp.maximum(cross - mean_entropy, 0.0)


def disagreement_vs_ensemble(member_probs: ArrayLike) -> jax.Array:
    """Fraction of members whose argmax differs from the ensemble's argmax, per example.

    ``D_i = (1 / M) sum_m 1[argmax_c p^m_ic != argmax_c pbar_ic]`` where
    ``pbar_i = mean_m p^m_i`` is the ensemble (mean-probability) prediction. It is 0 when every
    member's argmax equals the ensemble's, and can reach 1 when the ensemble's argmax is no
    member's argmax. This was :func:`disagreement` before it became pairwise; its mean is
    ``ensemble_metrics(...)["disagreement_vs_ensemble"]``.

    Args:
      member_probs: `[members, N, classes]` member probabilities.

    Returns:
      `[N]` disagreement fractions in ``[0, 1]``.

    Raises:
      ValueError: if ``member_probs`` is not 3-D.

    Example:
      >>> ex = [[[0.9, 0.1]], [[0.8, 0.2]], [[0.4, 0.6]]]
      >>> [round(float(v), 4) for v in disagreement_vs_ensemble(ex)]
      [0.3333]
    """
    return _disagreement_vs_ensemble_core(statmath.check_probs(member_probs, 3, "member_probs"))


@jax.jit
def _disagreement_vs_ensemble_core(member_probs: Any) -> jax.Array:
    member_probs = statmath.as_float(member_probs)
    ens_pred = jnp.argmax(jnp.mean(member_probs, axis=0), axis=-1)  # [N]
    member_pred = jnp.argmax(member_probs, axis=-1)  # [M, N]
    differs = member_pred != jnp.broadcast_to(ens_pred, member_pred.shape)
    return jnp.mean(differs.astype(member_probs.dtype), axis=0)
