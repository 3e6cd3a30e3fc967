"""``meshensemble train --task regression``: a Gaussian regression ensemble's run.

Setup, loop and outputs apart, as the classification run's are:

* :func:`load_regression` picks the data (``--source npz`` with ``--data-file``,
  ``toy1d`` or ``diabetes``; ``auto``: the file when given, else ``toy1d``);
* :func:`build_regression_ensemble` builds the members (the zoo's MLP with ``2T``
  outputs unless ``--model`` names another), standardised with the training split's
  statistics: features by an on-device ``input_transform``, targets by the task's
  ``target_shift`` / ``target_scale``, so every prediction and score is in the data's
  units; the statistics are recorded in ``config.json`` (``resolved.standardizer``);
* :func:`train_regression` runs epochs of host batches (a seeded order per epoch),
  evaluates the mixture (validation split and test set) every ``epochs // 20`` epochs
  (at least every epoch) and at the end into ``metrics.jsonl``, saves checkpoints there,
  resumes from the newest one, and draws ``regression.png`` for one-feature data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from meshensemble import data as data_lib
from meshensemble.core.ensemble import Ensemble
from meshensemble.core.mesh import make_mesh, parse_mesh
from meshensemble.core.tasks import task_class
from meshensemble.data.regression import RegressionData
from meshensemble.models import get_model
from meshensemble.runtime.distributed import fetch
from meshensemble.training.checkpoint import Checkpointer, list_checkpoints, restore_checkpoint
from meshensemble.training.config import (
    CONFIG_FILE,
    METRICS_FILE,
    PRECISIONS,
    TrainConfig,
    default_mesh_shape,
    make_optimizer,
)
from meshensemble.training.guards import NonFiniteError, StopSignal
from meshensemble.training.identity import check_same_run, read_saved_config, run_fields
from meshensemble.training.outputs import RunWriter, check_writable, clear_run, unfinished_run

PLOT_FILE = "regression.png"
"""The figure a run on one-feature data writes: mixture mean +/- 2 sd, members, data."""

REGRESSION_SOURCES = ("auto", "npz", "toy1d", "diabetes")
"""The ``--source`` values of a regression run."""

EVALUATIONS = 20
"""About how many evaluations (and checkpoints) a run makes: every ``epochs // 20`` epochs."""

RESOLVED_KEYS = (
    "mesh", "batch_size", "steps_per_epoch", "model", "standardizer", "data", "data_identity"
)  # fmt: skip
"""What a regression run records in ``config.json``'s ``resolved`` entry."""


@dataclasses.dataclass
class RegressionResult:
    """What :func:`train_regression` returns (the fields of :class:`meshensemble.TrainResult`).

    Attributes:
      ensemble: the trained :class:`meshensemble.Ensemble` (a regression task).
      state: the final state.
      history: the records written to ``metrics.jsonl``.
      dataset: the :class:`meshensemble.data.RegressionData` used.
      seconds: wall time of the run.
      preempted: the run stopped on SIGTERM/SIGINT after saving a checkpoint.
      compile: empty (compilations are not logged for regression runs yet).
      signal: what stopped it (``"SIGINT"``, ``"SIGTERM"``, ...) or None, as in
        :class:`meshensemble.TrainResult` (the command line exits 130 after a SIGINT).
    """

    ensemble: Ensemble
    state: Any
    history: list[dict[str, Any]]
    dataset: RegressionData
    seconds: float
    preempted: bool = False
    compile: dict[str, Any] = dataclasses.field(default_factory=dict)
    signal: str | None = None


def model_name(cfg: TrainConfig) -> str:
    """The member model of a regression run: ``mlp`` for ``cnn`` (the classification default)."""
    return "mlp" if cfg.model == "cnn" else cfg.model


def load_regression(cfg: TrainConfig) -> RegressionData:
    """The regression data ``cfg`` names.

    Raises:
      meshensemble.data.DataError: an unusable file, or ``npz`` without ``data_file``.

    Example:
      >>> load_regression(me.TrainConfig(task="regression", source="toy1d")).x_train.shape
      (20, 1)
    """
    source = cfg.source if cfg.source != "auto" else ("npz" if cfg.data_file else "toy1d")
    if source == "npz":
        if not cfg.data_file:
            raise data_lib.DataError("--source npz needs --data-file PATH (an npz of floats)")
        return data_lib.load_regression_npz(cfg.data_file)
    if source == "diabetes":
        return data_lib.diabetes(seed=cfg.seed)
    return data_lib.toy1d(seed=cfg.seed)


