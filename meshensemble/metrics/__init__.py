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
  ``1.0`` in the last bin (the index is ``clip(floor(conf * B), 0, B - 1)``). The adaptive
  ECE uses ``num_bins`` equal-mass bins instead (equal counts, by sorted confidence).
* Disagreement is PAIRWISE (the fraction of member pairs whose argmax differ), as
  robustness_metrics and torch-uncertainty report it; the fraction of members that disagree
  with the ensemble's argmax is :func:`disagreement_vs_ensemble`.

Everything except :func:`auroc`, :func:`aupr`, :func:`reliability_diagram_data`,
:func:`adaptive_ece`, :func:`adaptive_ece_from_examples`, :func:`ensemble_metrics` and
:func:`finalize_stats` is written with ``jax.numpy`` and works on numpy or jax input, under
``jit`` and inside ``shard_map`` (shape checks run at trace time; each is jitted internally,
so an eager call compiles once per input shape); those seven are host functions that return
numpy arrays or python floats.

The streaming pair :func:`streaming_stats` / :func:`finalize_stats` lets a sharded evaluation
reduce per-shard SUMS with collectives (``psum`` over ``data``; the ``member_`` sums are
concatenated over ``ensemble``) and never gather ``[members, N, classes]`` to one place; the
pairwise sums take :func:`member_summaries` reduced over ``ensemble``, and the adaptive ECE
takes :func:`example_stats` (``N`` confidences and correctness flags, concatenated).

The modules, by concern (every name is re-exported here; use ``me.metrics.<name>``):

* :mod:`meshensemble.metrics.classification`: :func:`accuracy`, :func:`nll`, :func:`brier`;
* :mod:`meshensemble.metrics.reliability`: :func:`calibration_bins`, :func:`ece`,
  :func:`ece_from_bins`, :func:`reliability_diagram_data`, :func:`reliability_from_bins`,
  :func:`adaptive_ece`, :func:`adaptive_ece_from_examples`;
* :mod:`meshensemble.metrics.uncertainty`: :func:`entropy`, :func:`expected_entropy`,
  :func:`mutual_information`, :func:`disagreement`, :func:`pairwise_kl`,
  :func:`disagreement_vs_ensemble`;
* :mod:`meshensemble.metrics.ood`: :func:`ood_score`, :func:`ood_score_from_logits`,
  :func:`auroc`, :func:`aupr`, :data:`OOD_KINDS`, :data:`LOGIT_OOD_KINDS`;
* :mod:`meshensemble.metrics.streaming`: :func:`ensemble_metrics`, :func:`prefix_metrics`
  and, from :mod:`meshensemble.numerics.sums` (the core's evaluation uses them, and the core
  imports nothing of this package), :func:`streaming_stats`, :func:`finalize_stats`,
  :func:`member_summaries`, :func:`example_stats`, :data:`MEMBER_STAT_KEYS`,
  :data:`ENSEMBLE_STAT_KEYS`, :data:`EXAMPLE_STAT_KEYS` and :data:`EPS`. The argument checks
  and per-example math shared by all of them live there too, in one place.

Regression scores of a Gaussian mixture from member arrays (NLL, CRPS, quantiles,
coverage) are in the submodule :mod:`meshensemble.metrics.regression`
(``me.metrics.regression``).

The definitions, with their sources, are collected in the documentation page
"Uncertainty and calibration" (``docs/uncertainty.md``, section "Definitions").
"""

from meshensemble.metrics import ood as _ood
from meshensemble.metrics import regression as regression
from meshensemble.metrics.classification import accuracy as accuracy
from meshensemble.metrics.classification import brier as brier
from meshensemble.metrics.classification import nll as nll
from meshensemble.metrics.ood import aupr as aupr
from meshensemble.metrics.ood import auroc as auroc
from meshensemble.metrics.ood import ood_score as ood_score
from meshensemble.metrics.ood import ood_score_from_logits as ood_score_from_logits
from meshensemble.metrics.reliability import adaptive_ece as adaptive_ece
from meshensemble.metrics.reliability import (
    adaptive_ece_from_examples as adaptive_ece_from_examples,
)
from meshensemble.metrics.reliability import calibration_bins as calibration_bins
from meshensemble.metrics.reliability import ece as ece
from meshensemble.metrics.reliability import ece_from_bins as ece_from_bins
from meshensemble.metrics.reliability import reliability_diagram_data as reliability_diagram_data
from meshensemble.metrics.reliability import reliability_from_bins as reliability_from_bins
from meshensemble.metrics.streaming import ensemble_metrics as ensemble_metrics
from meshensemble.metrics.streaming import example_stats as example_stats
from meshensemble.metrics.streaming import finalize_stats as finalize_stats
from meshensemble.metrics.streaming import member_summaries as member_summaries
from meshensemble.metrics.streaming import prefix_metrics as prefix_metrics
from meshensemble.metrics.streaming import streaming_stats as streaming_stats
from meshensemble.metrics.uncertainty import disagreement as disagreement
from meshensemble.metrics.uncertainty import disagreement_vs_ensemble as disagreement_vs_ensemble
from meshensemble.metrics.uncertainty import entropy as entropy
from meshensemble.metrics.uncertainty import expected_entropy as expected_entropy
from meshensemble.metrics.uncertainty import mutual_information as mutual_information
from meshensemble.metrics.uncertainty import pairwise_kl as pairwise_kl
from meshensemble.numerics import sums as _stats

# The constants are bound here with their docstrings (the same as where they are defined),
# where the API reference (automodule of this package) looks for them.
OOD_KINDS = _ood.OOD_KINDS
"""The ``kind`` values that :func:`ood_score` accepts."""
LOGIT_OOD_KINDS = _ood.LOGIT_OOD_KINDS
"""The ``kind`` values that :func:`ood_score_from_logits` accepts (every kind of
:data:`OOD_KINDS`, from the softmax of the logits, and two that need the logits)."""
EPS = _stats.EPS
"""Lower clip on the true-class probability in the NLL, so that ``log(0)`` never occurs."""
MEMBER_STAT_KEYS = _stats.MEMBER_STAT_KEYS
"""Keys of :func:`streaming_stats` with a leading member axis (concatenated over ``ensemble``)."""
ENSEMBLE_STAT_KEYS = _stats.ENSEMBLE_STAT_KEYS
"""Keys of :func:`streaming_stats` that do not depend on which members a device holds."""
EXAMPLE_STAT_KEYS = _stats.EXAMPLE_STAT_KEYS
"""Keys of :func:`example_stats`: per-example values, concatenated (never summed) over shards."""

__all__ = [
    "EPS",
    "OOD_KINDS",
    "LOGIT_OOD_KINDS",
    "accuracy",
    "adaptive_ece",
    "adaptive_ece_from_examples",
    "aupr",
    "auroc",
    "brier",
    "calibration_bins",
    "disagreement",
    "disagreement_vs_ensemble",
    "ece",
    "ece_from_bins",
    "ensemble_metrics",
    "entropy",
    "ENSEMBLE_STAT_KEYS",
    "EXAMPLE_STAT_KEYS",
    "MEMBER_STAT_KEYS",
    "example_stats",
    "expected_entropy",
    "finalize_stats",
    "member_summaries",
    "mutual_information",
    "nll",
    "ood_score",
    "ood_score_from_logits",
    "pairwise_kl",
    "prefix_metrics",
    "reliability_diagram_data",
    "reliability_from_bins",
    "streaming_stats",
]
