"""The streaming form: per-shard sums on the mesh, metrics of a whole ensemble on the host.

:func:`streaming_stats`, :func:`finalize_stats`, :func:`member_summaries`,
:func:`example_stats` and their key tuples live in the core
(:mod:`meshensemble.numerics.sums`, which the core's evaluation uses) and are re-exported here;
:func:`ensemble_metrics` runs both on one host array, :func:`prefix_metrics` names the
results as the training loop's ``metrics.jsonl`` records do.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.typing import ArrayLike

from meshensemble.numerics import statmath
from meshensemble.numerics import sums as sums_lib
from meshensemble.numerics.sums import ENSEMBLE_STAT_KEYS as ENSEMBLE_STAT_KEYS
from meshensemble.numerics.sums import EXAMPLE_STAT_KEYS as EXAMPLE_STAT_KEYS
from meshensemble.numerics.sums import MEMBER_STAT_KEYS as MEMBER_STAT_KEYS
from meshensemble.numerics.sums import example_stats as example_stats
from meshensemble.numerics.sums import finalize_stats as finalize_stats
from meshensemble.numerics.sums import member_summaries as member_summaries
from meshensemble.numerics.sums import streaming_stats as streaming_stats


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
      Dict of python floats ``accuracy``, ``nll``, ``brier``, ``ece``, ``adaptive_ece``
      (equal-mass bins), ``entropy`` (mean predictive entropy), ``expected_entropy``,
      ``mutual_information``, ``disagreement`` (pairwise: the mean over member pairs of the
      fraction of examples whose argmax differ), ``pairwise_kl`` (mean over ordered member
      pairs of ``KL(p^j || p^k)``), ``disagreement_vs_ensemble`` (the mean fraction of members
      whose argmax differs from the ensemble's; ``disagreement`` before the pairwise one)
      (all means over examples), ``mean_member_accuracy``, ``mean_member_nll``,
      ``mean_member_brier``, ``mean_member_ece``, ``mean_member_disagreement_vs_ensemble``;
      and python lists of length members ``member_accuracy``, ``member_nll``,
      ``member_brier``, ``member_ece``, ``member_disagreement_vs_ensemble``.

    Raises:
      ValueError: if ``member_probs`` is not 3-D, ``labels`` is not integer `[N]`, a label is
        out of range, ``mask`` is not `[N]`, or no example is masked in.

    Example:
      >>> mp = np.array([[[0.9, 0.1], [0.2, 0.8]], [[0.6, 0.4], [0.6, 0.4]]])
      >>> r = ensemble_metrics(mp, np.array([0, 1]))
      >>> r["accuracy"], r["member_accuracy"]
      (1.0, [1.0, 0.5])
    """
    num_bins = statmath.check_num_bins(num_bins)
    member_probs = statmath.check_probs(member_probs, 3, "member_probs")
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
    mask = statmath.check_mask(mask, n)
    mask = np.ones(n, np.float32) if mask is None else np.asarray(mask, np.float32)
    sums, examples = _ensemble_stats_core(member_probs, labels_np, mask, num_bins=num_bins)
    return finalize_stats(sums, num_bins=num_bins, examples=examples)


@functools.partial(jax.jit, static_argnames="num_bins")
def _ensemble_stats_core(
    member_probs: Any, labels: Any, mask: Any, num_bins: int
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    member_probs = statmath.as_float(member_probs)
    every = sums_lib.member_summaries(member_probs)  # all members are here: no reduction
    sums = sums_lib.streaming_sums(
        member_probs,
        every["probs"],
        labels,
        mask,
        num_bins=num_bins,
        ensemble_votes=every["votes"],
        ensemble_log_probs=every["log_probs"],
    )
    return sums, sums_lib.example_stats(every["probs"], labels, mask)


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
