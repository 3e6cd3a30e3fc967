"""Evaluating a trained regression run: proper scores and calibrated intervals.

``meshensemble evaluate`` on a run of ``meshensemble train --task regression``
(:func:`meshensemble.evaluation.evaluate_run` hands it here):

* :func:`restore_regression` rebuilds the run's ensemble (the standardiser recorded under
  ``resolved.standardizer``) on any mesh and restores a checkpoint read-only;
* :func:`load_regression_data` loads the run's recorded data (``source`` ``npz`` /
  ``toy1d`` / ``diabetes``) and compares every split with ``resolved.data_identity``;
* :func:`evaluate_regression` scores the test split with :meth:`meshensemble.Ensemble.evaluate`
  (``nll``, ``rmse``, ``mae``, ``crps``, ``coverage``/``width`` at 50/90/95%, the quantile
  calibration error) in the data's units and, with ``calibrate``, fits a variance scale
  and a normalised conformal quantile on the validation split
  (:func:`calibrate_regression`), stored in ``evaluation.json`` for ``predict``/``export``.

Example:
  >>> result = me.evaluation.evaluate_run("runs/toy", calibrate=True, alpha=0.1)
  checkpoint 2 of runs/toy on mesh ensemble=4 x data=2: 200 test examples
  test nll ..., rmse ..., mae ..., crps ..., quantile calibration error ...
  intervals: 50% coverage ... width ..., 90% coverage ... width ..., 95% coverage ... width ...
  calibrated on 10 validation scores: variance scale ..., conformal q ...; 90% coverage/width ...
  wrote evaluation.json to runs/toy
  >>> result["test_crps"] > 0, result["calibration"]["conformal"]["alpha"]
  (True, 0.1)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from meshensemble import calibration
from meshensemble import data as data_lib
from meshensemble.calibration._checks import conformal_rank, smallest_alpha
from meshensemble.core.mesh import make_mesh, parse_mesh
from meshensemble.runtime.distributed import fetch
from meshensemble.training.checkpoint import CHECKPOINT_DIR, list_checkpoints, restore_checkpoint
from meshensemble.training.config import TrainConfig, default_mesh_shape
from meshensemble.training.identity import other_data_fix, read_saved_config
from meshensemble.training.outputs import check_writable, dumps_strict, replacing, writing
from meshensemble.training.regression_run import (
    build_regression_ensemble,
    load_regression,
    regression_identity,
    split_validation,
)

EVALUATION_FILE = "evaluation.json"
"""The file ``meshensemble evaluate`` writes into a run's folder (either task)."""


def previous_calibration(
    workdir: str, step: int, say: Callable[[str], Any]
) -> dict[str, Any] | None:
    """The ``calibration`` of the run's ``evaluation.json`` when it is of checkpoint ``step``.

    A plain ``evaluate`` (no ``--calibrate``) rewrites ``evaluation.json``; it carries the
    calibration an earlier ``evaluate --calibrate`` fitted for the same checkpoint over,
    so ``predict`` and ``export`` keep applying it. One of another checkpoint is dropped,
    with a note (it does not belong to these scores).

    Args:
      workdir: the run's folder; step: the checkpoint just evaluated.
      say: where the one-line note goes.

    Returns:
      The kept ``calibration`` dict, or None.

    Example:
      >>> previous_calibration("runs/toy", 2, print)  # after evaluate --calibrate of step 2
      kept the calibration of checkpoint 2 from evaluation.json (evaluate --calibrate refits it)
      {...}
    """
    try:
        with open(os.path.join(workdir, EVALUATION_FILE)) as f:
            old = json.load(f)
        cal, old_step = old.get("calibration"), old.get("checkpoint_step")
    except (OSError, ValueError, AttributeError):
        return None  # none yet, or unreadable: nothing to carry over
    if not isinstance(cal, dict):
        return None
    if old_step != step:
        say(
            f"note: dropped the calibration of checkpoint {old_step} from {EVALUATION_FILE}: "
            f"it is not of checkpoint {step}; evaluate --calibrate fits one"
        )
        return None
    say(
        f"kept the calibration of checkpoint {step} from {EVALUATION_FILE} "
        "(evaluate --calibrate refits it)"
    )
    return cal


