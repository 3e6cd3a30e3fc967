"""Using a trained ensemble: predictions on new data, and an artifact for JAX alone.

* :mod:`meshensemble.serving.inputs`: new inputs from a ``.npy`` (memory-mapped), a
  ``.npz`` or a folder of PNG/JPEG files, checked against the run's input.
* :mod:`meshensemble.serving.predictor`: :func:`load_predictor` and :class:`Predictor`
  (what the run's task serves: probabilities, uncertainty and conformal sets for
  classification, the mixture's moments and conformal intervals for regression), streamed
  through the mesh by :func:`meshensemble.core.streaming.stream`; ``meshensemble
  predict`` runs on it.
* :mod:`meshensemble.serving.outputs`: the ``.npz``/``.csv`` of ``predict``, written
  atomically.
* :mod:`meshensemble.serving.export`: :func:`export_ensemble`, the StableHLO artifact of
  ``meshensemble export`` (``jax.export``, symbolic batch, cpu/cuda/tpu).

Example:
  >>> predictor = me.load_predictor("runs/tiny")  # a trained run
  >>> me.serving.export_ensemble(predictor, "exported")["members"]
  4
"""

from meshensemble.serving import export as export
from meshensemble.serving import inputs as inputs
from meshensemble.serving import outputs as outputs
from meshensemble.serving import predictor as predictor
from meshensemble.serving.export import export_ensemble as export_ensemble
from meshensemble.serving.inputs import Images as Images
from meshensemble.serving.inputs import open_features as open_features
from meshensemble.serving.inputs import open_images as open_images
from meshensemble.serving.inputs import open_inputs as open_inputs
from meshensemble.serving.predictor import Predictor as Predictor
from meshensemble.serving.predictor import load_predictor as load_predictor

__all__ = [
    "Images",
    "Predictor",
    "export",
    "export_ensemble",
    "inputs",
    "load_predictor",
    "open_features",
    "open_images",
    "open_inputs",
    "outputs",
    "predictor",
]
