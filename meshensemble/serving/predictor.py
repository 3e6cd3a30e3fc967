"""A trained run, ready to predict: :func:`load_predictor` and :class:`Predictor`.

:func:`load_predictor` rebuilds a run's ensemble from its ``config.json`` on any mesh,
restores its newest checkpoint (read-only: nothing in the workdir changes) and reads the
calibration ``meshensemble evaluate --calibrate`` wrote to ``evaluation.json`` (the
temperature, and the conformal threshold, method and alpha) when it belongs to that
checkpoint. :meth:`Predictor.outputs` streams images through the mesh with the host
streaming engine (:func:`meshensemble.core.streaming.stream`: padded, masked batches, a
bounded number in flight); ``meshensemble predict`` and every method here use it.

Example:
  >>> predictor = me.load_predictor("runs/tiny")   # a trained, calibrated run
  >>> probs = predictor.predict(images)            # [N, 10], calibrated when the run is
  >>> probs.shape
  (32, 10)
  >>> sets = predictor.prediction_sets(images)     # [N, 10] bool (uncalibrated: refused)
  >>> sets.shape, sets.dtype
  ((32, 10), dtype('bool'))
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from meshensemble import calibration
from meshensemble.core import steps, streaming
from meshensemble.core.mesh import BATCH, MEMBER_BATCH, REPLICATED, make_mesh, parse_mesh
from meshensemble.data import IMAGE_SHAPE
from meshensemble.evaluation import EVALUATION_FILE, load_run_config
from meshensemble.numerics import temperature as temperature_lib
from meshensemble.numerics.statmath import shannon_entropy
from meshensemble.serving.blocks import BLOCK_ROWS, in_blocks
from meshensemble.serving.inputs import as_images
from meshensemble.serving.regression import RegressionPredictor, load_regression_predictor
from meshensemble.training import build_ensemble, default_mesh_shape
from meshensemble.training.checkpoint import restore_checkpoint
from meshensemble.training.identity import read_saved_config

log = logging.getLogger("meshensemble")

IMAGE_DTYPE = np.uint8
"""The pixel dtype every run trains on (images ``[N, *IMAGE_SHAPE]`` in ``0..255``)."""
UNCERTAINTY_KEYS = ("label", "confidence", "entropy", "mutual_information")
"""The per-example fields of :meth:`Predictor.uncertainty`, each ``[N]``."""
OUTPUT_KEYS = ("probs", *UNCERTAINTY_KEYS, "prediction_set", "member_probs")
"""The arrays of :meth:`Predictor.outputs` (and ``meshensemble predict``'s ``.npz``), in order."""


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What ``meshensemble evaluate --calibrate`` fitted for one checkpoint of a run.

    Attributes:
      temperature: ``T`` of "pool, then calibrate": ``softmax(log(mean_m p_m) / T)``.
      threshold: the split-conformal threshold ``q`` of the calibrated probabilities.
      method: the conformal score (one of :data:`meshensemble.calibration.METHODS`).
      alpha: the miscoverage rate the threshold was fitted for.
      step: the checkpoint it belongs to.
    """

    temperature: float
    threshold: float
    method: str
    alpha: float
    step: int


def read_calibration(workdir: str, step: int) -> tuple[Calibration | None, str]:
    """The calibration of checkpoint ``step`` in ``workdir/evaluation.json``, if any.

    Args:
      workdir: the run's folder.
      step: the restored checkpoint; a calibration of another checkpoint does not count.

    Returns:
      ``(calibration, why)``: None and the reason (for messages) when there is none.

    Raises:
      ValueError: ``evaluation.json`` exists but its calibration section is corrupt.

    Example:
      >>> cal, why = read_calibration("runs/mnist", 938)   # no evaluation.json there
      >>> cal is None
      True
      >>> print(why)
      run runs/mnist is not calibrated (no evaluation.json); run `meshensemble evaluate
      --workdir runs/mnist --checkpoint 938 --calibrate` first
    """
    path = os.path.join(workdir, EVALUATION_FILE)
    command = (
        f"meshensemble evaluate --workdir {shlex.quote(workdir)} --checkpoint {step} --calibrate"
    )
    fix = f"run `{command}` first"
    if not os.path.isfile(path):
        return None, f"run {workdir} is not calibrated (no {EVALUATION_FILE}); {fix}"
    try:
        with open(path) as f:
            saved = json.load(f)
        section = saved.get("calibration")
        if section is None:
            return None, f"run {workdir} is not calibrated ({path} has none); {fix}"
        held = int(saved["checkpoint_step"])
        conformal = section["conformal"]
        if held != step:  # the same score and alpha, for the checkpoint asked for
            same = f"{command} --conformal {conformal['method']} --alpha {conformal['alpha']:g}"
            return None, (
                f"the calibration in {path} is of checkpoint {held}, not {step}; run `{same}` "
                f"first (it replaces that of checkpoint {held})"
            )
        cal = Calibration(
            float(section["temperature"]),
            float(conformal["threshold"]),
            str(conformal["method"]),
            float(conformal["alpha"]),
            held,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        msg = " ".join(str(err).split())
        raise ValueError(
            f"{path}: corrupt calibration ({type(err).__name__}: {msg}); {fix}"
        ) from None
    if cal.method not in calibration.METHODS or not cal.temperature > 0:
        raise ValueError(f"{path}: corrupt calibration ({cal}); {fix}")
    return cal, ""


def _finish(out: dict[str, jax.Array], t: Any, t_cal: Any, with_calibrated: bool) -> dict:
    """Per-example fields from :func:`meshensemble.core.steps.prediction_summaries`.

    Traced inside the predictor's program, block by block (elementwise code compiled for
    another shape may round differently too)."""
    pooled = out["probs"]
    probs = pooled if t is None else temperature_lib.tempered(pooled, t)
    res = {
        "probs": probs,
        "label": jnp.argmax(probs, axis=-1).astype(jnp.int32),
        "confidence": jnp.max(probs, axis=-1),
        "entropy": shannon_entropy(probs),
        "mutual_information": jnp.maximum(shannon_entropy(pooled) - out["expected_entropy"], 0.0),
    }
    if "member_probs" in out:
        res["member_probs"] = out["member_probs"]
    if with_calibrated:
        res["calibrated"] = temperature_lib.tempered(pooled, t_cal)
    return res


class Predictor:
    """A restored ensemble with its calibration; every method streams through the mesh.

    Build one with :func:`load_predictor`. Images are ``[N, H, W, C]`` (or ``[N, H, W]``
    for one channel) in the run's dtype and range (uint8 ``0..255``), a numpy array, a
    memory map, or :class:`~meshensemble.serving.inputs.Images`.

    Attributes:
      ensemble: the :class:`meshensemble.Ensemble` (on the predictor's mesh).
      state: the restored state.
      step: the checkpoint's step.
      workdir: the run's folder.
      calibration: the run's :class:`Calibration`, or None.
      uncalibrated_reason: why ``calibration`` is None ("" otherwise).
      image_shape: one image's shape, e.g. ``(28, 28, 1)``; image_dtype: ``uint8``.
      num_classes: the classes; num_members: the members.
      data_identity: the run's data as ``config.json`` records it (``{}`` if absent).
      model: the run's model name.
      batch_size: examples per compiled call (rounded up to whole blocks of
        :data:`~meshensemble.serving.blocks.BLOCK_ROWS` rows per device).
    """

    def __init__(
        self,
        ensemble: Any,
        state: Any,
        *,
        step: int,
        workdir: str,
        calibration: Calibration | None,
        uncalibrated_reason: str = "",
        num_classes: int,
        data_identity: Mapping[str, Any] | None = None,
        model: str = "",
        batch_size: int = 1000,
    ) -> None:
        """Use :func:`load_predictor`; the arguments are its attributes."""
        self.ensemble, self.state, self.step, self.workdir = ensemble, state, step, workdir
        self.calibration, self.uncalibrated_reason = calibration, uncalibrated_reason
        self.num_classes, self.num_members = int(num_classes), int(ensemble.num_members)
        self.data_identity, self.model = dict(data_identity or {}), model
        self.image_shape, self.image_dtype = tuple(IMAGE_SHAPE), np.dtype(IMAGE_DTYPE)
        streaming.batch_size_for(batch_size, 1, 1)  # a positive integer, or one line
        self.batch_size = int(batch_size)

    @property
    def temperature(self) -> float | None:
        """The calibrated temperature, or None for an uncalibrated run."""
        return None if self.calibration is None else self.calibration.temperature

    def check_sets(self) -> Calibration:
        """The calibration prediction sets need; raises for an uncalibrated run.

        Raises:
          ValueError: one line saying why there is no calibration and how to get one.
        """
        if self.calibration is None:
            raise ValueError(f"no prediction sets: {self.uncalibrated_reason}")
        return self.calibration

    def outputs(
        self,
        images: Any,
        *,
        members: bool = False,
        temperature: bool = True,
        sets: bool | None = None,
        progress: Callable[[int], Any] | None = None,
    ) -> dict[str, np.ndarray]:
        """Every per-example output in one streamed pass (what ``meshensemble predict`` writes).

        The program runs in fixed blocks of rows (:mod:`meshensemble.serving.blocks`): an
        example gets the same bits, and so the same set, alone or in any batch, whatever
        ``batch_size``.

        Args:
          images: ``[N, ...]`` images (see the class).
          members: also return ``member_probs``.
          temperature: apply the calibrated temperature to ``probs`` (when calibrated).
          sets: add ``prediction_set``; None: when the run is calibrated; True raises for
            an uncalibrated run. Sets always use the calibrated probabilities (the
            threshold was fitted on them), whatever ``temperature`` says.
          progress: called with the examples done after each batch.

        Returns:
          numpy ``probs [N, classes]`` (the mean of the members' softmax, calibrated unless
          ``temperature=False``), ``label [N]``, ``confidence [N]`` (max prob),
          ``entropy [N]`` (of ``probs``), ``mutual_information [N]`` (of the members'
          uncalibrated softmax), and ``prediction_set [N, classes]`` bool,
          ``member_probs [members, N, classes]`` as asked.

        Raises:
          ValueError: images of another shape or dtype, none, or sets of an uncalibrated run.

        Example:
          >>> out = predictor.outputs(images, members=True)
          >>> out["probs"].shape, out["member_probs"].shape
          ((32, 10), (2, 32, 10))
          >>> sorted(out)
          ['confidence', 'entropy', 'label', 'member_probs', 'mutual_information', 'probs']
        """
        images = as_images(images, self.image_shape, self.image_dtype)
        cal = self.check_sets() if sets else (self.calibration if sets is None else None)
        t = self.temperature if temperature else None
        temps = (
            np.float32(1.0 if t is None else t),
            np.float32(1.0 if cal is None else cal.temperature),
        )
        program = self._program(bool(members), t is not None, cal is not None)
        ens, state = self.ensemble, self.state

        def fn(x: np.ndarray, mask: np.ndarray) -> Any:
            return program(state, ens.place(x), *temps)

        n, result = len(images), {}

        def sink(start: int, out: dict[str, np.ndarray]) -> None:
            if cal is not None:
                calibrated = out.pop("calibrated")
                sets = calibration.prediction_sets(calibrated, cal.threshold, cal.method)
                out["prediction_set"] = np.asarray(sets)
            for key, v in out.items():
                axis = 1 if key == "member_probs" else 0
                if key not in result:
                    shape = list(v.shape)
                    shape[axis] = n
                    result[key] = np.empty(shape, v.dtype)
                index = (slice(None),) * axis + (slice(start, start + v.shape[axis]),)
                result[key][index] = v

        streaming.stream(
            fn,
            images,
            self.batch_size,
            ens.data_size * BLOCK_ROWS,  # whole blocks on every device
            sink,
            axes={"member_probs": 1},
            progress=progress,
        )
        return {k: result[k] for k in OUTPUT_KEYS if k in result}

    def _program(self, members: bool, tempered: bool, calibrated: bool) -> Callable[..., Any]:
        """``program(state, x, t, t_cal)``: every field of :meth:`outputs` but the sets, run in
        blocks (:mod:`meshensemble.serving.blocks`): each example's bits are the same in
        any batch."""
        keys = ["probs", *UNCERTAINTY_KEYS] + ["calibrated"] * calibrated
        specs = dict.fromkeys(keys, BATCH) | ({"member_probs": MEMBER_BATCH} if members else {})

        def make(cfg: Any) -> Callable[..., Any]:
            def per_device(state: Any, x: jax.Array, t: jax.Array, t_cal: jax.Array) -> dict:
                out = steps.prediction_summaries(cfg, members, state, x)
                return _finish(out, t if tempered else None, t_cal, calibrated)

            return in_blocks(per_device, axes={"member_probs": 1})

        return self.ensemble.build(
            ("prediction_outputs", BLOCK_ROWS, members, tempered, calibrated),
            make,
            (self.ensemble.state_spec, BATCH, REPLICATED, REPLICATED),
            specs,
        )

    def predict(self, images: Any, temperature: bool = True) -> np.ndarray:
        """The ensemble's probabilities ``[N, classes]`` (calibrated when the run is).

        Args:
          images: ``[N, ...]`` images.
          temperature: apply the run's calibrated temperature (if any).

        Returns:
          float32 numpy ``[N, classes]``: ``Ensemble.predict(state, images, temperature=T)``.

        Raises:
          ValueError: images of another shape or dtype, or none.

        Example:
          >>> predictor.predict(images).argmax(-1).shape   # the classes, [N]
          (32,)
        """
        return self.outputs(images, temperature=temperature, sets=False)["probs"]

    def predict_members(self, images: Any) -> np.ndarray:
        """Every member's softmax ``[members, N, classes]`` (no temperature).

        Raises:
          ValueError: images of another shape or dtype, or none.

        Example:
          >>> predictor.predict_members(images).shape  # (members, N, 10)
          (2, 32, 10)
        """
        return self.outputs(images, members=True, sets=False)["member_probs"]

    def uncertainty(self, images: Any) -> dict[str, np.ndarray]:
        """Per-example ``label``, ``confidence``, ``entropy``, ``mutual_information``, ``[N]``.

        Raises:
          ValueError: images of another shape or dtype, or none.

        Example:
          >>> predictor.uncertainty(images)["mutual_information"].shape  # (N,)
          (32,)
        """
        out = self.outputs(images, sets=False)
        return {k: out[k] for k in UNCERTAINTY_KEYS}

    def prediction_sets(self, images: Any) -> np.ndarray:
        """Conformal prediction sets at the run's alpha: bool ``[N, classes]``.

        ``me.calibration.prediction_sets(calibrated_probs, threshold, method)`` with the
        run's calibrated temperature, threshold and method.

        Raises:
          ValueError: the run is not calibrated (run ``meshensemble evaluate
            --calibrate``), or bad images.

        Example:
          >>> cal = Calibration(temperature=1.0, threshold=0.9, method="thr", alpha=0.1, step=20)
          >>> calibrated = me.Predictor(ens, state, step=20, workdir="run", calibration=cal,
          ...                           num_classes=10)
          >>> calibrated.prediction_sets(images).sum(-1).shape  # set sizes, [N]
          (32,)
        """
        return self.outputs(images, sets=True)["prediction_set"]


def predictor_mesh(mesh: Any, members: int) -> Mesh:
    """The mesh a predictor runs on: a ``Mesh``, ``"ensemble=E,data=D"``, a dict or None.

    None (or ``""``) takes every device with ``ensemble = gcd(members, devices)``.

    Example:
      >>> dict(predictor_mesh("ensemble=4,data=2", 8).shape)
      {'ensemble': 4, 'data': 2}
    """
    if isinstance(mesh, Mesh):
        return mesh
    if mesh is None or mesh == "":
        shape = default_mesh_shape(members, jax.device_count())
    else:
        shape = (
            parse_mesh(mesh)
            if isinstance(mesh, str)
            else {k: int(v) for k, v in dict(mesh).items()}
        )
    return make_mesh(shape.get("ensemble"), shape.get("data", 1), shape.get("model"))


def load_predictor(
    workdir: str,
    mesh: Any = None,
    *,
    checkpoint: int | None = None,
    batch_size: int = 1000,
    echo: Callable[[str], Any] | None = None,
) -> Predictor | RegressionPredictor:
    """Loads a trained run for prediction on any mesh (nothing in the workdir changes).

    A regression run (``task="regression"``) gives a
    :class:`~meshensemble.serving.regression.RegressionPredictor` (features ``[N, F]`` in,
    the mixture's ``mean``/``variance``/``aleatoric``/``epistemic`` out, conformal
    intervals when calibrated); a classification run a :class:`Predictor`.

    Args:
      workdir: the run's folder (``config.json``, ``checkpoints/``).
      mesh: a ``Mesh``, ``"ensemble=E,data=D"``, a dict of axis sizes, or None for every
        device (``ensemble = gcd(members, devices)``).
      checkpoint: the step to restore; default the newest good one.
      batch_size: examples per compiled call (rounded up to whole blocks of
        :data:`~meshensemble.serving.blocks.BLOCK_ROWS` rows per device); it never changes
        a result's bits.
      echo: where notes go (a damaged checkpoint skipped); default logging.

    Returns:
      A :class:`Predictor` (or a ``RegressionPredictor`` for a regression run).

    Raises:
      FileNotFoundError: no run folder, no ``config.json``, or no checkpoint.
      ValueError: a corrupt ``config.json`` or calibration, a bad mesh or batch size.
      meshensemble.CheckpointError: no readable checkpoint (damaged), or one that does not
        fit the run's config.

    Example:
      >>> predictor = me.load_predictor("runs/tiny", mesh="ensemble=4,data=1")
      >>> predictor.predict(images).shape
      (32, 10)
    """
    cfg = load_run_config(workdir)
    if cfg.task == "regression":  # features [N, F] -> Gaussian mixture moments, intervals
        return load_regression_predictor(
            workdir, cfg, mesh, checkpoint=checkpoint, batch_size=batch_size, echo=echo
        )
    streaming.batch_size_for(batch_size, 1, 1)
    resolved = (read_saved_config(workdir) or {}).get("resolved") or {}
    identity = resolved.get("data_identity") or {}
    num_train = max(int(identity.get("num_train") or cfg.batch_size) - cfg.validation, 1)
    sample = np.zeros((1, *IMAGE_SHAPE), IMAGE_DTYPE)
    ens = build_ensemble(cfg, predictor_mesh(mesh, cfg.members), num_train, sample)
    say = echo or log.warning
    state, _, step = restore_checkpoint(workdir, ens, sample, checkpoint, say, move_damaged=False)
    cal, why = read_calibration(workdir, step)
    return Predictor(
        ens,
        state,
        step=step,
        workdir=workdir,
        calibration=cal,
        uncalibrated_reason=why,
        num_classes=ens.num_classes(state, sample),
        data_identity=identity,
        model=cfg.model,
        batch_size=batch_size,
    )
