"""A trained ensemble as a StableHLO artifact that runs with JAX alone: :func:`export_ensemble`.

``DIR/ensemble.jax`` (:data:`ARTIFACT_FILE`) holds the bytes of
``jax.export.Exported.serialize()`` of the prediction function with the parameters
embedded as constants, the input transform included (it takes the raw uint8 images
``[N, 28, 28, 1]`` that ``meshensemble predict`` takes), a symbolic batch dimension, lowered
for ``cpu`` and ``cuda`` (and ``tpu`` where the installed JAX can). It returns
``{"probs": [N, classes], "member_probs": [members, N, classes]}``, ``probs`` with the
run's calibrated temperature when it has one. ``DIR/export.json`` (:data:`METADATA_FILE`)
says what it takes and what it was made from, and holds the conformal threshold to build
prediction sets without this library::

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
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from meshensemble import calibration
from meshensemble.core import steps
from meshensemble.numerics import temperature as temperature_lib
from meshensemble.runtime.distributed import fetch
from meshensemble.serving.outputs import atomic_write
from meshensemble.serving.predictor import Predictor
from meshensemble.serving.regression import regression_metadata, regression_prediction_function
from meshensemble.training.outputs import check_writable, dumps_strict

ARTIFACT_FILE = "ensemble.jax"
"""The serialized ``jax.export.Exported`` inside an export folder."""
METADATA_FILE = "export.json"
"""What the artifact takes and returns, the calibration, the run's data and versions."""
PLATFORMS = ("cpu", "cuda", "tpu")
"""Platforms the artifact is lowered for; ``tpu`` is dropped where this JAX cannot."""
BATCH_DIM = "batch"
"""Name of the artifact's symbolic batch dimension."""


def prediction_function(predictor: Predictor) -> Callable[[jax.Array], dict[str, jax.Array]]:
    """The ensemble's prediction as a pure function of raw images, parameters embedded.

    Every member's softmax comes from :func:`meshensemble.core.steps.member_probs` (the
    per-device function of ``Ensemble.predict``) on one device with all members local
    (FSDP parameters gathered on the host first), so the input transform, the compute dtype
    and the member strategy are the run's own.

    Args:
      predictor: a :class:`~meshensemble.serving.predictor.Predictor`.

    Returns:
      ``fn(images [N, *image_shape] uint8) -> {"probs": [N, classes], "member_probs":
      [members, N, classes]}``; ``probs`` calibrated when the run is.

    Example:
      >>> fn = prediction_function(predictor)
      >>> fn(images)["probs"].shape
      (32, 10)
    """
    cfg = dataclasses.replace(predictor.ensemble.step_config(), gather_axes=None, augment=None)
    state = predictor.state
    # On the host, whole (FSDP slices gathered); the optimizer state is not needed.
    host = fetch(state.replace(opt_state=None))
    t = predictor.temperature

    def fn(images: jax.Array) -> dict[str, jax.Array]:
        member = steps.member_probs(cfg, host, images)
        probs = jnp.mean(member, axis=0)
        if t is not None:
            probs = temperature_lib.tempered(probs, jnp.float32(t))
        return {"probs": probs, "member_probs": member}

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
    spec = jax.ShapeDtypeStruct((b, *predictor.image_shape), predictor.image_dtype)
    regression = getattr(predictor, "task", "") == "regression"
    make = regression_prediction_function if regression else prediction_function
    fn = jax.jit(make(predictor))
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
    common = {
        "platforms": list(exported.platforms),
        "model": predictor.model,
        "workdir": os.path.abspath(predictor.workdir),
        "checkpoint_step": predictor.step,
        "data_identity": predictor.data_identity,
        "versions": {"meshensemble": version, "jax": jax.__version__},
    }
    if getattr(predictor, "task", "") == "regression":
        return {"artifact": ARTIFACT_FILE, **regression_metadata(predictor), **common}
    cal = predictor.calibration
    scores = inspect.signature(calibration.conformal_scores).parameters
    conformal = None
    if cal is not None:
        conformal = {
            "method": cal.method,
            "alpha": cal.alpha,
            "threshold": cal.threshold,
            "k_reg": scores["k_reg"].default,
            "lam": scores["lam"].default,
            "randomized": False,
        }
    return {
        "artifact": ARTIFACT_FILE,
        "input": {
            "shape": [BATCH_DIM, *predictor.image_shape],
            "dtype": str(predictor.image_dtype),
            "range": [0, 255],
        },
        "outputs": {
            "probs": ["batch", "classes"],
            "member_probs": ["members", "batch", "classes"],
        },
        "classes": predictor.num_classes,
        "members": predictor.num_members,
        "temperature": predictor.temperature,
        "conformal": conformal,
        **common,
    }


def export_ensemble(
    predictor: Predictor, out: str, platforms: Sequence[str] = PLATFORMS
) -> dict[str, Any]:
    """Writes ``out/ensemble.jax`` and ``out/export.json`` (each atomically).

    ``export.json`` holds ``input`` (``shape`` ``["batch", 28, 28, 1]``, ``dtype``,
    ``range``), ``outputs``, ``classes``, ``members``, ``temperature`` (None when
    uncalibrated), ``conformal`` (``method``, ``alpha``, ``threshold``, ``k_reg``, ``lam``;
    None when uncalibrated), ``platforms``, ``model``, ``workdir``, ``checkpoint_step``,
    ``data_identity`` and ``versions`` (meshensemble, jax). For a regression run
    (:class:`~meshensemble.serving.regression.RegressionPredictor`) the artifact takes
    float32 features ``["batch", F]`` and returns ``mean``, ``variance`` (scaled when
    calibrated), ``member_mean`` and ``member_variance``; ``export.json`` holds ``task``,
    ``targets``, ``standardizer``, ``variance_scale`` and ``conformal`` (``quantile``,
    ``alpha``) instead of the classification entries
    (:func:`~meshensemble.serving.regression.regression_metadata`).

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
    os.makedirs(out, exist_ok=True)
    atomic_write(os.path.join(out, ARTIFACT_FILE), blob)
    atomic_write(os.path.join(out, METADATA_FILE), (dumps_strict(meta, indent=2) + "\n").encode())
    return meta