@dataclasses.dataclass(frozen=True)
class RestoredRegression:
    """A regression run restored for evaluation or prediction.

    Attributes:
      ensemble: the :class:`meshensemble.Ensemble` (a regression task, on the chosen mesh).
      state: the restored state.
      step: the checkpoint's step.
      standardizer: ``{"x_mean", "x_std", "y_mean", "y_std"}`` (lists) of the training split.
      features: ``F``; targets: ``T``.
      identity: the run's recorded ``resolved.data_identity`` (``{}`` if absent).
    """

    ensemble: Any
    state: Any
    step: int
    standardizer: dict[str, list[float]]
    features: int
    targets: int
    identity: dict[str, Any]


def run_mesh(mesh: Any, members: int) -> Mesh:
    """A ``Mesh``, ``"ensemble=E,data=D"``, a dict or None (every device) as a ``Mesh``."""
    if isinstance(mesh, Mesh):
        return mesh
    if mesh is None or mesh == "":
        shape = default_mesh_shape(members, jax.device_count())
    else:
        shape = parse_mesh(mesh) if isinstance(mesh, str) else {k: int(v) for k, v in mesh.items()}
    return make_mesh(shape.get("ensemble"), shape.get("data", 1), shape.get("model"))


def _resolved(workdir: str) -> dict[str, Any]:
    resolved = (read_saved_config(workdir) or {}).get("resolved") or {}
    stats = resolved.get("standardizer")
    if not isinstance(stats, dict) or not {"x_mean", "y_mean", "x_std", "y_std"} <= set(stats):
        raise ValueError(
            f"{workdir}/config.json records no resolved.standardizer; it is not a finished "
            "regression run (train it with `meshensemble train --task regression`)"
        )
    return resolved


def check_checkpoint(workdir: str, step: int | None) -> None:
    """Fails before any work when the run has no checkpoint, or not ``step`` (a run of
    either task: classification's ``evaluate_run`` calls it too).

    Raises:
      FileNotFoundError: one line listing the available steps.
    """
    steps = list_checkpoints(workdir)
    folder = os.path.join(workdir, CHECKPOINT_DIR)
    if not steps:
        raise FileNotFoundError(
            f"no checkpoint in {folder}; train the run with checkpoints (without "
            "--no-checkpoint) first"
        )
    if step is not None and step not in steps:
        raise FileNotFoundError(
            f"no checkpoint {step} in {folder}; available steps: "
            f"{', '.join(map(str, sorted(steps)))}"
        )


def restore_regression(
    workdir: str,
    cfg: TrainConfig,
    mesh: Any = None,
    checkpoint: int | None = None,
    echo: Callable[[str], Any] | None = None,
) -> RestoredRegression:
    """Rebuilds a regression run's ensemble on ``mesh`` and restores a checkpoint read-only.

    Args:
      workdir: the run's folder; cfg: its config (``load_run_config``).
      mesh: a ``Mesh``, ``"ensemble=E,data=D"``, a dict, or None for every device.
      checkpoint: the step; default the newest good one (damaged ones are skipped, not moved).
      echo: gets a line per damaged checkpoint skipped.

    Returns:
      A :class:`RestoredRegression`.

    Raises:
      FileNotFoundError: no checkpoint (or not ``checkpoint``).
      ValueError: no recorded standardiser, or a bad mesh.
      meshensemble.CheckpointError: no readable checkpoint.

    Example:
      >>> from meshensemble.evaluation.run import load_run_config
      >>> run = restore_regression("runs/toy", load_run_config("runs/toy"))
      >>> x = np.linspace(-4, 4, 5, dtype=np.float32)[:, None]  # [N, features]
      >>> run.ensemble.predict(run.state, x)["mean"].shape  # [N, targets]
      (5, 1)
    """
    check_checkpoint(workdir, checkpoint)
    resolved = _resolved(workdir)
    stats = resolved["standardizer"]
    features, targets = len(stats["x_mean"]), len(stats["y_mean"])
    steps = int(resolved.get("steps_per_epoch") or 1)
    sample = np.zeros((1, features), np.float32)
    ens = build_regression_ensemble(cfg, run_mesh(mesh, cfg.members), stats, targets, steps, sample)
    state, _, step = restore_checkpoint(
        workdir, ens, sample, checkpoint, echo=echo, move_damaged=False
    )
    identity = resolved.get("data_identity") or {}
    return RestoredRegression(ens, state, int(step), stats, features, targets, dict(identity))