def split_validation(data: RegressionData, n: int, seed: int) -> tuple[RegressionData, Any]:
    """Holds ``n`` seeded random training rows out: ``(data without them, (x_val, y_val))``.

    Raises:
      ValueError: ``n`` leaves fewer than one training row.
    """
    if n == 0:
        return data, None
    if n >= len(data.x_train):
        raise ValueError(
            f"validation={n} holds out every one of the {len(data.x_train)} training rows; "
            "use a smaller --validation"
        )
    order = np.random.default_rng(seed).permutation(len(data.x_train))
    val, train = order[:n], np.sort(order[n:])
    kept = dataclasses.replace(data, x_train=data.x_train[train], y_train=data.y_train[train])
    return kept, (data.x_train[val], data.y_train[val])


def regression_identity(
    data: RegressionData, train: RegressionData, val: Any, cfg: TrainConfig
) -> dict[str, Any]:
    """What identifies a regression run's data: sizes, file and a hash of every split.

    Args:
      data: the loaded data; train: its training rows after the validation split;
      val: ``(x_val, y_val)`` or None; cfg: the run's config (source, file).

    Returns:
      ``{"task": "regression", "source", "data_file", "name", "num_train", "num_test",
      "splits": {"train", "validation", "test": "sha256:<hex>"}}`` (validation only when
      held out); ``meshensemble evaluate`` compares it split by split.

    Example:
      >>> cfg = me.TrainConfig(task="regression", source="toy1d")
      >>> d = load_regression(cfg)
      >>> regression_identity(d, d, None, cfg)["splits"]["test"][:7]
      'sha256:'
    """
    parts = {"train": (train.x_train, train.y_train), "test": (data.x_test, data.y_test)}
    if val is not None:
        parts["validation"] = val
    splits = {}
    for name, arrays in parts.items():
        digest = hashlib.sha256()
        for a in arrays:
            a = np.ascontiguousarray(a, np.float32)
            digest.update(repr(a.shape).encode())
            digest.update(a)
        splits[name] = "sha256:" + digest.hexdigest()
    return {
        "task": "regression",
        "source": cfg.source,
        "data_file": cfg.data_file,
        "name": data.name,
        "num_train": len(train.x_train),
        "num_test": len(data.x_test),
        "splits": splits,
    }


def _standardise(mean: np.ndarray, std: np.ndarray) -> Callable[[Any], Any]:
    row = lambda v, x: v.reshape((1,) * (x.ndim - 1) + (-1,))  # [F] over [..., F]
    return lambda x: (x - row(mean, x)) / row(std, x)


def build_regression_ensemble(
    cfg: TrainConfig,
    mesh: Mesh,
    stats: dict[str, list[float]],
    targets: int,
    steps: int,
    sample: Any = None,
) -> Ensemble:
    """The regression ensemble of ``cfg``: MLP members on standardised features and targets.

    Args:
      cfg: the run's config (``model`` ``cnn``, the classification default, means ``mlp``).
      mesh: the mesh.
      stats: :func:`meshensemble.data.standardizer` of the training split.
      targets: ``T``.
      steps: steps per epoch (for decaying schedules).
      sample: a features batch ``[B, F]`` (``Ensemble(sample=)``: the state's layout when
        members are sharded, ``--shard-members``).

    Returns:
      The :class:`meshensemble.Ensemble` with a :class:`meshensemble.tasks.Regression` task.
    """
    model = get_model(model_name(cfg)).clone(num_classes=2 * targets)
    task = task_class("regression")(
        targets, target_shift=stats["y_mean"], target_scale=stats["y_std"]
    )
    mean, std = (np.asarray(stats[k], np.float32) for k in ("x_mean", "x_std"))
    return Ensemble(
        model,
        make_optimizer(cfg, cfg.epochs * steps, steps),
        cfg.members,
        mesh,
        backend=cfg.backend,
        member_strategy=cfg.member_strategy,
        input_transform=_standardise(mean, std),
        compute_dtype=PRECISIONS[cfg.precision],
        shard_members=cfg.shard_members,
        task=task,
        sample=sample,
    )


def _resuming(cfg: TrainConfig) -> bool:
    """Whether to resume the workdir's run; clears it with ``overwrite``; refuses others."""
    held = [n for n in (CONFIG_FILE, METRICS_FILE) if os.path.exists(os.path.join(cfg.workdir, n))]
    if not held and not list_checkpoints(cfg.workdir):
        return False
    if cfg.overwrite:
        clear_run(cfg.workdir)
        return False
    where = f"workdir {cfg.workdir} holds a run"
    if not cfg.resume or not list_checkpoints(cfg.workdir):
        raise ValueError(f"{where} that cannot be resumed; add --overwrite or use another workdir")
    saved = read_saved_config(cfg.workdir) or {}
    fields = run_fields(cfg) | {"task": cfg.task, "source": cfg.source, "data_file": cfg.data_file}
    check_same_run(cfg.workdir, saved, fields | {"validation": cfg.validation})
    return True


