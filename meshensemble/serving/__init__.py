"""Using a trained ensemble: predictions on new data, and an artifact for JAX alone.

* :mod:`meshensemble.serving.inputs`: new images from a ``.npy`` (memory-mapped), a
  ``.npz`` or a folder of PNG/JPEG files, checked against the run's input.
* :mod:`meshensemble.serving.predictor`: :func:`load_predictor` and :class:`Predictor`
  (probabilities, members, uncertainty, conformal sets), streamed through the mesh by
  :func:`meshensemble.core.streaming.stream`; ``meshensemble predict`` runs on it.
* :mod:`meshensemble.serving.blocks`: the predictor's program runs in fixed blocks of
  rows, so an example's outputs (and its conformal set) are the same in any batch.
* :mod:`meshensemble.serving.regression`: :class:`RegressionPredictor` (what
  :func:`load_predictor` returns for a regression run: features ``[N, F]`` in, the
  mixture's moments and conformal intervals out) and its export function.
* :mod:`meshensemble.serving.outputs`: the ``.npz``/``.csv`` of ``predict``, written
  atomically.
* :mod:`meshensemble.serving.export`: :func:`export_ensemble`, the StableHLO artifact of
  ``meshensemble export`` (``jax.export``, symbolic batch, cpu/cuda/tpu).

Example:
  >>> predictor = me.load_predictor("runs/tiny")  # a trained run
  >>> me.serving.export_ensemble(predictor, "exported")["members"]
  4
"""

from meshensemble.serving import blocks as blocks
from meshensemble.serving import export as export
from meshensemble.serving import inputs as inputs
from meshensemble.serving import outputs as outputs
from meshensemble.serving import predictor as predictor
from meshensemble.serving import regression as regression
from meshensemble.serving.export import export_ensemble as export_ensemble
from meshensemble.serving.inputs import Images as Images
from meshensemble.serving.inputs import open_features as open_features
from meshensemble.serving.inputs import open_images as open_images
from meshensemble.serving.predictor import Calibration as Calibration
from meshensemble.serving.predictor import Predictor as Predictor
from meshensemble.serving.predictor import load_predictor as load_predictor
from meshensemble.serving.regression import IntervalCalibration as IntervalCalibration
from meshensemble.serving.regression import RegressionPredictor as RegressionPredictor

__all__ = [
    "Calibration",
    "Images",
    "IntervalCalibration",
    "Predictor",
    "RegressionPredictor",
    "blocks",
    "export",
    "export_ensemble",
    "inputs",
    "load_predictor",
    "open_features",
    "open_images",
    "outputs",
    "predictor",
    "regression",
]
