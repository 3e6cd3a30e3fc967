"""The sums an evaluation streams over batches (per device, on the mesh) and their finalisation
on the host.

Each device calls :func:`streaming_stats` on its local members and its part of a batch; the
sums are ``psum``-ed over ``data`` (the ``member_*`` sums stay split over ``ensemble``) and
:func:`finalize_stats` turns the full-set sums into metrics on the host. The members'
``[members, N, classes]`` probabilities are never gathered to one place. The pairwise
metrics (disagreement, KL) need per-example summaries over ALL members
(:func:`member_summaries`, reduced over ``ensemble`` by the caller); the adaptive ECE needs
the ensemble's confidence and correctness of every example (:func:`example_stats`: ``N``
floats each, the only per-example values that leave the devices).

The math of those sums (argument checks, per-example NLL / Brier / entropy, confidence
bins, weighted sums) lives in :mod:`meshensemble.numerics.statmath`; :mod:`meshensemble.metrics`
builds its single-batch metrics from the same helpers, so both compute every quantity one
way. The conventions (masks, the NLL clip :data:`EPS`, the Brier sum over classes, the bin
edges) are those of :mod:`meshensemble.metrics`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from meshensemble.numerics.statmath import EPS as _EPS
from meshensemble.numerics.statmath import as_array as as_array
from meshensemble.numerics.statmath import as_float as as_float
from meshensemble.numerics.statmath import bin_sums as bin_sums
from meshensemble.numerics.statmath import check_labels as check_labels
from meshensemble.numerics.statmath import check_mask as check_mask
from meshensemble.numerics.statmath import check_num_bins as check_num_bins
from meshensemble.numerics.statmath import check_probs as check_probs
from meshensemble.numerics.statmath import clipped_log as clipped_log
from meshensemble.numerics.statmath import per_example as per_example
from meshensemble.numerics.statmath import shannon_entropy as shannon_entropy
from meshensemble.numerics.statmath import weights as weights
from meshensemble.numerics.statmath import wsum as wsum

EPS = _EPS
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
    "ensemble_pair_disagree",
    "ensemble_pair_cross_entropy",
    "count",
)
"""Keys of :func:`streaming_stats` that do not depend on which members a device holds."""

EXAMPLE_STAT_KEYS = ("confidence", "correct", "weight")
"""Keys of :func:`example_stats`: per-example values, concatenated (never summed) over shards."""


def member_summaries(member_probs: Any) -> dict[str, jax.Array]:
    """Per-example summaries of the members in ``member_probs``, to reduce over ``ensemble``.

    On a mesh each device calls it on its local members and reduces the results over the
    ``ensemble`` axis: ``probs`` and ``log_probs`` with ``pmean`` (every device holds the same
    number of members), ``votes`` with ``psum``. The reduced values are the
    ``ensemble_probs``, ``ensemble_log_probs`` and ``ensemble_votes`` arguments of
    :func:`streaming_stats`. On one device (all members local) no reduction is needed.

    Args:
      member_probs: `[m, b, C]` probabilities of (a subset of) the members.

    Returns:
      Dict of `[b, C]` float arrays: ``probs`` (mean over the members), ``log_probs`` (mean
      over the members of :func:`clipped_log`) and ``votes`` (how many of the members have
      class ``c`` as their argmax: a count, summed, not averaged).

    Example:
      >>> s = member_summaries(jnp.array([[[0.9, 0.1]], [[0.4, 0.6]]]))
      >>> s["votes"].tolist()
      [[1.0, 1.0]]
    """
    member_probs = as_float(member_probs)
    c = member_probs.shape[-1]
    votes = jax.nn.one_hot(jnp.argmax(member_probs, axis=-1), c, dtype=member_probs.dtype)
    return {
        "probs": jnp.mean(member_probs, axis=0),
        "log_probs": jnp.mean(clipped_log(member_probs), axis=0),
        "votes": jnp.sum(votes, axis=0),
    }


def example_stats(ensemble_probs: Any, labels: Any, mask: Any) -> dict[str, jax.Array]:
    """The ensemble's confidence and correctness per example, for the adaptive ECE.

    Equal-mass bins need every example's confidence, so unlike :func:`streaming_stats` these
    are not sums: shards and batches are CONCATENATED (in example order), and
    :func:`finalize_stats` drops the examples of weight 0 (padding). These ``3 N`` floats
    are all that leaves the devices per example; ``[members, N, C]`` never does.

    Args:
      ensemble_probs: `[b, C]` the ensemble's (mean) probabilities.
      labels: `[b]` integer class indices.
      mask: `[b]` 0/1 weights (or bools); padding examples must be 0.

    Returns:
      Dict of `[b]` float arrays ``confidence`` (``max_c p_c``), ``correct`` (1 where the
      argmax is the label) and ``weight`` (the mask).

    Example:
      >>> example_stats(jnp.array([[0.8, 0.2]]), jnp.array([1]), jnp.ones(1))["correct"]
      Array([0.], dtype=float32)
    """
    probs = as_float(ensemble_probs)
    correct = jnp.argmax(probs, axis=-1) == labels
    return {
        "confidence": jnp.max(probs, axis=-1),
        "correct": correct.astype(probs.dtype),
        "weight": weights(mask, probs.shape[0], probs.dtype),
    }


def adaptive_ece_from_examples(
    confidence: ArrayLike, correct: ArrayLike, num_bins: int = 15, weight: ArrayLike | None = None
) -> float:
    """Adaptive (equal-mass) expected calibration error of per-example values (host, float64).

    The examples of nonzero weight are sorted by confidence (a stable sort: ties keep their
    example order) and cut into ``num_bins`` consecutive groups of (nearly) equal counts,
    as ``np.array_split`` cuts (the first ``n % num_bins`` groups hold one more); then
    ``ace = sum_b |sum_{i in b} w_i (correct_i - conf_i)| / sum_i w_i``, i.e.
    ``sum_b (n_b / n) |acc_b - conf_b|`` for 0/1 weights (Nixon et al. 2019; top-label,
    L1, as torch-uncertainty's ``AdaptiveCalibrationError``). Empty groups (``n < num_bins``)
    contribute 0.

    Args:
      confidence: `[N]` confidences (the max probability).
      correct: `[N]` 1 where the prediction is right, else 0.
      num_bins: the number of equal-mass bins.
      weight: optional `[N]` weights; examples of weight 0 are dropped (even if NaN).

    Returns:
      The adaptive ECE as a python float (``nan`` when no example has nonzero weight).

    Raises:
      ValueError: if the shapes differ or ``num_bins < 1``.

    Example:
      >>> round(adaptive_ece_from_examples([0.9, 0.6, 0.8, 0.7], [1, 0, 1, 1], 2), 4)
      0.15
    """
    num_bins = check_num_bins(num_bins)
    conf = np.asarray(confidence, np.float64).reshape(-1)
    corr = np.asarray(correct, np.float64).reshape(-1)
    w = np.ones_like(conf) if weight is None else np.asarray(weight, np.float64).reshape(-1)
    if not conf.shape == corr.shape == w.shape:
        raise ValueError(
            f"confidence, correct and weight must have one value per example, got shapes "
            f"{conf.shape}, {corr.shape}, {w.shape}."
        )
    keep = w != 0
    conf, corr, w = conf[keep], corr[keep], w[keep]
    if not conf.size:
        return float("nan")
    order = np.argsort(conf, kind="stable")
    gaps = w[order] * (corr[order] - conf[order])
    total = sum(abs(float(g.sum())) for g in np.array_split(gaps, num_bins))
    return total / float(w.sum())


# --------------------------------------------------------------------------- streaming sums


def streaming_stats(
    member_probs: ArrayLike,
    ensemble_probs: ArrayLike,
    labels: ArrayLike,
    mask: ArrayLike,
    num_bins: int = 15,
    *,
    ensemble_votes: ArrayLike | None = None,
    ensemble_log_probs: ArrayLike | None = None,
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
    * ``ensemble_pair_disagree = sum_i w_i (M^2 - sum_c n_ic^2) / (M (M - 1))``, with
      ``n_ic`` = ``ensemble_votes`` (how many of ALL ``M = sum_c n_ic`` members predict
      ``c``): the fraction of unordered member pairs whose argmax differ (0 when ``M = 1``);
    * ``ensemble_pair_cross_entropy = sum_i w_i (-sum_c pbar_ic lbar_ic)`` with ``lbar`` =
      ``ensemble_log_probs`` (the mean over ALL members of ``log max(p, eps)``): the mean
      over all ordered member pairs ``(j, k)`` of the cross-entropy ``H(p^j_i, p^k_i)``;
      :func:`finalize_stats` subtracts the members' entropies to get the pairwise KL;
    * ``count = sum_i w_i``.

    The two pairwise sums are NaN when ``ensemble_votes`` / ``ensemble_log_probs`` are not
    given: they need every member, which a device holding a subset of them does not see
    (reduce :func:`member_summaries` over ``ensemble`` to get them).

    Args:
      member_probs: `[m, b, C]` probabilities of this device's local members (``m`` may be a
        subset of all members).
      ensemble_probs: `[b, C]` full ensemble mean over ALL members (averaged by the caller).
      labels: `[b]` integer class indices.
      mask: `[b]` float 0/1 weights (or bools); padding examples must be 0.
      num_bins: number of calibration bins (static under ``jit``).
      ensemble_votes: `[b, C]` per-class argmax counts over ALL members (the ``psum`` over
        ``ensemble`` of :func:`member_summaries`' ``votes``), or None.
      ensemble_log_probs: `[b, C]` mean over ALL members of ``log max(p, eps)`` (the
        ``pmean`` of :func:`member_summaries`' ``log_probs``), or None.

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

    def check_bc(name: str, value: Any) -> None:  # None, or [b, C] as member_probs
        if value is not None and tuple(as_array(value).shape) != (b, c):
            raise ValueError(
                f"`{name}` must be [b, C] = {(b, c)} to match `member_probs` "
                f"{tuple(member_probs.shape)}, got {tuple(as_array(value).shape)}."
            )

    check_bc("ensemble_probs", ensemble_probs)
    labels = check_labels(labels, b)
    if mask is None:
        raise ValueError("`mask` is required: pass jnp.ones(b) when there is no padding.")
    mask = check_mask(mask, b)
    check_bc("ensemble_votes", ensemble_votes)
    check_bc("ensemble_log_probs", ensemble_log_probs)
    return _streaming_sums_jit(
        member_probs,
        ensemble_probs,
        labels,
        mask,
        num_bins=num_bins,
        ensemble_votes=ensemble_votes,
        ensemble_log_probs=ensemble_log_probs,
    )


def streaming_sums(
    member_probs: Any,
    ensemble_probs: Any,
    labels: Any,
    mask: Any,
    num_bins: int,
    ensemble_votes: Any = None,
    ensemble_log_probs: Any = None,
) -> dict[str, jax.Array]:
    """The traceable body of :func:`streaming_stats` (same arguments, ``mask`` not None).

    For callers that have checked the arguments and trace it inside their own ``jit``.
    """
    member_probs = as_float(member_probs)
    ensemble_probs = jnp.asarray(ensemble_probs).astype(member_probs.dtype)
    w = weights(mask, member_probs.shape[1], member_probs.dtype)
    pair_disagree, pair_ce = pairwise_terms(ensemble_probs, ensemble_votes, ensemble_log_probs)

    # The ensemble sums use only ensemble_probs, labels and mask (not member_probs), so inside
    # shard_map they stay invariant over the member axis and can leave with out_specs P().
    mem = per_example(member_probs, labels, num_bins)  # each [m, b]
    ens = per_example(ensemble_probs, labels, num_bins)  # each [b]
    ens_pred = jnp.argmax(ensemble_probs, axis=-1)
    member_pred = jnp.argmax(member_probs, axis=-1)
    disagree = (member_pred != jnp.broadcast_to(ens_pred, member_pred.shape)).astype(w.dtype)
    names = ("correct", "nll", "brier", "entropy")
    m_sums = wsum(jnp.stack([*(mem[k] for k in names), disagree]), w)  # [5, m]
    e_sums = wsum(jnp.stack([*(ens[k] for k in names), pair_disagree, pair_ce]), w)  # [6]
    m_bins = bin_sums(mem["conf"], mem["correct"], mem["bin"], w, num_bins)  # count, conf, correct
    e_bins = bin_sums(ens["conf"], ens["correct"], ens["bin"], w, num_bins)
    member = [m_sums[i] for i in range(len(names) + 1)] + list(m_bins)  # MEMBER_STAT_KEYS' order
    ensemble = [e_sums[i] for i in range(len(names))] + list(e_bins)
    ensemble += [e_sums[len(names)], e_sums[len(names) + 1], jnp.sum(w)]  # pairs, count
    return {
        **dict(zip(MEMBER_STAT_KEYS, member, strict=True)),
        **dict(zip(ENSEMBLE_STAT_KEYS, ensemble, strict=True)),
    }


def pairwise_terms(ensemble_probs: Any, votes: Any, log_probs: Any) -> tuple[Any, Any]:
    """Per-example pairwise disagreement and mean pair cross-entropy (traceable).

    With ``n_c`` = ``votes`` (argmax counts over ALL ``M = sum_c n_c`` members),
    ``disagreement = (M^2 - sum_c n_c^2) / (M (M - 1))`` (0 when ``M <= 1``): the fraction of
    unordered member pairs whose argmax differ, as
    ``sum_{j<k} 1[a_j != a_k] = (M^2 - sum_c n_c^2) / 2``. With ``pbar`` = ``ensemble_probs``
    and ``lbar`` = ``log_probs`` (mean clipped log-probabilities),
    ``cross_entropy = -sum_c pbar_c lbar_c = mean_{j,k} H(p^j, p^k)`` over all ordered pairs,
    ``j = k`` included. Only ensemble-level inputs are used, so inside ``shard_map`` the
    results stay invariant over the member axis.

    Args:
      ensemble_probs: `[..., C]` float mean probabilities over all members.
      votes: `[..., C]` argmax counts over all members, or None (result NaN).
      log_probs: `[..., C]` mean over all members of :func:`clipped_log`, or None (NaN).

    Returns:
      ``(disagreement, cross_entropy)``, each `[...]`.
    """
    dtype = ensemble_probs.dtype
    nan = jnp.full(ensemble_probs.shape[:-1], jnp.nan, dtype)
    if votes is None:
        disagree = nan
    else:
        votes = jnp.asarray(votes).astype(dtype)
        m = jnp.sum(votes, axis=-1)
        pairs = m * (m - 1.0)
        agree = jnp.sum(jnp.square(votes), axis=-1)
        disagree = jnp.where(pairs > 0, (m * m - agree) / jnp.where(pairs > 0, pairs, 1.0), 0.0)
    if log_probs is None:
        cross = nan
    else:
        cross = 0.0 - jnp.sum(ensemble_probs * jnp.asarray(log_probs).astype(dtype), axis=-1)
    return disagree, cross


_streaming_sums_jit = functools.partial(jax.jit, static_argnames="num_bins")(streaming_sums)


def _checked_stats(
    stats: Mapping[str, Any], num_bins: int, examples: Mapping[str, Any] | None
) -> tuple[dict[str, np.ndarray], int]:
    """``stats`` as float64 numpy and the member count, after checking keys and shapes."""
    keys = (*MEMBER_STAT_KEYS, *ENSEMBLE_STAT_KEYS)
    missing = [k for k in keys if k not in stats]
    if missing:
        raise ValueError(f"`stats` lacks keys {missing}; pass the output of streaming_stats.")
    s = {k: np.asarray(stats[k], dtype=np.float64) for k in keys}
    if not float(s["count"]) > 0:
        raise ValueError(
            f"`stats['count']` is {float(s['count'])}; at least one example must be masked in."
        )
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
    if examples is not None:
        lacking = [k for k in EXAMPLE_STAT_KEYS if k not in examples]
        if lacking:
            raise ValueError(f"`examples` lacks keys {lacking}; pass the output of example_stats.")
    return s, m


def finalize_stats(
    stats: Mapping[str, Any],
    num_bins: int = 15,
    examples: Mapping[str, Any] | None = None,
) -> dict[str, float | list[float]]:
    """Metrics from full-set :func:`streaming_stats` sums (host side, float64).

    With ``n = count`` and ``M`` = the length of the ``member_*`` arrays (ALL members):
    ``accuracy = ensemble_correct / n``, ``nll = ensemble_nll / n``,
    ``brier = ensemble_brier / n``, ``entropy = ensemble_entropy / n``,
    ``ece = sum_b |ensemble_bin_correct_b - ensemble_bin_conf_b| / n``;
    ``expected_entropy = sum_k member_entropy[k] / (M n)``;
    ``mutual_information = max(entropy - expected_entropy, 0)`` (equal to the mean over
    examples of the per-example MI, as both terms are means);
    ``disagreement = ensemble_pair_disagree / n`` (pairwise: the mean over unordered member
    pairs of the fraction of examples whose argmax differ);
    ``pairwise_kl = M / (M - 1) * max(ensemble_pair_cross_entropy / n - expected_entropy, 0)``
    (the mean over ordered pairs ``j != k`` of ``KL(p^j || p^k)``, since
    ``sum_{j,k} KL(p^j || p^k) = M^2 mean_{j,k} H(p^j, p^k) - M sum_j H(p^j)``);
    both are 0 when ``M = 1`` (no pairs);
    ``disagreement_vs_ensemble = sum_k member_disagree[k] / (M n)`` (the fraction of members
    whose argmax differs from the ensemble's: what ``disagreement`` meant before);
    ``adaptive_ece`` from ``examples`` (:func:`adaptive_ece_from_examples`), NaN without them;
    ``member_<x>[k] = member_<x>[k] / n`` for ``x`` in accuracy (from ``member_correct``), nll,
    brier, disagreement_vs_ensemble (from ``member_disagree``), and ``member_ece[k]`` from
    the member bin sums; ``mean_member_<x>`` = the mean of the member list.

    Args:
      stats: full-set sums with the keys of :func:`streaming_stats`; ``member_*`` arrays
        `[members]` / `[members, num_bins]`, the rest `[]` / `[num_bins]`.
      num_bins: the number of bins the stats were made with (checked against the arrays);
        also the number of equal-mass bins of the adaptive ECE.
      examples: optional :func:`example_stats` of every example, concatenated over shards
        and batches (``confidence``, ``correct``, ``weight``, each `[N]`; weight-0 padding
        is dropped); without it ``adaptive_ece`` is NaN.

    Returns:
      The dict of :func:`meshensemble.metrics.ensemble_metrics`: python floats ``accuracy``,
      ``nll``, ``brier``, ``ece``, ``adaptive_ece``, ``entropy``, ``expected_entropy``,
      ``mutual_information``, ``disagreement``, ``pairwise_kl``, ``disagreement_vs_ensemble``,
      ``mean_member_accuracy``, ``mean_member_nll``, ``mean_member_brier``,
      ``mean_member_ece``, ``mean_member_disagreement_vs_ensemble`` and python lists (length
      members) ``member_accuracy``, ``member_nll``, ``member_brier``, ``member_ece``,
      ``member_disagreement_vs_ensemble``.

    Raises:
      ValueError: if keys are missing, shapes disagree, or ``count`` is not positive.

    Example:
      >>> mp = jnp.array([[[0.9, 0.1], [0.2, 0.8]], [[0.6, 0.4], [0.6, 0.4]]])
      >>> s = streaming_stats(mp, mp.mean(0), jnp.array([0, 1]), jnp.ones(2), num_bins=10)
      >>> finalize_stats(s, num_bins=10)["member_accuracy"]
      [1.0, 0.5]
    """
    num_bins = check_num_bins(num_bins)
    s, m = _checked_stats(stats, num_bins, examples)
    n = float(s["count"])

    def ece_np(correct: np.ndarray, conf: np.ndarray) -> np.ndarray:
        return np.abs(correct - conf).sum(axis=-1) / n

    ens_entropy = float(s["ensemble_entropy"]) / n
    exp_entropy = float(s["member_entropy"].sum()) / (m * n)
    if m > 1:
        pair_disagreement = float(s["ensemble_pair_disagree"]) / n
        cross = float(s["ensemble_pair_cross_entropy"]) / n
        pairwise_kl = m / (m - 1) * max(cross - exp_entropy, 0.0)  # max keeps a NaN
    else:
        pair_disagreement = pairwise_kl = 0.0  # one member: no pairs
    member = {
        "member_accuracy": s["member_correct"] / n,
        "member_nll": s["member_nll"] / n,
        "member_brier": s["member_brier"] / n,
        "member_ece": ece_np(s["member_bin_correct"], s["member_bin_conf"]),
        "member_disagreement_vs_ensemble": s["member_disagree"] / n,
    }
    out: dict[str, float | list[float]] = {
        "accuracy": float(s["ensemble_correct"]) / n,
        "nll": float(s["ensemble_nll"]) / n,
        "brier": float(s["ensemble_brier"]) / n,
        "ece": float(ece_np(s["ensemble_bin_correct"], s["ensemble_bin_conf"])),
        "adaptive_ece": float("nan")
        if examples is None
        else adaptive_ece_from_examples(
            examples["confidence"], examples["correct"], num_bins, examples["weight"]
        ),
        "entropy": ens_entropy,
        "expected_entropy": exp_entropy,
        "mutual_information": max(ens_entropy - exp_entropy, 0.0),
        "disagreement": pair_disagreement,
        "pairwise_kl": pairwise_kl,
        "disagreement_vs_ensemble": float(s["member_disagree"].sum()) / (m * n),
    }
    for key, values in member.items():
        out[key] = [float(v) for v in values]
        out[f"mean_{key}"] = float(values.mean())
    return out