def draw_figure(ens: Ensemble, state: Any, train: RegressionData, path: str) -> None:
    """Writes :data:`PLOT_FILE` for one-feature data: the mixture and members on a grid.

    The grid spans the training inputs' range widened by half of it on each side (for
    the toy's ``[-4, 4]``: ``[-8, 8]``), so the spread outside the data shows.
    """
    from meshensemble import plots

    lo, hi = float(train.x_train.min()), float(train.x_train.max())
    grid = np.linspace(lo - (hi - lo) / 2, hi + (hi - lo) / 2, 200, dtype=np.float32)[:, None]
    out = fetch(ens.predict(state, grid))  # every process takes part; process 0 draws
    members = fetch(ens.predict_members(state, grid))["mean"][..., 0]
    if jax.process_index():
        return
    sd = np.sqrt(out["variance"][:, 0])
    plots.regression_figure(grid[:, 0], out["mean"][:, 0], sd, members, train.x_train,
                            train.y_train, path)  # fmt: skip


def _scores(ens: Ensemble, state: Any, x: Any, y: Any, prefix: str, batch: int) -> dict:
    out = ens.evaluate(state, x, y, batch_size=batch)
    return {f"{prefix}_{k}": v for k, v in out.items() if k != "count"}


@dataclasses.dataclass(frozen=True)
class RegressionPlan:
    """What a regression run works out from its config and data, before any step.

    Attributes:
      mesh: ``{"ensemble": E, "data": D}``.
      batch: the global batch: ``cfg.batch_size``, or all the training rows when they
        are fewer (a multiple of ``D``, so every mesh trains on the same batches).
      steps: steps per epoch.
      last: the step the run stops at (``epochs * steps``, or ``max_steps`` if sooner).
      every: evaluate (and checkpoint) every this many epochs, and at the end.
    """

    mesh: dict[str, int]
    batch: int
    steps: int
    last: int
    every: int


