"""Evaluating a trained run: its task's test scores, what the task adds, and calibration.

:func:`evaluate_run` (``meshensemble evaluate``) is one path for every task. It reloads a
run from its workdir on any mesh (:func:`meshensemble.training.restore.restore_run`),
loads and checks the run's own data (every split's fingerprint), and asks the run's task
(:class:`meshensemble.tasks.Task`): the test scores (``Ensemble.evaluate``, recorded as
the task names them), what the task adds (classification: OOD detection and the
reliability diagram; regression: nothing), and with ``calibrate`` its calibrator, fitted
on the run's validation split and saved for exactly this run and checkpoint (its
``fitted_for``: the run identity of :func:`meshensemble.training.restore.run_identity`).
Process 0 writes ``evaluation.json`` and the task's figures; a summary goes to ``echo``.

Example:
  >>> r = evaluate_run("runs/tiny", mesh="ensemble=4,data=1", ood=["noise"], echo=print)
  data: MNIST from ...mnist.npz ...
  checkpoint 4 of runs/tiny on mesh ensemble=4 x data=1: 32 test examples
  ...
  >>> r["checkpoint_step"], r["num_test"], r["ood_sets"]
  (4, 32, ['noise'])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from meshensemble import data as data_lib
from meshensemble.calibration.run import check_split
from meshensemble.data.split import split_validation
from meshensemble.runtime import storage
from meshensemble.training.identity import check_run_data, load_run_data, read_saved_config
from meshensemble.training.outputs import EVALUATION_FILE, check_writable, write_evaluation
from meshensemble.training.restore import (
    check_checkpoint,
    load_run_config,
    restore_run,
    run_identity,
    run_task,
)
from meshensemble.training.rundata import load_config_data

__all__ = ["EVALUATION_FILE", "check_calibrate", "evaluate_run", "load_run_config"]


def check_calibrate(
    workdir: str, cfg: Any, task: Any, alpha: Any, method: str, note: Callable[[str], Any]
) -> None:
    """One-line refusals of ``--calibrate`` before any work, from the run's ``config.json``.

    The run must have held a validation split out (the test set is never used for
    fitting), recorded it (runs of older versions drew theirs otherwise), and the task
    must accept the options for its size (:meth:`meshensemble.tasks.Task.check_calibration`).

    Raises:
      ValueError: one line naming the problem and the fix.

    Example:
      >>> cfg = load_run_config("runs/tiny")
      >>> check_calibrate("runs/tiny", cfg, me.tasks.Classification(), 0.1, "thr", print)
      note: 32 validation examples are few for alpha=0.1: ...
      note: 32 validation examples are few for a temperature ...
    """
    if not cfg.validation:
        raise ValueError(
            f"run {workdir} has no validation split to calibrate on (the test set is never "
            "used for fitting); train with --validation N first (e.g. --validation 500)"
        )
    resolved = (read_saved_config(workdir) or {}).get("resolved") or {}
    held = resolved.get("validation")
    if not isinstance(held, dict):
        raise ValueError(
            f"run {workdir} records no validation split (an older version drew it another "
            "way): evaluate it without --calibrate, or train it again"
        )
    count = int(held.get("count", cfg.validation))  # a share: the count it came to
    task.check_calibration(count, alpha, method, lambda m: note(f"note: {m}"))


def previous_calibration(
    workdir: str, identity: Mapping[str, Any], say: Callable[[str], Any]
) -> dict[str, Any] | None:
    """The ``calibration`` of the run's ``evaluation.json`` when it was fitted for this run.

    A plain ``evaluate`` (no ``--calibrate``) rewrites ``evaluation.json``; it carries the
    calibration an earlier ``evaluate --calibrate`` fitted for the same run and checkpoint
    (its ``fitted_for`` equals ``identity``) over, so ``predict`` and ``export`` keep
    applying it. Another checkpoint's or another run's is dropped, with a note.

    Returns:
      The kept ``calibration`` dict, or None.

    Example:
      >>> ident = run_identity("runs/toy", load_run_config("runs/toy"), 2)
      >>> previous_calibration("runs/toy", ident, print)  # after evaluate --calibrate of step 2
      kept the calibration of checkpoint 2 from evaluation.json (evaluate --calibrate refits it)
      {...}
    """
    try:
        cal = storage.read_json(storage.join(workdir, EVALUATION_FILE)).get("calibration")
    except (OSError, ValueError, AttributeError):
        return None  # none yet, or unreadable: nothing to carry over
    if not isinstance(cal, dict):
        return None
    fitted, step = cal.get("fitted_for"), identity["step"]
    why = None
    if not isinstance(fitted, dict):
        fitted, why = {}, "it names no run (an older version wrote it)"
    elif fitted.get("step") != step:
        why = f"it is not of checkpoint {step}"
    elif fitted != dict(identity):
        why = "it was fitted for another run (trained again since)"
    if why is not None:
        which = f" of checkpoint {fitted['step']}" if "step" in fitted else ""
        say(
            f"note: dropped the calibration{which} from {EVALUATION_FILE}: {why}; evaluate "
            "--calibrate fits one"
        )
        return None
    say(
        f"kept the calibration of checkpoint {step} from {EVALUATION_FILE} "
        "(evaluate --calibrate refits it)"
    )
    return cal


def _check_arguments(batch_size: Any, num_bins: Any, checkpoint: Any) -> None:
    for name, value in (("batch_size", batch_size), ("num_bins", num_bins)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if checkpoint is not None and (not isinstance(checkpoint, int) or checkpoint < 0):
        raise ValueError(f"checkpoint={checkpoint!r} must be a step number (>= 0)")


def evaluate_run(
    workdir: str,
    checkpoint: int | None = None,
    ood: Sequence[str] | None = None,
    mesh: str | Mapping[str, int] | Mesh | None = None,
    batch_size: int = 1000,
    num_bins: int = 15,
    source: str | None = None,
    data_file: str | None = None,
    *,
    ood_file: str | None = None,
    echo: Callable[[str], Any] | None = None,
    calibrate: bool = False,
    alpha: float = 0.1,
    conformal: str = "thr",
    data_dir: str | None = None,
    dataset: data_lib.Dataset | None = None,
) -> dict[str, Any]:
    """Evaluates a trained run, whatever its task; writes ``evaluation.json`` and figures.

    Args:
      workdir: the run's folder (``config.json`` and ``checkpoints/``).
      checkpoint: the step to restore; default the newest good one.
      ood: OOD sets of the task (classification: a shift of the test inputs, ``noise``,
        ``inverted``, ``contrast``, ``hflip``, ``vflip``; ``fashion_mnist``; or another
        dataset of the same input shape by TFDS name or path); None: the task's defaults
        (classification: noise and inverted; regression: none); a task without OOD sets
        refuses any.
      mesh: ``"ensemble=E,data=D"``, a dict of axis sizes or a ``Mesh``; default all
        devices with ``ensemble = gcd(members, devices)`` (it may differ from training).
      batch_size: examples per compiled call.
      num_bins: equal-width confidence bins (classification's ECE and reliability).
      source, data_file, data_dir: override the run's recorded data (its identity is
        checked); dataset: the data, for a run trained on a Python ``dataset=`` object.
      ood_file: a Keras-layout Fashion-MNIST npz for the ``fashion_mnist`` OOD set.
      echo: where the summary lines go (default ``print``).
      calibrate: fit the task's calibrator on the run's validation split (classification:
        a temperature and a conformal threshold; regression: a variance scale and a
        conformal interval quantile); saved with the run identity it was fitted for.
      alpha: the conformal miscoverage rate in ``(0, 1)``.
      conformal: the conformal score (classification's sets).

    Every split's fingerprint is compared with the run's ``resolved.data_identity``
    before any checkpoint is read; a difference is refused with one line naming the
    split. The run's checkpoints are only read: a damaged one is reported and skipped,
    never moved, and a line says which step was evaluated and why when it is not the
    newest.

    Returns:
      A flat dict: the task's test scores (``test_*``), what it adds (``ood_*``...),
      ``task``, ``checkpoint_step``, ``num_test`` and, calibrated, ``calibration``.

    Raises:
      FileNotFoundError: ``workdir``, its ``config.json`` or the checkpoint is missing.
      meshensemble.training.CheckpointError: ``checkpoint`` does not verify, or no
        checkpoint does.
      ValueError: a corrupt ``config.json``, a workdir that is not writable, an OOD set
        the task has not, a bad mesh, batch size or bin count; ``calibrate`` without a
        validation split, or with options the task refuses.
      meshensemble.training.OutputError: ``evaluation.json`` or a figure could not be written.
      meshensemble.data.DataError: the data cannot be loaded, or is not the run's.

    Example:
      >>> result = evaluate_run("runs/toy", calibrate=True, alpha=0.1, echo=lambda s: None)
      >>> result["task"], result["calibration"]["conformal"]["alpha"]
      ('regression', 0.1)
    """
    say = print if echo is None else echo
    cfg = load_run_config(workdir)
    _check_arguments(batch_size, num_bins, checkpoint)
    resolved = (read_saved_config(workdir) or {}).get("resolved") or {}
    task = run_task(cfg, resolved)
    ood = task.check_ood(task.default_ood if ood is None else ood, cfg.dataset, ood_file)
    if jax.process_index() == 0:  # process 0 writes the results there
        check_writable(
            workdir,
            f"{EVALUATION_FILE} and the figures go there: make it writable, or copy the run to "
            "a writable folder and evaluate the copy",
        )
    if calibrate:
        check_calibrate(workdir, cfg, task, alpha, conformal, say)
    elif conformal != "thr":
        raise ValueError(
            f"--conformal {conformal} chooses the sets --calibrate fits; add --calibrate, or "
            "drop --conformal"
        )
    check_checkpoint(workdir, checkpoint)  # before loading data: a listing, nothing opened
    recorded = dataset is None and (source, data_file, data_dir) == (None, None, None)
    if dataset is None:
        load = lambda src, f, d, t: load_config_data(
            cfg, task, source=src, data_file=f, data_dir=d, test_file=t, log=say
        )
        dataset = load_run_data(workdir, cfg, source=source, data_file=data_file,
                                data_dir=data_dir, log=say, loader=load)  # fmt: skip
    check_run_data(workdir, cfg, dataset, say, recorded)  # the run's data, split by split
    count = cfg.validation_count(dataset.num_train)
    split = split_validation(dataset, count, cfg.seed) if calibrate else None
    if calibrate:
        check_split(workdir, split)
    run = restore_run(workdir, mesh, checkpoint, echo=say, what="evaluating")
    ens, state, step = run.ensemble, run.state, run.step
    x, y = dataset.x_test, dataset.y_test
    result = run.task.record_scores(ens.evaluate(state, x, y, batch_size, num_bins), "test")
    options = dict(batch_size=batch_size, num_bins=num_bins, ood_file=ood_file,
                   data_dir=data_dir or cfg.data_dir, say=say)  # fmt: skip
    more, figures = run.task.evaluate_more(ens, state, dataset, ood, result=result, **options)
    result.update(more)
    result.update(task=run.task.name, checkpoint_step=step, num_test=dataset.num_test)
    identity = run_identity(workdir, cfg, step)
    if calibrate:
        section, drawn = run.task.calibrate(
            ens, state, (split.x, split.y), (x, y), alpha=alpha, method=conformal,
            batch_size=batch_size, num_bins=num_bins,
        )  # fmt: skip
        result["calibration"] = {**section, "fitted_for": identity}
        figures.update(drawn)
    elif (kept := previous_calibration(workdir, identity, say)) is not None:
        result["calibration"] = kept
    if jax.process_index() == 0:
        write_evaluation(workdir, result, figures)
    _report(say, workdir, result, run, sorted(figures), calibrate)
    return result


def _report(
    say: Callable[[str], Any], workdir: str, result: dict, run: Any, files: list, calibrated: bool
) -> None:
    """Prints what was evaluated, the task's report and (process 0) the files written."""
    ens = run.ensemble
    say(
        f"checkpoint {run.step} of {workdir} on mesh ensemble={ens.mesh.shape['ensemble']} x "
        f"data={ens.data_size}: {result['num_test']} test examples"
    )
    say(run.task.report(result))
    if calibrated:
        say(run.task.calibration_line(result["calibration"]))
    if jax.process_index() == 0:
        files = [EVALUATION_FILE, *files]
        listed = f"{', '.join(files[:-1])} and {files[-1]}" if len(files) > 1 else files[0]
        say(f"wrote {listed} to {workdir}")
