"""Evaluating a trained run: test metrics, calibration, OOD detection, and the report.

:func:`evaluate_run` (``meshensemble evaluate``) reloads a run from its workdir, on any
mesh, scores the test set and the OOD sets, and writes ``evaluation.json`` and the
plots. The modules: :mod:`~meshensemble.evaluation.run` (a classification run: loading,
OOD sets, scoring on the mesh, the report) and :mod:`~meshensemble.evaluation.regression`
(a regression run: scores, variance scale, conformal intervals). ``evaluate --calibrate``
is :mod:`meshensemble.calibration.run`.

Example:
  >>> result = me.evaluation.evaluate_run("runs/tiny", ood=["noise"], echo=print)
  data: MNIST from ...mnist.npz ...
  checkpoint 4 of runs/tiny on mesh ensemble=4 x data=2: 32 test examples
  ...
  wrote evaluation.json, reliability_diagram.png and ood_histogram.png to runs/tiny
  >>> print(me.evaluation.summary_table(result))
  test uncertainty: entropy ..., expected entropy ..., mutual information ..., disagreement ...
  OOD set      auroc max_prob  auroc entropy ...
  ...
"""

from meshensemble.calibration.run import CALIBRATION_PLOT as CALIBRATION_PLOT
from meshensemble.calibration.run import TEMPERATURE_BOUNDS as TEMPERATURE_BOUNDS
from meshensemble.calibration.run import calibrate_ensemble as calibrate_ensemble
from meshensemble.calibration.run import stream_ensemble_logits as stream_ensemble_logits
from meshensemble.evaluation import regression as regression
from meshensemble.evaluation import run as run
from meshensemble.evaluation.regression import EVALUATION_FILE as EVALUATION_FILE
from meshensemble.evaluation.run import DEFAULT_OOD as DEFAULT_OOD
from meshensemble.evaluation.run import HISTOGRAM_SCORE as HISTOGRAM_SCORE
from meshensemble.evaluation.run import MEMBER_OOD_KINDS as MEMBER_OOD_KINDS
from meshensemble.evaluation.run import NOISE_SEED as NOISE_SEED
from meshensemble.evaluation.run import OOD_PLOT as OOD_PLOT
from meshensemble.evaluation.run import OOD_SCORE_KINDS as OOD_SCORE_KINDS
from meshensemble.evaluation.run import OOD_SETS as OOD_SETS
from meshensemble.evaluation.run import RELIABILITY_PLOT as RELIABILITY_PLOT
from meshensemble.evaluation.run import evaluate_run as evaluate_run
from meshensemble.evaluation.run import load_run_config as load_run_config
from meshensemble.evaluation.run import ood_images as ood_images
from meshensemble.evaluation.run import stream_scores as stream_scores
from meshensemble.evaluation.run import summary_table as summary_table

__all__ = [
    "CALIBRATION_PLOT",
    "DEFAULT_OOD",
    "EVALUATION_FILE",
    "HISTOGRAM_SCORE",
    "MEMBER_OOD_KINDS",
    "NOISE_SEED",
    "OOD_PLOT",
    "OOD_SCORE_KINDS",
    "OOD_SETS",
    "RELIABILITY_PLOT",
    "TEMPERATURE_BOUNDS",
    "calibrate_ensemble",
    "evaluate_run",
    "load_run_config",
    "ood_images",
    "regression",
    "run",
    "stream_ensemble_logits",
    "stream_scores",
    "summary_table",
]