def load_regression_data(
    workdir: str, cfg: TrainConfig, say: Callable[[str], Any] = print, recorded: bool = False
) -> tuple[Any, Any, Any]:
    """The run's data, checked split by split against ``resolved.data_identity``.

    Args:
      workdir: the run's folder; cfg: its config (source, data file, seed, validation),
        possibly with ``source`` / ``data_file`` overridden.
      say: gets one line when the run recorded no identity (nothing could be checked).
      recorded: ``cfg``'s data is the run's recorded one (no override): a difference is
        then data changed since training, which the error says.

    Returns:
      ``(data, train, validation)``: the :class:`meshensemble.data.RegressionData`, its
      training rows after the split, and ``(x_val, y_val)`` or None.

    Raises:
      meshensemble.data.DataError: the data cannot be loaded, or a split differs from the
        run's (one line naming it).
    """
    data = load_regression(cfg)
    train, val = split_validation(data, cfg.validation, cfg.seed)
    held = (read_saved_config(workdir) or {}).get("resolved", {}).get("data_identity")
    if not isinstance(held, dict) or "splits" not in held:
        say(f"run {workdir} recorded no data identity: the data could not be checked")
        return data, train, val
    now = regression_identity(data, train, val, cfg)["splits"]
    differ = [s for s in ("train", "validation", "test") if held["splits"].get(s) != now.get(s)]
    if differ:
        raise data_lib.DataError(
            f"the {' and '.join(differ)} split(s) of this data ({data.name}) differ from run "
            f"{workdir}'s ({differ[0]}: {str(held['splits'].get(differ[0]))[:15]} recorded, "
            f"{str(now.get(differ[0]))[:15]} now); "
            + other_data_fix(recorded, "--source/--data-file")
        )
    return data, train, val


def check_calibrate(workdir: str, cfg: TrainConfig, alpha: Any) -> None:
    """Refuses ``--calibrate`` up front (from ``config.json``), in one line.

    Raises:
      ValueError: no validation split, ``alpha`` outside ``(0, 1)``, or ``alpha`` too
        small for the split (``ceil((n + 1)(1 - alpha)) > n`` scores, ``n`` = rows x targets).
    """
    if isinstance(alpha, bool) or not isinstance(alpha, int | float | np.floating):
        raise ValueError(f"--alpha {alpha!r} must be a number in (0, 1), e.g. 0.1")
    if not 0 < alpha < 1:
        raise ValueError(f"--alpha {alpha!r} must be in (0, 1), e.g. 0.1 for 90% intervals")
    if not cfg.validation:
        raise ValueError(
            f"run {workdir} has no validation split to calibrate on; train it with "
            "--validation N (e.g. --validation 100)"
        )
    n = cfg.validation * len(_resolved(workdir)["standardizer"]["y_mean"])
    if conformal_rank(n, float(alpha)) > n:
        raise ValueError(
            f"--alpha {alpha:g} is too small for the run's {n} validation scores (the conformal "
            f"quantile would be infinite); use --alpha >= {smallest_alpha(n)} or train with a "
            "larger --validation"
        )


def _intervals(mean: Any, sd: Any, y: Any, k: float) -> dict[str, float]:
    inside = np.abs(np.asarray(y) - mean) <= k * sd
    return {"coverage": float(np.mean(inside)), "width": float(np.mean(2 * k * sd))}


def _gaussian_nll(mean: Any, var: Any, y: Any) -> float:
    return float(np.mean(0.5 * (np.log(2 * np.pi * var) + (y - mean) ** 2 / var)))


