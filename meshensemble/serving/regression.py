"""A trained regression run, ready to predict: :class:`RegressionPredictor`.

:func:`meshensemble.load_predictor` returns one for a run of ``meshensemble train --task
regression``: the ensemble rebuilt with the run's standardiser (features standardised on
the device, means and variances in the data's units), a checkpoint restored read-only,
and the calibration ``meshensemble evaluate --calibrate`` wrote to ``evaluation.json``
(the variance scale ``s`` and the conformal quantile ``q`` at ``alpha``) when it belongs
to that checkpoint. :meth:`RegressionPredictor.outputs` streams ``[N, F]`` features through
the mesh with the host streaming engine (:func:`meshensemble.core.streaming.stream`), as
the classification :class:`~meshensemble.serving.predictor.Predictor` does.

Example:
  >>> predictor = me.load_predictor("runs/toy")  # a calibrated run of the 1-D toy
  >>> x = np.linspace(-4, 4, 5, dtype=np.float32)[:, None]  # features [N, F]
  >>> out = predictor.predict(x)                # mean, variance, aleatoric, epistemic [N, T]
  >>> out["mean"].shape, out["epistemic"].dtype
  ((5, 1), dtype('float32'))
  >>> lower, upper = predictor.intervals(x)     # at the calibrated alpha
  >>> bool((lower < out["mean"]).all() and (out["mean"] < upper).all())
  True
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import shlex
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshensemble.core import steps, streaming
from meshensemble.core.mesh import BATCH, MEMBER_BATCH
from meshensemble.evaluation.regression import EVALUATION_FILE, restore_regression
from meshensemble.runtime.distributed import fetch
from meshensemble.serving.inputs import as_features

log = logging.getLogger("meshensemble")

MOMENT_KEYS = ("mean", "variance", "aleatoric", "epistemic")
"""The mixture's per-example outputs, each ``[N, T]`` in the data's units."""
REGRESSION_OUTPUT_KEYS = (*MOMENT_KEYS, "lower", "upper", "member_mean", "member_variance")
"""The arrays of :meth:`RegressionPredictor.outputs` (and ``predict``'s ``.npz``), in order."""


@dataclasses.dataclass(frozen=True)
class IntervalCalibration:
    """What ``meshensemble evaluate --calibrate`` fitted for one checkpoint of a regression run.

    Attributes:
      variance_scale: ``s``: the calibrated variance is ``s * variance``.
      quantile: ``q``: the conformal interval is ``mean +/- q * sqrt(s * variance)``.
      alpha: the miscoverage ``q`` was fitted for.
      step: the checkpoint it belongs to.
    """

    variance_scale: float
    quantile: float
    alpha: float
    step: int


def read_interval_calibration(workdir: str, step: int) -> tuple[IntervalCalibration | None, str]:
    """The regression calibration of checkpoint ``step`` in ``workdir/evaluation.json``.

    Returns:
      ``(calibration, why)``: None and the reason when there is none (for messages).

    Raises:
      ValueError: the calibration section exists but is corrupt.

    Example:
      >>> cal, why = read_interval_calibration("runs/toy", 2)  # evaluated at step 2
      >>> cal.alpha, cal.step, why
      (0.1, 2, '')
      >>> read_interval_calibration("runs/toy", 1)[0] is None  # another checkpoint's
      True
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
        if held != step:
            return None, f"the calibration in {path} is of checkpoint {held}, not {step}; {fix}"
        conformal = section["conformal"]
        cal = IntervalCalibration(
            float(section["variance_scale"]),
            float(conformal["quantile"]),
            float(conformal["alpha"]),
            held,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        msg = " ".join(str(err).split())
        raise ValueError(
            f"{path}: corrupt calibration ({type(err).__name__}: {msg}); {fix}"
        ) from None
    if not (cal.variance_scale > 0 and math.isfinite(cal.quantile) and 0 < cal.alpha < 1):
        raise ValueError(f"{path}: corrupt calibration ({cal}); {fix}")
    return cal, ""


def _serve(cfg: Any, members: bool, state: Any, x: jax.Array) -> dict[str, jax.Array]:
    """Per device: the mixture's moments (``pmean`` over ``ensemble``) and, asked, the members'."""
    out = dict(steps.mixture_moments(cfg, state, x))
    if members:
        own = steps.member_moments(cfg, state, x)
        out |= {"member_mean": own["mean"], "member_variance": own["variance"]}
    return out


class RegressionPredictor:
    """A restored regression ensemble with its calibration; every method streams the mesh.

    Build one with :func:`meshensemble.load_predictor`. Inputs are features ``[N, F]``
    (numbers; cast to float32 a batch at a time), a numpy array or a memory map.

    Attributes:
      task: ``"regression"``.
      ensemble, state, step, workdir: the restored run.
      calibration: the run's :class:`IntervalCalibration`, or None;
      uncalibrated_reason: why it is None ("" otherwise).
      standardizer: the training split's ``x_mean``, ``x_std``, ``y_mean``, ``y_std``.
      num_features, num_targets, num_members: ``F``, ``T``, the members.
      image_shape: ``(F,)`` and image_dtype: ``float32`` (one input row, for the export).
      data_identity: the run's recorded data identity; model: the member model.
      batch_size: examples per compiled call.
    """

    task = "regression"

    def __init__(
        self,
        run: Any,
        *,
        workdir: str,
        calibration: IntervalCalibration | None,
        uncalibrated_reason: str = "",
        model: str = "mlp",
        batch_size: int = 1000,
    ) -> None:
        """Use :func:`meshensemble.load_predictor`; ``run`` is a ``RestoredRegression``."""
        self.ensemble, self.state, self.step, self.workdir = (
            run.ensemble,
            run.state,
            run.step,
            workdir,
        )
        self.calibration, self.uncalibrated_reason = calibration, uncalibrated_reason
        self.standardizer = dict(run.standardizer)
        self.num_features, self.num_targets = int(run.features), int(run.targets)
        self.num_members = int(run.ensemble.num_members)
        self.image_shape, self.image_dtype = (self.num_features,), np.dtype(np.float32)
        self.data_identity, self.model = dict(run.identity), model
        streaming.batch_size_for(batch_size, 1, 1)
        self.batch_size = int(batch_size)

    @property
    def variance_scale(self) -> float | None:
        """The calibrated variance scale, or None for an uncalibrated run."""
        return None if self.calibration is None else self.calibration.variance_scale

    def check_intervals(self) -> IntervalCalibration:
        """The calibration intervals need. Raises ValueError (one line) when uncalibrated."""
        if self.calibration is None:
            raise ValueError(f"no conformal intervals: {self.uncalibrated_reason}")
        return self.calibration

    def outputs(
        self,
        x: Any,
        *,
        members: bool = False,
        scale: bool = True,
        intervals: bool | None = None,
        progress: Callable[[int], Any] | None = None,
    ) -> dict[str, np.ndarray]:
        """Every per-example output in one streamed pass (what ``meshensemble predict`` writes).

        Args:
          x: features ``[N, F]``.
          members: also return ``member_mean`` and ``member_variance`` ``[members, N, T]``.
          scale: multiply ``variance``, ``aleatoric`` and ``epistemic`` by the calibrated
            variance scale (when calibrated).
          intervals: add ``lower``/``upper``; None: when calibrated; True raises for an
            uncalibrated run. Intervals are ``mean +/- q * sqrt(s * variance)`` whatever
            ``scale`` says (``q`` was fitted on the scaled standard deviation).
          progress: called with the examples done after each batch.

        Returns:
          float32 numpy ``mean``, ``variance``, ``aleatoric``, ``epistemic`` ``[N, T]`` in
          the data's units, and ``lower``, ``upper`` ``[N, T]``, ``member_mean``,
          ``member_variance`` ``[members, N, T]`` as asked.

        Raises:
          ValueError: features of another shape or dtype, none, or intervals of an
            uncalibrated run.

        Example:
          >>> predictor = me.load_predictor("runs/toy")  # a calibrated run of the 1-D toy
          >>> x = np.linspace(-4, 4, 5, dtype=np.float32)[:, None]  # features [N, F]
          >>> out = predictor.outputs(x, members=True)
          >>> sorted(out)
          ['aleatoric', 'epistemic', 'lower', 'mean', 'member_mean', 'member_variance',
           'upper', 'variance']
          >>> out["member_mean"].shape  # (M, N, T)
          (4, 5, 1)
        """
        x = as_features(x, self.num_features)
        cal = (
            self.check_intervals()
            if intervals
            else (self.calibration if intervals is None else None)
        )
        s = self.variance_scale if scale and self.variance_scale is not None else None
        program, state, ens = self._program(bool(members)), self.state, self.ensemble
        n, result = len(x), {}

        def sink(start: int, out: dict[str, np.ndarray]) -> None:
            if cal is not None:
                half = cal.quantile * np.sqrt(cal.variance_scale * out["variance"])
                out |= {"lower": out["mean"] - half, "upper": out["mean"] + half}
            if s is not None:
                out |= {k: out[k] * np.float32(s) for k in MOMENT_KEYS[1:]}
            for key, v in out.items():
                axis = 1 if key.startswith("member_") else 0
                if key not in result:
                    shape = list(v.shape)
                    shape[axis] = n
                    result[key] = np.empty(shape, v.dtype)
                result[key][(slice(None),) * axis + (slice(start, start + v.shape[axis]),)] = v

        streaming.stream(
            lambda xb, mask: program(state, ens.place(xb)),
            x,
            self.batch_size,
            ens.data_size,
            sink,
            axes={"member_mean": 1, "member_variance": 1},
            progress=progress,
            prepare=lambda rows: np.asarray(rows, np.float32),
        )
        return {k: result[k] for k in REGRESSION_OUTPUT_KEYS if k in result}

    def _program(self, members: bool) -> Callable[..., Any]:
        specs = dict.fromkeys(MOMENT_KEYS, BATCH)
        if members:
            specs |= {"member_mean": MEMBER_BATCH, "member_variance": MEMBER_BATCH}
        return self.ensemble.build(
            ("regression-serve", members),
            lambda cfg: functools.partial(_serve, cfg, members),
            (self.ensemble.state_spec, BATCH),
            specs,
        )

    def predict(self, x: Any, scale: bool = True) -> dict[str, np.ndarray]:
        """The mixture's ``mean``, ``variance``, ``aleatoric``, ``epistemic`` ``[N, T]``.

        ``Ensemble.predict(state, x)`` in the data's units, the variances multiplied by the
        calibrated scale when the run is calibrated and ``scale``.

        Example:
          >>> predictor = me.load_predictor("runs/toy")  # a calibrated run of the 1-D toy
          >>> x = np.linspace(-4, 4, 5, dtype=np.float32)[:, None]  # features [N, F]
          >>> predictor.predict(x)["mean"].shape  # (N, T)
          (5, 1)
        """
        out = self.outputs(x, scale=scale, intervals=False)
        return {k: out[k] for k in MOMENT_KEYS}

    def predict_members(self, x: Any) -> dict[str, np.ndarray]:
        """Each member's Gaussian: ``mean``, ``variance`` ``[members, N, T]`` (never scaled).

        Example:
          >>> predictor = me.load_predictor("runs/toy")  # a calibrated run of the 1-D toy
          >>> x = np.linspace(-4, 4, 5, dtype=np.float32)[:, None]  # features [N, F]
          >>> predictor.predict_members(x)["mean"].shape  # (M, N, T)
          (4, 5, 1)
        """
        out = self.outputs(x, members=True, scale=False, intervals=False)
        return {"mean": out["member_mean"], "variance": out["member_variance"]}

    def uncertainty(self, x: Any) -> dict[str, np.ndarray]:
        """Per-example ``variance``, ``aleatoric`` and ``epistemic`` ``[N, T]`` (scaled).

        Example:
          >>> predictor = me.load_predictor("runs/toy")  # a calibrated run of the 1-D toy
          >>> x = np.linspace(-4, 4, 5, dtype=np.float32)[:, None]  # features [N, F]
          >>> predictor.uncertainty(x)["epistemic"].shape  # (N, T)
          (5, 1)
        """
        out = self.predict(x)
        return {k: out[k] for k in MOMENT_KEYS[1:]}

    def intervals(self, x: Any) -> tuple[np.ndarray, np.ndarray]:
        """Conformal intervals ``(lower, upper)`` ``[N, T]`` at the run's calibrated alpha.

        Raises:
          ValueError: the run is not calibrated (run ``meshensemble evaluate --calibrate``).

        Example:
          >>> predictor = me.load_predictor("runs/toy")  # a calibrated run of the 1-D toy
          >>> x = np.linspace(-4, 4, 5, dtype=np.float32)[:, None]  # features [N, F]
          >>> lower, upper = predictor.intervals(x)
          >>> lower.shape, bool((lower < upper).all())
          ((5, 1), True)
        """
        out = self.outputs(x, intervals=True)
        return out["lower"], out["upper"]

    def prediction_sets(self, x: Any) -> np.ndarray:
        """Not for regression: raises ValueError pointing to :meth:`intervals`."""
        raise ValueError("a regression run has no prediction sets; use predictor.intervals(x)")


def load_regression_predictor(
    workdir: str,
    cfg: Any,
    mesh: Any = None,
    *,
    checkpoint: int | None = None,
    batch_size: int = 1000,
    echo: Callable[[str], Any] | None = None,
) -> RegressionPredictor:
    """:func:`meshensemble.load_predictor` for a regression run (``cfg.task == "regression"``).

    Raises:
      FileNotFoundError: no checkpoint; ValueError: a bad mesh, batch size or calibration;
      meshensemble.CheckpointError: no readable checkpoint.

    Example:
      >>> from meshensemble.evaluation.run import load_run_config
      >>> load_regression_predictor("runs/toy", load_run_config("runs/toy")).num_targets
      1
    """
    streaming.batch_size_for(batch_size, 1, 1)
    run = restore_regression(workdir, cfg, mesh, checkpoint, echo or log.warning)
    cal, why = read_interval_calibration(workdir, run.step)
    model = "mlp" if cfg.model == "cnn" else cfg.model
    return RegressionPredictor(
        run, workdir=workdir, calibration=cal, uncalibrated_reason=why, model=model,
        batch_size=batch_size,
    )  # fmt: skip


def regression_prediction_function(
    predictor: RegressionPredictor,
) -> Callable[[jax.Array], dict[str, jax.Array]]:
    """The regression ensemble's prediction as a pure function of raw features, for export.

    Every member's Gaussian comes from :func:`meshensemble.core.steps.member_moments` on
    one device with all members local (FSDP parameters gathered on the host), so the
    standardisation of the features and targets is the run's own.

    Returns:
      ``fn(x [N, F] float32) -> {"mean", "variance" [N, T], "member_mean",
      "member_variance" [members, N, T]}``; ``variance`` times the calibrated scale when
      the run is calibrated (the members' never).

    Example:
      >>> predictor = me.load_predictor("runs/toy")  # a calibrated run of the 1-D toy
      >>> x = np.linspace(-4, 4, 5, dtype=np.float32)[:, None]  # features [N, F]
      >>> fn = regression_prediction_function(predictor)
      >>> fn(x)["mean"].shape, fn(x)["member_variance"].shape
      ((5, 1), (4, 5, 1))
      >>> bool(np.allclose(fn(x)["mean"], predictor.predict(x)["mean"], atol=1e-4))
      True
    """
    cfg = dataclasses.replace(predictor.ensemble.step_config(), gather_axes=None, augment=None)
    host = fetch(predictor.state.replace(opt_state=None))
    s = predictor.variance_scale

    def fn(x: jax.Array) -> dict[str, jax.Array]:
        member = steps.member_moments(cfg, host, x)
        mean = jnp.mean(member["mean"], axis=0)
        spread = jnp.mean(jnp.square(member["mean"] - mean[None]), axis=0)
        variance = jnp.mean(member["variance"], axis=0) + spread
        if s is not None:
            variance = variance * jnp.float32(s)
        return {
            "mean": mean,
            "variance": variance,
            "member_mean": member["mean"],
            "member_variance": member["variance"],
        }

    return fn


def regression_metadata(predictor: RegressionPredictor) -> dict[str, Any]:
    """The regression-specific entries of ``export.json``.

    Returns:
      ``task``, ``input`` (``shape`` ``["batch", F]``, ``dtype`` float32), ``outputs``,
      ``targets``, ``members``, ``standardizer``, ``variance_scale`` and ``conformal``
      (``quantile``, ``alpha``; None when uncalibrated).

    Example:
      >>> predictor = me.load_predictor("runs/toy")  # a calibrated run of the 1-D toy
      >>> regression_metadata(predictor)["input"]["shape"]
      ['batch', 1]
    """
    cal = predictor.calibration
    conformal = None if cal is None else {"quantile": cal.quantile, "alpha": cal.alpha}
    return {
        "task": "regression",
        "input": {"shape": ["batch", predictor.num_features], "dtype": "float32"},
        "outputs": {
            "mean": ["batch", "targets"],
            "variance": ["batch", "targets"],
            "member_mean": ["members", "batch", "targets"],
            "member_variance": ["members", "batch", "targets"],
        },
        "targets": predictor.num_targets,
        "members": predictor.num_members,
        "standardizer": predictor.standardizer,
        "variance_scale": predictor.variance_scale,
        "conformal": conformal,
    }


def intervals_from(mean: Any, variance: Any, meta: Mapping[str, Any]) -> tuple[Any, Any]:
    """``(lower, upper)`` from an artifact's ``mean``/``variance`` and its ``export.json``.

    Raises:
      ValueError: the export is of an uncalibrated run.

    Example:
      >>> predictor = me.load_predictor("runs/toy")  # a calibrated run of the 1-D toy
      >>> x = np.linspace(-4, 4, 5, dtype=np.float32)[:, None]  # features [N, F]
      >>> out, meta = predictor.predict(x), regression_metadata(predictor)  # as exported
      >>> lower, upper = intervals_from(out["mean"], out["variance"], meta)
      >>> bool(np.allclose(lower, predictor.intervals(x)[0], atol=1e-3))
      True
    """
    conformal = meta.get("conformal")
    if not conformal:
        raise ValueError("the exported run is not calibrated: no conformal quantile")
    half = conformal["quantile"] * np.sqrt(np.asarray(variance))
    return np.asarray(mean) - half, np.asarray(mean) + half