def plan_run(cfg: TrainConfig, num_train: int, devices: int) -> RegressionPlan:
    """The :class:`RegressionPlan` of ``cfg`` on ``num_train`` rows and ``devices`` (pure).

    Raises:
      ValueError: the batch is not a multiple of the mesh's ``data`` axis (rounding it
        would make the run depend on the mesh).

    Example:
      >>> plan_run(me.TrainConfig(task="regression", batch_size=8, epochs=40), 16, 8).steps
      2
    """
    shape = parse_mesh(cfg.mesh) if cfg.mesh else default_mesh_shape(cfg.members, devices)
    d = int(shape.get("data", 1))
    batch = min(cfg.batch_size, num_train)
    if batch % d:
        what = (
            f"batch_size={batch}"
            if batch == cfg.batch_size
            else f"the batch of all {num_train} training rows (batch_size={cfg.batch_size})"
        )
        fix = f"--batch-size {batch // d * d}, or " if batch >= d else ""
        raise ValueError(
            f"{what} is not divisible by the mesh's data axis ({d}); use {fix}a mesh whose "
            "data axis divides it"
        )
    steps = num_train // batch
    last = cfg.epochs * steps if cfg.max_steps is None else min(cfg.max_steps, cfg.epochs * steps)
    return RegressionPlan(dict(shape), batch, steps, last, max(1, cfg.epochs // EVALUATIONS))


def epoch_batches(cfg: TrainConfig, plan: RegressionPlan, epoch: int, n: int) -> np.ndarray:
    """Row indices of each step of ``epoch``: ``[steps, batch]``, or ``[steps, members, batch]``.

    A seeded permutation per epoch (``default_rng([seed, epoch])``), one for all members
    (``shuffle="shared"``) or one per member (``"per-member"``, then member ``m`` draws
    from ``default_rng([seed, epoch, m])``); the same on every process and after a resume.
    """
    take = lambda order: np.sort(
        order[: plan.steps * plan.batch].reshape(plan.steps, plan.batch), axis=-1
    )
    if cfg.shuffle == "per-member":
        rows = [take(np.random.default_rng([cfg.seed, epoch, m]).permutation(n))
                for m in range(cfg.members)]  # fmt: skip
        return np.stack(rows, axis=1)
    return take(np.random.default_rng([cfg.seed, epoch]).permutation(n))


def train_regression(
    cfg: TrainConfig, echo: Callable[[str], None] | None = None
) -> RegressionResult:
    """Trains a regression ensemble as ``cfg`` says (``cfg.task == "regression"``).

    Args:
      cfg: the validated config.
      echo: where lines go (default ``print`` on process 0, nothing with ``quiet``).

    Returns:
      A :class:`RegressionResult`.

    Raises:
      ValueError: a workdir holding another run, or a bad ``validation``;
        :class:`meshensemble.data.DataError` for the data;
        :class:`meshensemble.training.NonFiniteError` when a member's loss is NaN/inf.

    Example:
      >>> cfg = me.TrainConfig(task="regression", source="toy1d", members=4, epochs=2,
      ...                      batch_size=8, validation=10, workdir="runs/toy1d")
      >>> result = me.training.train(cfg, echo=lambda line: None)   # no printed lines
      >>> type(result).__name__, result.history[-1]["step"]
      ('RegressionResult', 2)
    """
    t0, main = time.perf_counter(), jax.process_index() == 0
    say = echo or (print if main and not cfg.quiet else (lambda s: None))
    check_writable(cfg.workdir)
    data = load_regression(cfg)  # every bad input raises before the workdir is touched
    train, val = split_validation(data, cfg.validation, cfg.seed)
    stats = data_lib.standardizer(train)
    plan = plan_run(cfg, len(train.x_train), jax.device_count())
    resume = _resuming(cfg)
    ens = build_regression_ensemble(
        cfg, make_mesh(**plan.mesh), stats, train.targets, plan.steps, train.x_train[:1]
    )
    init_key = jax.random.split(jax.random.key(cfg.seed))[0]  # the classification run's
    state, step = ens.init(init_key, train.x_train[:1]), 0
    if resume:
        state, _, step = restore_checkpoint(cfg.workdir, ens, train.x_train[:1], echo=say)
        say(f"resumed {cfg.workdir} at step {step}")
    with unfinished_run(cfg.workdir, fresh=not resume, enabled=main):  # no half-made run
        writer = RunWriter(cfg.workdir, main, cfg.tensorboard, keep_until=step if resume else None)
        identity = regression_identity(data, train, val, cfg)
        values = (plan.mesh, plan.batch, plan.steps, model_name(cfg), stats, data.name, identity)
        writer.write_config(cfg, dict(zip(RESOLVED_KEYS, values)))
        ckpt = Checkpointer(cfg.workdir, cfg.keep, say) if cfg.checkpoint else None
        sets = {"test": (data.x_test, data.y_test)} | ({"val": val} if val is not None else {})
        stop, stopped = StopSignal.install(), False
        try:
            while step < plan.last and not stopped:
                rows = epoch_batches(cfg, plan, step // plan.steps, len(train.x_train))
                for idx in rows[step % plan.steps : plan.steps]:
                    state, metrics = ens.train_step(state, train.x_train[idx], train.y_train[idx])
                    step += 1
                    stopped = stop.requested(step)
                    if step >= plan.last or stopped:
                        break
                if stopped:
                    say(f"stopped by {stop.signal} at step {step}; rerun the command to resume")
                elif step < plan.last and (step // plan.steps) % plan.every:
                    continue  # evaluate (and save) every `every` epochs, and at the end
                else:
                    record = _record(cfg, ens, state, step, plan, metrics, sets)
                    writer.write_metrics(record)
                    writer.history.append(record)
                    say(_line(record, plan.last))
                if ckpt is not None:
                    ckpt.save(step, state, {"epoch": step // plan.steps, "step": step})
        finally:
            stop.uninstall()
        if ckpt is not None:
            ckpt.close()
        if data.x_train.shape[1] == 1 and data.targets == 1 and not stopped:
            draw_figure(ens, state, train, os.path.join(cfg.workdir, PLOT_FILE))
        writer.close()
        seconds = time.perf_counter() - t0
        signal = stop.signal if stopped else None
        return RegressionResult(
            ens, state, writer.history, data, seconds, preempted=stopped, signal=signal
        )


def _record(cfg, ens, state, step, plan, metrics, sets) -> dict[str, Any]:
    """One ``metrics.jsonl`` record; NonFiniteError when a member's loss is NaN/inf."""
    loss = np.asarray(fetch(metrics["loss"]))
    if not np.all(np.isfinite(loss)):
        raise NonFiniteError(
            f"members {np.flatnonzero(~np.isfinite(loss)).tolist()} have a non-finite "
            f"loss at step {step}; lower --learning-rate (e.g. --optimizer adam "
            "--learning-rate 0.01)"
        )
    record = {"step": step, "epoch": step / plan.steps, "train_loss": loss.tolist()}
    for name, (x, y) in sets.items():
        record |= _scores(ens, state, x, y, name, cfg.eval_batch_size)
    return record


def _line(r: dict[str, Any], last: int) -> str:
    return (
        f"step {r['step']}/{last}: loss {np.mean(r['train_loss']):.4f}, test nll "
        f"{r['test_nll']:.4f}, rmse {r['test_rmse']:.4f}, crps {r['test_crps']:.4f}, "
        f"90% coverage {r['test_coverage_90']:.3f}"
    )