def calibrate_regression(
    ens: Any, state: Any, val: tuple[Any, Any], test: tuple[Any, Any], alpha: float
) -> dict[str, Any]:
    """Fits the variance scale and the conformal quantile on ``val``; scores them on ``test``.

    The scale ``s`` is :func:`meshensemble.calibration.fit_variance_scale` of the mixture's
    mean and variance; ``q`` is :func:`meshensemble.calibration.conformal_interval_quantile`
    of the residuals normalised by the scaled standard deviation ``sqrt(s * variance)``, so
    the calibrated interval is ``mean +/- q * sqrt(s * variance)``.

    Args:
      ens: the regression ensemble; state: its state.
      val: ``(x_val, y_val)``; test: ``(x_test, y_test)`` (targets ``[N, T]``).
      alpha: the miscoverage.

    Returns:
      ``{"variance_scale": s, "conformal": {"quantile": q, "alpha", "num_calibration"},
      "test": {...}}``; ``test`` holds the Gaussian NLL (moment-matched) before/after the
      scale and ``coverage``/``width`` of ``mean +/- z sd`` (``z`` the normal
      ``1 - alpha/2`` quantile) before and after the scale, and of the conformal interval.
    """
    moments = lambda x: fetch(ens.predict(state, x))
    v = moments(val[0])
    y_val = np.asarray(val[1], np.float32).reshape(v["mean"].shape)
    s = calibration.fit_variance_scale(v["mean"], v["variance"], y_val)
    q = calibration.conformal_interval_quantile(v["mean"], np.sqrt(s * v["variance"]), y_val, alpha)
    t = moments(test[0])
    y = np.asarray(test[1], np.float32).reshape(t["mean"].shape)
    sd = np.sqrt(t["variance"])
    z = statistics.NormalDist().inv_cdf(1 - alpha / 2)
    scores = {
        "nll_gaussian_before": _gaussian_nll(t["mean"], t["variance"], y),
        "nll_gaussian_after": _gaussian_nll(t["mean"], s * t["variance"], y),
    }
    kinds = {
        "before": (sd, z),
        "scaled": (sd * math.sqrt(s), z),
        "conformal": (sd * math.sqrt(s), q),
    }
    for name, (spread, k) in kinds.items():
        for key, value in _intervals(t["mean"], spread, y, k).items():
            scores[f"{key}_{name}"] = value
    return {
        "variance_scale": s,
        "conformal": {"quantile": q, "alpha": float(alpha), "num_calibration": int(y_val.size)},
        "test": scores,
    }


