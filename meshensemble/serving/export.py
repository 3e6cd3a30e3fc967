"""A trained ensemble as a StableHLO artifact that runs with JAX alone: :func:`export_ensemble`.

``DIR/ensemble.jax`` (:data:`ARTIFACT_FILE`) holds the bytes of
``jax.export.Exported.serialize()`` of the prediction function with the parameters
embedded as constants, the input transform included (it takes the raw inputs that
``meshensemble predict`` takes, e.g. uint8 images ``[N, 28, 28, 1]``), a symbolic batch
dimension, lowered for ``cpu`` and ``cuda`` (and ``tpu`` where the installed JAX can). It
returns what the run's task exports (:meth:`meshensemble.tasks.Task.exported`: for
classification ``{"probs": [N, classes], "member_probs": [members, N, classes]}``, ``probs``
with the run's calibrated temperature when it has one). ``DIR/export.json``
(:data:`METADATA_FILE`) says what it takes and what it was made from, and holds the
conformal threshold (or quantile) to build sets (or intervals) without this library::

    import json, jax, numpy as np
    exp = jax.export.deserialize(bytearray(open("DIR/ensemble.jax", "rb").read()))
    probs = np.asarray(exp.call(images)["probs"])

Example:
  >>> meta = export_ensemble(me.load_predictor("runs/tiny"), "exported/")
  >>> sorted(meta)[:3]
  ['artifact', 'checkpoint_step', 'classes']
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from meshensemble.core import steps
from meshensemble.core.tasks import LocalReducer
from meshensemble.runtime import storage
from meshensemble.runtime.distributed import fetch
from meshensemble.serving.predictor import Predictor
from meshensemble.training.outputs import check_writable, dumps_strict, writing

ARTIFACT_FILE = "ensemble.jax"
"""The serialized ``jax.export.Exported`` inside an export folder."""
METADATA_FILE = "export.json"
"""What the artifact takes and returns, the calibration, the run's data and versions."""
PLATFORMS = ("cpu", "cuda", "tpu")
"""Platforms the artifact is lowered for; ``tpu`` is dropped where this JAX cannot."""
BATCH_DIM = "batch"
"""Name of the artifact's symbolic batch dimension."""


def prediction_function(predictor: Predictor) -> Callable[[jax.Array], dict[str, jax.Array]]:
    """The ensemble's prediction as a pure function of raw inputs, parameters embedded.

    Every member's outputs come from :func:`meshensemble.core.steps.member_logits` (what
    ``Ensemble.predict`` runs per device) on one device with all members local (FSDP
    parameters gathered on the host first), so the input transform, the compute dtype and
    the member strategy are the run's own; the task combines them
    (:meth:`~meshensemble.tasks.Task.serve` with a
    :class:`~meshensemble.core.tasks.LocalReducer`) and applies its calibration
    (:meth:`~meshensemble.tasks.Task.exported`).

    Args:
      predictor: a :class:`~meshensemble.serving.predictor.Predictor`.

    Returns:
      ``fn(x [N, *input_shape]) -> dict``: classification ``{"probs": [N, classes],
      "member_probs": [members, N, classes]}`` (``probs`` calibrated when the run is);
      regression ``{"mean", "variance" [N, T], "member_mean", "member_variance"}``.

    Example:
      >>> fn = prediction_function(predictor)
      >>> fn(images)["probs"].shape
      (32, 10)
    """
    cfg = dataclasses.replace(predictor.ensemble.step_config(), gather_axes=None, augment=None)
    # On the host, whole (FSDP slices gathered); the optimizer state is not needed.
    host = fetch(predictor.state.replace(opt_state=None))
    task, cal, local = predictor.task, predictor.calibration, LocalReducer(predictor.num_members)

    def fn(x: jax.Array) -> dict[str, jax.Array]:
        per_example, per_member = task.serve(steps.member_logits(cfg, host, x), local, True)
        return task.exported(per_example, per_member, cal)

    return fn


