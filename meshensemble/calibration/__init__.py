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
  >>> sets.shape, sets.dtype
  ((16, 10), dtype('bool'))
  >>> cover, size = me.calibration.coverage(sets, test_labels), me.calibration.set_size(sets)
  >>> 0 <= cover <= 1 and 1 <= size <= 10   # on an untrained net the sets are wide
  True

The package's modules: :mod:`~meshensemble.calibration.temperature` (fitting and applying
``T``), :mod:`~meshensemble.calibration.conformal` (scores, quantile, sets, coverage),
:mod:`~meshensemble.calibration.intervals` (a regression ensemble's variance scale and
conformal intervals) and :mod:`~meshensemble.calibration.run`
(``meshensemble evaluate --calibrate``: fit on a run's validation split, score the test
set).
"""

from meshensemble.calibration import run as run
from meshensemble.calibration._checks import METHODS as METHODS
from meshensemble.calibration.conformal import conformal_quantile as conformal_quantile
from meshensemble.calibration.conformal import conformal_scores as conformal_scores
from meshensemble.calibration.conformal import coverage as coverage
from meshensemble.calibration.conformal import prediction_sets as prediction_sets
from meshensemble.calibration.conformal import set_size as set_size
from meshensemble.calibration.intervals import (
    conformal_interval_quantile as conformal_interval_quantile,
)
from meshensemble.calibration.intervals import fit_variance_scale as fit_variance_scale
from meshensemble.calibration.temperature import apply_temperature as apply_temperature
from meshensemble.calibration.temperature import (
    apply_temperature_to_probs as apply_temperature_to_probs,
)
from meshensemble.calibration.temperature import ensemble_logits as ensemble_logits
from meshensemble.calibration.temperature import fit_temperature as fit_temperature

__all__ = [
    "METHODS",
    "apply_temperature",
    "apply_temperature_to_probs",
    "conformal_interval_quantile",
    "conformal_quantile",
    "conformal_scores",
    "coverage",
    "ensemble_logits",
    "fit_temperature",
    "fit_variance_scale",
    "prediction_sets",
    "run",
    "set_size",
]