def evaluate_regression(
    workdir: str,
    cfg: TrainConfig,
    *,
    checkpoint: int | None = None,
    mesh: Any = None,
    batch_size: int = 1000,
    source: str | None = None,
    data_file: str | None = None,
    echo: Callable[[str], Any] | None = None,
    calibrate: bool = False,
    alpha: float = 0.1,
) -> dict[str, Any]:
    """Scores a regression run's test split (and calibrates it); writes ``evaluation.json``.

    Called by :func:`meshensemble.evaluation.evaluate_run` for a run whose ``task`` is
    ``regression``. The run is only read; ``evaluation.json`` is replaced atomically.

    Args:
      workdir: the run's folder; cfg: its config.
      checkpoint: the step (default the newest good one).
      mesh: the mesh to evaluate on (any; see :func:`run_mesh`).
      batch_size: examples per compiled call.
      source, data_file: override the run's recorded data (its identity is checked).
      echo: where the summary goes (default ``print``).
      calibrate: fit the variance scale and conformal quantile on the validation split.
      alpha: the conformal miscoverage.

    Returns:
      ``test_{nll,rmse,mae,crps,coverage_50,...,width_95,quantile_calibration_error,...}``
      (:meth:`meshensemble.Ensemble.evaluate`'s keys, ``test_`` prefixed), ``task``,
      ``checkpoint_step``, ``num_test`` and, with ``calibrate``, ``calibration``
      (:func:`calibrate_regression`).

    Raises:
      FileNotFoundError: no checkpoint; ValueError: a read-only workdir, a bad batch size,
        ``calibrate`` without a validation split or with a bad ``alpha``;
      meshensemble.data.DataError: the data differs from the run's.

    Example:
      >>> from meshensemble.evaluation.run import load_run_config
      >>> result = evaluate_regression("runs/toy", load_run_config("runs/toy"), echo=print)
      kept the calibration of checkpoint 2 from evaluation.json (evaluate --calibrate refits it)
      checkpoint 2 of runs/toy on mesh ensemble=4 x data=2: 200 test examples
      test nll ..., rmse ..., mae ..., crps ..., quantile calibration error ...
      intervals: 50% coverage ... width ..., 90% coverage ... width ..., 95% coverage ... width ...
      calibrated on 10 validation scores: variance scale ..., conformal q ...; 90% ...
      wrote evaluation.json to runs/toy
      >>> result["task"], result["num_test"], result["test_rmse"] > 0
      ('regression', 200, True)
    """
    say = print if echo is None else echo
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
    if jax.process_index() == 0:
        check_writable(workdir, f"{EVALUATION_FILE} goes there: make it writable")
    if calibrate:
        check_calibrate(workdir, cfg, alpha)
    check_checkpoint(workdir, checkpoint)
    over = {k: v for k, v in (("source", source), ("data_file", data_file)) if v is not None}
    data, _, val = load_regression_data(
        workdir, dataclasses.replace(cfg, **over), say, recorded=not over
    )
    run = restore_regression(workdir, cfg, mesh, checkpoint, say)
    ens, state = run.ensemble, run.state
    ev = ens.evaluate(state, data.x_test, data.y_test, batch_size=batch_size)
    result: dict[str, Any] = {f"test_{k}": v for k, v in ev.items() if k != "count"}
    result.update(task="regression", checkpoint_step=run.step, num_test=len(data.x_test))
    if calibrate:
        result["calibration"] = calibrate_regression(
            ens, state, val, (data.x_test, data.y_test), alpha
        )
    elif (kept := previous_calibration(workdir, run.step, say)) is not None:
        result["calibration"] = kept
    if jax.process_index() == 0:
        path = os.path.join(workdir, EVALUATION_FILE)
        text = dumps_strict(result, indent=2)
        with writing(path), replacing(path) as f:
            f.write(text)
    say(
        f"checkpoint {run.step} of {workdir} on mesh ensemble={ens.mesh.shape['ensemble']} x "
        f"data={ens.data_size}: {len(data.x_test)} test examples"
    )
    say(summary_lines(result))
    if jax.process_index() == 0:
        say(f"wrote {EVALUATION_FILE} to {workdir}")
    return result


def summary_lines(result: dict[str, Any]) -> str:
    """The text summary of :func:`evaluate_regression`'s result (scores, then calibration).

    Example:
      >>> import json
      >>> print(summary_lines(json.load(open("runs/toy/evaluation.json"))))
      test nll ..., rmse ..., mae ..., crps ..., quantile calibration error ...
      intervals: 50% coverage ... width ..., 90% coverage ... width ..., 95% coverage ... width ...
      calibrated on 10 validation scores: variance scale ... (gaussian nll ... -> ...),
      conformal q ...; 90% coverage/width before .../..., scaled .../..., conformal .../...
    """
    r = result
    rows = [
        f"test nll {r['test_nll']:.4f}, rmse {r['test_rmse']:.4f}, mae {r['test_mae']:.4f}, "
        f"crps {r['test_crps']:.4f}, quantile calibration error "
        f"{r['test_quantile_calibration_error']:.4f}",
        "intervals: "
        + ", ".join(
            f"{c}% coverage {r[f'test_coverage_{c}']:.3f} width {r[f'test_width_{c}']:.4g}"
            for c in (50, 90, 95)
        ),
    ]
    cal = r.get("calibration")
    if cal:
        t, conf = cal["test"], cal["conformal"]
        level = round(100 * (1 - conf["alpha"]), 2)
        rows.append(
            f"calibrated on {conf['num_calibration']} validation scores: variance scale "
            f"{cal['variance_scale']:.4g} (gaussian nll {t['nll_gaussian_before']:.4f} -> "
            f"{t['nll_gaussian_after']:.4f}), conformal q {conf['quantile']:.4g}; {level:g}% "
            f"coverage/width before {t['coverage_before']:.3f}/{t['width_before']:.4g}, scaled "
            f"{t['coverage_scaled']:.3f}/{t['width_scaled']:.4g}, conformal "
            f"{t['coverage_conformal']:.3f}/{t['width_conformal']:.4g}"
        )
    return "\n".join(rows)