def export_artifact(predictor: Predictor, platforms: Sequence[str] = PLATFORMS) -> Any:
    """The ``jax.export.Exported`` of :func:`prediction_function`, batch dimension symbolic.

    Args:
      predictor: the predictor.
      platforms: lowering platforms; ``tpu`` is dropped (with the others kept) when this
        JAX cannot lower for it.

    Returns:
      A ``jax.export.Exported`` (``.serialize()`` gives the artifact's bytes).

    Example:
      >>> exp = export_artifact(predictor)
      >>> exp.platforms
      ('cpu', 'cuda', 'tpu')
    """
    (b,) = jax.export.symbolic_shape(BATCH_DIM)
    spec = jax.ShapeDtypeStruct((b, *predictor.input_shape), predictor.input_dtype)
    fn = jax.jit(prediction_function(predictor))
    try:
        return jax.export.export(fn, platforms=tuple(platforms))(spec)
    except Exception:
        if "tpu" not in platforms:
            raise
        return jax.export.export(fn, platforms=tuple(p for p in platforms if p != "tpu"))(spec)


def export_metadata(predictor: Predictor, exported: Any) -> dict[str, Any]:
    """The ``export.json`` object of an artifact (see :func:`export_ensemble`).

    Example:
      >>> export_metadata(predictor, export_artifact(predictor))["classes"]
      10
    """
    try:
        version = importlib.metadata.version("meshensemble")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    dtype = predictor.input_dtype
    pixels = {"range": [0, 255]} if dtype == np.uint8 else {}
    return {
        "artifact": ARTIFACT_FILE,
        "task": predictor.task.name,
        "input": {"shape": [BATCH_DIM, *predictor.input_shape], "dtype": str(dtype), **pixels},
        **predictor.task.export_metadata(predictor.calibration, predictor.num_classes),
        "members": predictor.num_members,
        "preprocessing": {"task": predictor.task.record(), "input": predictor.input_record},
        "platforms": list(exported.platforms),
        "model": predictor.model,
        "workdir": storage.absolute(predictor.workdir),
        "checkpoint_step": predictor.step,
        "data_identity": predictor.data_identity,
        "versions": {"meshensemble": version, "jax": jax.__version__},
    }


def export_ensemble(
    predictor: Predictor, out: str, platforms: Sequence[str] = PLATFORMS
) -> dict[str, Any]:
    """Writes ``out/ensemble.jax`` and ``out/export.json`` (each atomically).

    ``export.json`` holds ``task``, ``input`` (``shape`` e.g. ``["batch", 28, 28, 1]``,
    ``dtype``, and ``range`` for uint8 pixels), the task's entries
    (:meth:`~meshensemble.tasks.Task.export_metadata`: for classification ``outputs``,
    ``classes``, ``temperature`` and ``conformal`` (``method``, ``alpha``, ``threshold``,
    ``k_reg``, ``lam``), None when uncalibrated; for regression ``outputs``, ``targets``,
    ``variance_scale`` and ``conformal`` (``quantile``, ``alpha``)), ``members``,
    ``preprocessing`` (the task's record and the input's statistics, which the artifact
    applies itself), ``platforms``, ``model``, ``workdir``, ``checkpoint_step``,
    ``data_identity`` and ``versions`` (meshensemble, jax).

    Args:
      predictor: from :func:`~meshensemble.serving.predictor.load_predictor`.
      out: the folder (created if missing; the two files are replaced if there).
      platforms: lowering platforms (default :data:`PLATFORMS`).

    Returns:
      The ``export.json`` object.

    Raises:
      ValueError: ``out`` cannot be written (checked before exporting).
      meshensemble.training.OutputError: a file could not be written.

    Example:
      >>> meta = export_ensemble(predictor, "exported")   # e.g. me.load_predictor("runs/mnist")
      >>> meta["platforms"]
      ['cpu', 'cuda', 'tpu']
    """
    check_writable(out, "pass a writable folder", name="export folder")
    try:
        import flatbuffers  # noqa: F401  (jax.export's serialization needs it)
    except ImportError:
        raise ValueError(
            "exporting needs the flatbuffers package, which jax.export serializes with; "
            "pip install flatbuffers (a dependency of meshensemble)"
        ) from None
    exported = export_artifact(predictor, platforms)
    meta = export_metadata(predictor, exported)
    blob = bytes(exported.serialize())
    storage.makedirs(out)
    for name, data in ((ARTIFACT_FILE, blob), (METADATA_FILE, dumps_strict(meta, indent=2) + "\n")):
        with writing(storage.join(out, name)):
            storage.atomic_write(storage.join(out, name), data)
    return meta
