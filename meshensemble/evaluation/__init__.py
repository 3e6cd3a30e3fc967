"""Evaluating a trained run: one path for every task.

:func:`evaluate_run` (``meshensemble evaluate``) reloads a run from its workdir on any
mesh, scores the test split as the run's task says, adds what the task offers (OOD
detection and the reliability diagram for classification) and, with ``calibrate``, fits
the task's calibrator on the validation split, saved for exactly that run and checkpoint.
The classification-specific pieces live with the task (:mod:`meshensemble.tasks.ood`,
:mod:`meshensemble.calibration.run`).

Example:
  >>> result = me.evaluation.evaluate_run("runs/tiny", ood=["noise"], echo=print)
  data: MNIST from ...mnist.npz ...
  checkpoint 4 of runs/tiny on mesh ensemble=4 x data=2: 32 test examples
  ...
  wrote evaluation.json, ood_histogram.png and reliability_diagram.png to runs/tiny
"""

from meshensemble.calibration.run import CALIBRATION_PLOT as CALIBRATION_PLOT
from meshensemble.calibration.run import TEMPERATURE_BOUNDS as TEMPERATURE_BOUNDS
from meshensemble.calibration.run import calibrate_ensemble as calibrate_ensemble
from meshensemble.calibration.run import stream_ensemble_logits as stream_ensemble_logits
from meshensemble.evaluation import run as run
from meshensemble.evaluation.run import EVALUATION_FILE as EVALUATION_FILE
from meshensemble.evaluation.run import check_calibrate as check_calibrate
from meshensemble.evaluation.run import evaluate_run as evaluate_run
from meshensemble.evaluation.run import load_run_config as load_run_config

__all__ = [
    "CALIBRATION_PLOT",
    "EVALUATION_FILE",
    "TEMPERATURE_BOUNDS",
    "calibrate_ensemble",
    "check_calibrate",
    "evaluate_run",
    "load_run_config",
    "run",
    "stream_ensemble_logits",
]
