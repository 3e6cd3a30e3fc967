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
  ``1.0`` in the last bin (the index is ``clip(floor(conf * B), 0, B - 1)``).

Everything except :func:`auroc`, :func:`aupr`, :func:`reliability_diagram_data`,
:func:`ensemble_metrics` and :func:`finalize_stats` is written with ``jax.numpy`` and works on
numpy or jax input, under ``jit`` and inside ``shard_map`` (shape checks run at trace time; each
is jitted internally, so an eager call compiles once per input shape); those five are host
functions that return numpy arrays or python floats.

The streaming pair :func:`streaming_stats` / :func:`finalize_stats` lets a sharded evaluation
reduce per-shard SUMS with collectives (``psum`` over ``data``; the ``member_`` sums are
concatenated over ``ensemble``) and never gather ``[members, N, classes]`` to one place.

The modules, by concern (every name is re-exported here; use ``me.metrics.<name>``):

* :mod:`meshensemble.metrics.classification`: :func:`accuracy`, :func:`nll`, :func:`brier`;
* :mod:`meshensemble.metrics.calibration`: :func:`calibration_bins`, :func:`ece`,
  :func:`ece_from_bins`, :func:`reliability_diagram_data`, :func:`reliability_from_bins`;
* :mod:`meshensemble.metrics.uncertainty`: :func:`entropy`, :func:`expected_entropy`,
  :func:`mutual_information`, :func:`disagreement`;
* :mod:`meshensemble.metrics.ood`: :func:`ood_score`, :func:`auroc`, :func:`aupr`,
  :data:`OOD_KINDS`;
* :mod:`meshensemble.metrics.streaming`: :func:`ensemble_metrics`, :func:`prefix_metrics`
  and, from :mod:`meshensemble.core.stats` (the core's evaluation uses them, and the core
  imports nothing of this package), :func:`streaming_stats`, :func:`finalize_stats`,
  :data:`MEMBER_STAT_KEYS`, :data:`ENSEMBLE_STAT_KEYS` and :data:`EPS`. The argument checks
  and per-example math shared by all of them live there too, in one place.
"""

from meshensemble.core import stats as _stats
from meshensemble.metrics import ood as _ood
from meshensemble.metrics.calibration import calibration_bins as calibration_bins
from meshensemble.metrics.calibration import ece as ece
from meshensemble.metrics.calibration import ece_from_bins as ece_from_bins
from meshensemble.metrics.calibration import reliability_diagram_data as reliability_diagram_data
from meshensemble.metrics.calibration import reliability_from_bins as reliability_from_bins
from meshensemble.metrics.classification import accuracy as accuracy
from meshensemble.metrics.classification import brier as brier
from meshensemble.metrics.classification import nll as nll
from meshensemble.metrics.ood import aupr as aupr
from meshensemble.metrics.ood import auroc as auroc
from meshensemble.metrics.ood import ood_score as ood_score
from meshensemble.metrics.streaming import ensemble_metrics as ensemble_metrics
from meshensemble.metrics.streaming import finalize_stats as finalize_stats
from meshensemble.metrics.streaming import prefix_metrics as prefix_metrics
from meshensemble.metrics.streaming import streaming_stats as streaming_stats
from meshensemble.metrics.uncertainty import disagreement as disagreement
from meshensemble.metrics.uncertainty import entropy as entropy
from meshensemble.metrics.uncertainty import expected_entropy as expected_entropy
from meshensemble.metrics.uncertainty import mutual_information as mutual_information

# The constants are bound here with their docstrings (the same as where they are defined),
# where the API reference (automodule of this package) looks for them.
OOD_KINDS = _ood.OOD_KINDS
"""The ``kind`` values that :func:`ood_score` accepts."""
EPS = _stats.EPS
"""Lower clip on the true-class probability in the NLL, so that ``log(0)`` never occurs."""
MEMBER_STAT_KEYS = _stats.MEMBER_STAT_KEYS
"""Keys of :func:`streaming_stats` with a leading member axis (concatenated over ``ensemble``)."""
ENSEMBLE_STAT_KEYS = _stats.ENSEMBLE_STAT_KEYS
"""Keys of :func:`streaming_stats` that do not depend on which members a device holds."""

__all__ = [
    "EPS",
    "OOD_KINDS",
    "accuracy",
    "aupr",
    "auroc",
    "brier",
    "calibration_bins",
    "disagreement",
    "ece",
    "ece_from_bins",
    "ensemble_metrics",
    "entropy",
    "ENSEMBLE_STAT_KEYS",
    "MEMBER_STAT_KEYS",
    "expected_entropy",
    "finalize_stats",
    "mutual_information",
    "nll",
    "ood_score",
    "prefix_metrics",
    "reliability_diagram_data",
    "reliability_from_bins",
    "streaming_stats",
]
