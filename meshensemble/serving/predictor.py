"""A trained run, ready to predict: :func:`load_predictor` and :class:`Predictor`.

:func:`load_predictor` restores a run on any mesh (:func:`meshensemble.training.restore.
restore_run`: nothing in the workdir changes) and reads the calibration ``meshensemble
evaluate --calibrate`` wrote to ``evaluation.json`` when it was fitted for this very run
and checkpoint (:func:`read_calibration`: the run's identity, not the step alone). A
:class:`Predictor` streams inputs through the mesh with the host streaming engine
(:func:`meshensemble.core.streaming.stream`: padded, masked batches, a bounded number in
flight) and asks the run's task what to serve (:meth:`meshensemble.tasks.Task.serve`,
``finish``, ``view``): probabilities, uncertainty and prediction sets for classification,
the Gaussian mixture's moments and conformal intervals for regression, anything a user's
task defines. ``meshensemble predict`` and every method here use it.

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

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from meshensemble.core import steps, streaming
from meshensemble.core.mesh import BATCH, MEMBER_BATCH
from meshensemble.data import IMAGE_SHAPE
from meshensemble.evaluation import EVALUATION_FILE
from meshensemble.runtime import storage
from meshensemble.serving.inputs import as_inputs
from meshensemble.training.config import model_name
from meshensemble.training.restore import restore_run, run_identity, run_mesh

log = logging.getLogger("meshensemble")

predictor_mesh = run_mesh
"""The mesh a predictor runs on (:func:`meshensemble.training.restore.run_mesh`)."""


def read_calibration(
    workdir: str,
    task: Any,
    step: int,
    identity: Mapping[str, Any],
    note: Callable[[str], Any] | None = None,
) -> tuple[Any, str]:
    """The calibration ``evaluation.json`` holds for this run's checkpoint ``step``, if any.

    A calibration counts only when its ``fitted_for`` equals ``identity`` (the run's data,
    seed, step and checkpoint digest, :func:`meshensemble.training.restore.run_identity`):
    one fitted for another checkpoint, another run (a ``train --overwrite`` since), or
    written before calibrations named their run is not applied.

    Args:
      workdir: the run's folder; task: its task (reads the section).
      step: the restored checkpoint; identity: its run identity.
      note: gets one line when a calibration is there but not applied (another run's, or
        an older version's); None: nothing is said.

    Returns:
      ``(calibration, why)``: the task's calibration object, or None and the reason (one
      line, for messages).

    Raises:
      ValueError: ``evaluation.json``'s calibration section is corrupt.

    Example:
      >>> from meshensemble.training.restore import load_run_config
      >>> ident = run_identity("runs/mnist", me.TrainConfig(), 938)
      >>> cal, why = read_calibration("runs/mnist", me.tasks.Classification(), 938, ident)
      >>> cal is None
      True
      >>> print(why)
      run runs/mnist is not calibrated (no evaluation.json); run `meshensemble evaluate
      --workdir runs/mnist --calibrate` first
    """
    path = storage.join(workdir, EVALUATION_FILE)
    fix = f"run `meshensemble evaluate --workdir {workdir} --calibrate` first"
    if not storage.isfile(path):
        return None, f"run {workdir} is not calibrated (no {EVALUATION_FILE}); {fix}"
    try:
        section = storage.read_json(path).get("calibration")
        if section is None:
            return None, f"run {workdir} is not calibrated ({path} has none); {fix}"
        fitted = section.get("fitted_for")
        stale = None
        if not isinstance(fitted, dict):
            stale = f"the calibration in {path} names no run (an older version wrote it)"
        elif fitted.get("step") != step:
            why = f"the calibration in {path} is of checkpoint {fitted.get('step')}, not {step}"
            return None, f"{why}; {fix} again (with --checkpoint {step})"
        elif other := [k for k in ("data", "seed", "checkpoint") if fitted[k] != identity[k]]:
            stale = (
                f"the calibration in {path} was fitted for another run (its {', '.join(other)} "
                "differ from this checkpoint's: trained again since)"
            )
        if stale is not None:
            if note is not None:
                note(f"note: {stale}: not applied")
            return None, f"{stale}; {fix} again"
        return task.read_calibration(section), ""
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        msg = " ".join(str(err).split())
        raise ValueError(
            f"{path}: corrupt calibration ({type(err).__name__}: {msg}); {fix}"
        ) from None


class Predictor:
    """A restored ensemble with its calibration; every method streams through the mesh.

    Build one with :func:`load_predictor`. Inputs have the run's shape and dtype: uint8
    images ``[N, H, W, C]`` (or ``[N, H, W]`` for one channel), float features ``[N, F]``
    (cast to the run's dtype a batch at a time); a numpy array, a memory map, or
    :class:`~meshensemble.serving.inputs.Images`. What comes out is the task's.

    Attributes:
      ensemble: the :class:`meshensemble.Ensemble` (on the predictor's mesh); task: its task.
      state: the restored state.
      step: the checkpoint's step.
      workdir: the run's folder.
      calibration: the task's calibration object for this checkpoint, or None.
      uncalibrated_reason: why ``calibration`` is None ("" otherwise).
      input_shape, input_dtype: one input's shape and dtype (also ``image_shape``,
        ``image_dtype``); input_record: them and the features' statistics (what
        ``config.json`` records of the run's input).
      num_classes: the model's output width (the classes of a classification run).
      num_members: the members.
      data_identity: the run's data as ``config.json`` records it (``{}`` if absent).
      model: the run's model name.
      batch_size: examples per compiled call.
    """

    def __init__(
        self,
        ensemble: Any,
        state: Any,
        *,
        step: int,
        workdir: str,
        calibration: Any = None,
        uncalibrated_reason: str = "",
        num_classes: int | None = None,
        data_identity: Mapping[str, Any] | None = None,
        model: str = "",
        batch_size: int = 1000,
        sample: Any = None,
        input_stats: Any = None,
    ) -> None:
        """Use :func:`load_predictor`; the arguments are its attributes (``sample``: one
        input row, default an MNIST image; ``input_stats``: the features' statistics)."""
        self.ensemble, self.state, self.step, self.workdir = ensemble, state, step, workdir
        self.task = ensemble.task
        self.calibration, self.uncalibrated_reason = calibration, uncalibrated_reason
        sample = np.zeros((1, *IMAGE_SHAPE), np.uint8) if sample is None else np.asarray(sample)
        self.input_shape, self.input_dtype = tuple(sample.shape[1:]), np.dtype(sample.dtype)
        self.image_shape, self.image_dtype = self.input_shape, self.input_dtype
        self.input_record = {"shape": list(self.input_shape), "dtype": str(self.input_dtype),
                             "stats": input_stats}  # fmt: skip
        self.num_classes = num_classes or ensemble.num_classes(state, sample)
        self.num_members = int(ensemble.num_members)
        self.data_identity, self.model = dict(data_identity or {}), model
        streaming.batch_size_for(batch_size, 1, 1)  # a positive integer, or one line
        self.batch_size = int(batch_size)

    @property
    def temperature(self) -> float | None:
        """The calibrated temperature (classification), or None."""
        return getattr(self.calibration, "temperature", None)

    @property
    def variance_scale(self) -> float | None:
        """The calibrated variance scale (regression), or None."""
        return getattr(self.calibration, "variance_scale", None)

    def check_sets(self) -> Any:
        """The calibration conformal outputs need; raises for an uncalibrated run.

        Raises:
          ValueError: one line saying why there is no calibration and how to get one.
        """
        if self.calibration is None:
            raise ValueError(f"no {self.task.conformal_name}: {self.uncalibrated_reason}")
        return self.calibration

    def outputs(
        self,
        x: Any,
        *,
        members: bool = False,
        calibrated: bool = True,
        sets: bool | None = None,
        progress: Callable[[int], Any] | None = None,
        **aliases: bool | None,
    ) -> dict[str, np.ndarray]:
        """Every per-example output in one streamed pass (what ``meshensemble predict`` writes).

        Args:
          x: ``[N, ...]`` inputs (see the class).
          members: also return each member's outputs (e.g. ``member_probs``).
          calibrated: apply the calibration's scale (temperature, variance scale) when
            calibrated; ``temperature=`` / ``scale=`` are its old names.
          sets: add the conformal outputs (``prediction_set``, ``lower``/``upper``); None:
            when the run is calibrated; True raises for an uncalibrated run (``intervals=``
            is its old name). They always use the calibrated scale.
          progress: called with the examples done after each batch.

        Returns:
          numpy arrays, the task's :meth:`~meshensemble.tasks.Task.finish` in order, the
          members' last (classification: ``probs``, ``label``, ``confidence``, ``entropy``,
          ``mutual_information``, ``prediction_set``, ``member_probs``; regression:
          ``mean``, ``variance``, ``aleatoric``, ``epistemic``, ``lower``, ``upper``,
          ``member_mean``, ``member_variance``).

        Raises:
          ValueError: inputs of another shape or dtype, none, conformal outputs of an
            uncalibrated run, or an unknown keyword.

        Example:
          >>> out = predictor.outputs(images, members=True)
          >>> out["probs"].shape, out["member_probs"].shape
          ((32, 10), (2, 32, 10))
          >>> sorted(out)
          ['confidence', 'entropy', 'label', 'member_probs', 'mutual_information', 'probs']
        """
        calibrated, sets = self._options(calibrated, sets, aliases)
        members = bool(members)
        x = as_inputs(x, self.input_shape, self.input_dtype)
        cal = self.check_sets() if sets else (self.calibration if sets is None else None)
        program, state, ens, task = self._program(members), self.state, self.ensemble, self.task
        n, result = len(x), {}

        def sink(start: int, out: dict[str, Any]) -> None:
            out = task.finish({**out["x"], **out["m"]}, self.calibration, calibrated, bool(cal))
            for key, v in out.items():
                axis = 1 if key.startswith("member_") else 0
                if key not in result:
                    shape = list(v.shape)
                    shape[axis] = n
                    result[key] = np.empty(shape, v.dtype)
                result[key][(slice(None),) * axis + (slice(start, start + v.shape[axis]),)] = v

        def run(xb: np.ndarray, mask: np.ndarray) -> dict[str, Any]:
            per_example, per_member = program(state, ens.place(xb))
            return {"x": per_example, "m": per_member}  # per member: examples on axis 1

        floats = np.issubdtype(self.input_dtype, np.floating)
        streaming.stream(
            run, x, self.batch_size, ens.data_size, sink, progress=progress, axes={"m": 1},
            prepare=(lambda rows: np.asarray(rows, self.input_dtype)) if floats else None,
        )  # fmt: skip
        return {k: result[k] for k in sorted(result, key=lambda k: k.startswith("member_"))}

    def _offers(self, which: str) -> None:
        """Raises the task's one line when it has no such conformal output."""
        if self.task.conformal_view != which:
            self.task.view({}, which)

    def _options(self, calibrated: bool, sets: bool | None, aliases: Mapping) -> tuple:
        unknown = set(aliases) - {"temperature", "scale", "intervals"}
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)}; use calibrated= or sets=")
        for old in ("temperature", "scale"):
            calibrated = calibrated if aliases.get(old) is None else bool(aliases[old])
        return calibrated, sets if aliases.get("intervals") is None else aliases["intervals"]

    def _program(self, members: bool) -> Callable[..., Any]:
        return self.ensemble.build(
            ("serve", members),
            lambda cfg: functools.partial(steps.served, cfg, members),
            (self.ensemble.state_spec, BATCH),
            (BATCH, MEMBER_BATCH),
        )

    def predict(self, x: Any, calibrated: bool = True, **aliases: bool) -> Any:
        """The ensemble's prediction, calibrated when the run is (and ``calibrated``).

        Classification: probabilities ``[N, classes]``, ``Ensemble.predict(state, x,
        temperature=T)``; regression: the mixture's ``mean``, ``variance``,
        ``aleatoric``, ``epistemic`` ``[N, T]`` (variances scaled). ``temperature=`` /
        ``scale=`` are ``calibrated``'s old names.

        Raises:
          ValueError: inputs of another shape or dtype, or none.

        Example:
          >>> predictor.predict(images).argmax(-1).shape   # the classes, [N]
          (32,)
        """
        out = self.outputs(x, calibrated=calibrated, sets=False, **aliases)
        return self.task.view(out, "predict")

    def predict_members(self, x: Any) -> Any:
        """Every member's prediction (never calibrated): e.g. softmax ``[members, N, classes]``.

        Example:
          >>> predictor.predict_members(images).shape  # (members, N, 10)
          (2, 32, 10)
        """
        return self.task.view(self.outputs(x, members=True, sets=False), "members")

    def uncertainty(self, x: Any) -> dict[str, np.ndarray]:
        """Per-example uncertainty (classification: ``label``, ``confidence``, ``entropy``,
        ``mutual_information``; regression: the variance and its two parts).

        Example:
          >>> predictor.uncertainty(images)["mutual_information"].shape  # (N,)
          (32,)
        """
        return self.task.view(self.outputs(x, sets=False), "uncertainty")

    def prediction_sets(self, x: Any) -> np.ndarray:
        """Conformal prediction sets at the run's alpha: bool ``[N, classes]``.

        Raises:
          ValueError: the run is not calibrated (run ``meshensemble evaluate --calibrate``),
            its task has no sets, or bad inputs.

        Example:
          >>> from meshensemble.tasks.classification import Calibration
          >>> cal = Calibration(temperature=1.0, threshold=0.9, method="thr", alpha=0.1, step=20)
          >>> calibrated = me.Predictor(ens, state, step=20, workdir="run", calibration=cal,
          ...                           num_classes=10)
          >>> calibrated.prediction_sets(images).sum(-1).shape  # set sizes, [N]
          (32,)
        """
        self._offers("sets")
        return self.task.view(self.outputs(x, sets=True), "sets")

    def intervals(self, x: Any) -> tuple[np.ndarray, np.ndarray]:
        """Conformal intervals ``(lower, upper)`` ``[N, T]`` at a regression run's alpha.

        Raises:
          ValueError: the run is not calibrated, or its task has no intervals.

        Example:
          >>> lower, upper = me.load_predictor("runs/toy").intervals(np.zeros((5, 1), np.float32))
          >>> lower.shape, bool((lower < upper).all())
          ((5, 1), True)
        """
        self._offers("intervals")
        return self.task.view(self.outputs(x, sets=True), "intervals")


