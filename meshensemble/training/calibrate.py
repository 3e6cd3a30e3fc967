"""A finished run's own calibration: fitted on its validation split, saved as ``evaluate`` saves it.

A task whose :attr:`~meshensemble.tasks.Task.run_calibration` names options (regression:
a variance scale and 90% conformal intervals) is calibrated by the run itself when it
ends: :func:`calibrate_finished_run` asks the task's calibrator
(:meth:`~meshensemble.tasks.Task.calibrate`, the one ``evaluate --calibrate`` asks) to fit
on the run's validation split, and writes ``evaluation.json`` with the calibration bound
to the run and checkpoint it was fitted for (``fitted_for``: the run identity of
:func:`~meshensemble.training.restore.run_identity`: data, seed, step, checkpoint
digest), so ``predict``, ``me.load_predictor`` and ``export`` apply it. A run that cannot
be calibrated (no validation split, no checkpoint, a split too small for the options)
gets the task's line saying so and how to calibrate. A task without
``run_calibration`` (classification) is left as it was: nothing fitted, nothing said.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

from meshensemble.training.config import TrainConfig
from meshensemble.training.outputs import write_evaluation
from meshensemble.training.restore import run_identity

NUM_BINS = 15
"""The confidence bins a calibrator is given (``evaluate``'s default ``--num-bins``)."""


def calibrate_finished_run(
    cfg: TrainConfig,
    ens: Any,
    state: Any,
    step: int | None,
    data: Any,
    scores: Mapping[str, Any],
    say: Callable[[str], Any],
) -> str:
    """Fits the task's calibration of a finished run and saves it; the run's last line.

    Args:
      cfg: the run's config; ens, state: the trained ensemble at checkpoint ``step``
        (None: the run saved none).
      data: the run's :class:`~meshensemble.training.rundata.RunData` (its validation
        split and test split).
      scores: the last evaluation's record (its ``test_*`` scores go to ``evaluation.json``).
      say: where the calibrator's notes go.

    Returns:
      The line the run ends with: the calibration fitted (with ``evaluation.json``
      written by process 0), or why there is none and how to get one; ``""`` when the
      task fits none at the end.

    Raises:
      meshensemble.training.OutputError: ``evaluation.json`` could not be written.

    Example:
      >>> import types
      >>> cfg = me.TrainConfig(task="regression", workdir="runs/x")   # no --validation
      >>> run = types.SimpleNamespace(task=me.tasks.Regression())
      >>> calibrate_finished_run(cfg, run, None, None, types.SimpleNamespace(validation=None),
      ...                        {}, print)
      'note: intervals and variances uncalibrated, no validation split: train with
      --validation 0.2 (or N rows) in a new --workdir to calibrate at the end'
    """
    task = ens.task
    options = task.run_calibration
    if options is None:
        return ""
    why = _why_not(cfg, data, step, task, options, say)
    if why:
        return task.uncalibrated_line(cfg.workdir, why)
    test = data.dataset
    section, figures = task.calibrate(
        ens, state, data.validation, (test.x_test, test.y_test), **options,
        batch_size=cfg.eval_batch_size, num_bins=NUM_BINS,
    )  # fmt: skip
    result = {k: v for k, v in scores.items() if k.startswith("test_")}
    result.update(task=task.name, checkpoint_step=step, num_test=test.num_test)
    result["calibration"] = {**section, "fitted_for": run_identity(cfg.workdir, cfg, step)}
    if jax.process_index() == 0:
        write_evaluation(cfg.workdir, result, figures)
    return f"{task.calibration_line(section)}; predict and export apply it"


def _why_not(cfg: TrainConfig, data: Any, step: Any, task: Any, options: Mapping, say) -> str:
    """Why the run cannot be calibrated now, with the fix ("" when it can)."""
    if data.validation is None:
        return (
            "no validation split: train with --validation 0.2 (or N rows) in a new --workdir "
            "to calibrate at the end"
        )
    n = len(data.validation[1])
    alpha, method = options.get("alpha", 0.1), options.get("method", "thr")
    try:  # the split's size first: a run too small to calibrate says so, checkpoint or not
        task.check_calibration(n, alpha, method, lambda m: say(f"note: {m}"))
    except ValueError as err:
        return f"{err}; then: meshensemble evaluate --workdir {cfg.workdir} --calibrate --alpha A"
    if step is None:
        return "no checkpoint to apply a calibration to: train without --no-checkpoint"
    return ""