def load_predictor(
    workdir: str,
    mesh: Any = None,
    *,
    checkpoint: int | None = None,
    batch_size: int = 1000,
    echo: Callable[[str], Any] | None = None,
) -> Predictor:
    """Loads a trained run for prediction on any mesh (nothing in the workdir changes).

    Args:
      workdir: the run's folder (``config.json``, ``checkpoints/``).
      mesh: a ``Mesh``, ``"ensemble=E,data=D"``, a dict of axis sizes, or None for every
        device (``ensemble = gcd(members, devices)``).
      checkpoint: the step to restore; default the newest good one.
      batch_size: examples per compiled call.
      echo: where notes go (a damaged checkpoint skipped, a calibration not applied
        because it was fitted for another run); default logging.

    Returns:
      A :class:`Predictor` of the run's task.

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
    streaming.batch_size_for(batch_size, 1, 1)
    say = echo or log.warning
    run = restore_run(workdir, mesh, checkpoint, echo=say)
    identity = run_identity(workdir, run.cfg, run.step)
    cal, why = read_calibration(workdir, run.task, run.step, identity, note=say)
    model = run.resolved.get("model") or model_name(run.cfg, run.sample)
    return Predictor(
        run.ensemble, run.state, step=run.step, workdir=workdir, calibration=cal,
        uncalibrated_reason=why, data_identity=run.identity, model=model,
        batch_size=batch_size, sample=run.sample, input_stats=run.input_stats,
    )  # fmt: skip
