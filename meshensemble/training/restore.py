"""A finished run, rebuilt and restored: the one path ``evaluate``, ``predict`` and ``export`` take.

:func:`restore_run` reads a run's ``config.json`` (:func:`load_run_config`), rebuilds its
task (``resolved.task``: the task's :meth:`~meshensemble.tasks.Task.from_record`), its
input (shape, dtype and feature statistics) and its ensemble on any mesh
(:func:`run_mesh`), and restores a checkpoint read-only. :func:`run_identity` names the
checkpoint by the run that wrote it (data, seed, step, the checkpoint's digest), which a
saved calibration must match before anything applies it.

Example:
  >>> run = restore_run("runs/tiny", mesh="ensemble=4,data=1")
  >>> run.task.name, run.step, run.sample.shape
  ('classification', 4, (1, 28, 28, 1))
  >>> sorted(run_identity("runs/tiny", run.cfg, run.step))
  ['checkpoint', 'data', 'seed', 'step']
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from meshensemble.core.mesh import make_mesh, parse_mesh
from meshensemble.core.tasks import Task, task_class
from meshensemble.data import IMAGE_SHAPE
from meshensemble.runtime import storage
from meshensemble.training.checkpoint import (
    CHECKPOINT_DIR,
    checkpoint_digest,
    list_checkpoints,
    read_checksums,
    restore_checkpoint,
)
from meshensemble.training.config import (
    CONFIG_FILE,
    TrainConfig,
    build_ensemble,
    default_mesh_shape,
)
from meshensemble.training.identity import read_saved_config


def run_mesh(mesh: Any, members: int) -> Mesh:
    """The mesh a restored run uses: a ``Mesh``, ``"ensemble=E,data=D"``, a dict or None.

    None (or ``""``) takes every device with ``ensemble = gcd(members, devices)``.

    Raises:
      ValueError: a bad spec (one line).

    Example:
      >>> dict(run_mesh("ensemble=4,data=2", 8).shape)
      {'ensemble': 4, 'data': 2}
    """
    if isinstance(mesh, Mesh):
        return mesh
    if mesh is None or mesh == "":
        shape = default_mesh_shape(members, jax.device_count())
    elif isinstance(mesh, str):
        shape = parse_mesh(mesh)
    else:
        shape = {k: int(v) for k, v in dict(mesh).items()}
    return make_mesh(shape.get("ensemble"), shape.get("data", 1), shape.get("model"))


def load_run_config(workdir: str) -> TrainConfig:
    """Reads a run's ``config.json`` back into a :class:`meshensemble.training.TrainConfig`.

    The ``"resolved"`` entry (what training resolved: mesh, devices...) and keys that
    ``TrainConfig`` does not know are ignored.

    Args:
      workdir: the run's folder.

    Returns:
      The validated ``TrainConfig`` the run was trained with.

    Raises:
      FileNotFoundError: ``workdir`` or its ``config.json`` does not exist.
      ValueError: ``config.json`` is not valid JSON, not an object, or holds bad values
        (one line naming the file).

    Example:
      >>> load_run_config("runs/tiny").members
      4
    """
    if not storage.isdir(workdir):
        raise FileNotFoundError(
            f"{workdir}: no such run folder; train one with `meshensemble train --workdir "
            f"{workdir}` or pass the folder of a trained run"
        )
    path = storage.join(workdir, CONFIG_FILE)
    if not storage.isfile(path):
        raise FileNotFoundError(
            f"{path}: not found; --workdir must be a folder written by `meshensemble train`"
        )
    try:
        loaded = storage.read_json(path)
    except (OSError, ValueError) as err:
        msg = " ".join(str(err).split())
        raise ValueError(f"{path}: corrupt run config, cannot read JSON ({msg})") from None
    if not isinstance(loaded, dict):
        raise ValueError(
            f"{path}: corrupt run config, expected a JSON object of TrainConfig fields"
        )
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    try:
        return TrainConfig(**{k: v for k, v in loaded.items() if k in fields}).validate()
    except (TypeError, ValueError) as err:
        msg = " ".join(str(err).split())
        raise ValueError(f"{path}: corrupt run config ({msg})") from None


def check_checkpoint(workdir: str, step: int | None) -> None:
    """Fails before any work when the run has no checkpoint, or not ``step``.

    Raises:
      FileNotFoundError: one line listing the available steps.

    Example:
      >>> check_checkpoint("runs/tiny", 4)   # None: it is there
    """
    steps = list_checkpoints(workdir)
    folder = storage.join(workdir, CHECKPOINT_DIR)
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


def run_input(resolved: Mapping[str, Any]) -> tuple[np.ndarray, Any]:
    """One input row of a run (zeros ``[1, ...]`` of its dtype) and its feature statistics.

    From ``resolved.input`` (``shape``, ``dtype``, ``stats``); runs written before it
    recorded either a ``standardizer`` (float features ``[F]``) or nothing (MNIST images).

    Example:
      >>> run_input({"input": {"shape": [3], "dtype": "float32", "stats": None}})[0].shape
      (1, 3)
    """
    held = resolved.get("input")
    if isinstance(held, Mapping):
        return np.zeros((1, *held["shape"]), np.dtype(held["dtype"])), held.get("stats")
    old = resolved.get("standardizer")
    if isinstance(old, Mapping) and "x_mean" in old:
        stats = {"mean": old["x_mean"], "std": old["x_std"]}
        return np.zeros((1, len(old["x_mean"])), np.float32), stats
    return np.zeros((1, *IMAGE_SHAPE), np.uint8), None


def run_task(cfg: TrainConfig, resolved: Mapping[str, Any]) -> Task:
    """The task a run trained: its class from ``cfg.task``, its setup from ``resolved.task``.

    Example:
      >>> run_task(load_run_config("runs/toy"), read_saved_config("runs/toy")["resolved"])
      Regression(targets=1, ...)
    """
    record = resolved.get("task")
    return task_class(cfg.task).from_record(record if isinstance(record, Mapping) else {}, resolved)


def run_identity(workdir: str, cfg: TrainConfig, step: int) -> dict[str, Any]:
    """What names checkpoint ``step`` of the run in ``workdir``: a saved calibration's key.

    Returns:
      ``{"data": 16 hex digits of the recorded data identity, "seed", "step",
      "checkpoint": its SHA-256}`` (the digest recorded at saving, else computed).

    Example:
      >>> run_identity("runs/tiny", load_run_config("runs/tiny"), 4)["step"]
      4
    """
    resolved = (read_saved_config(workdir) or {}).get("resolved") or {}
    data = json.dumps(resolved.get("data_identity"), sort_keys=True, default=str)
    folder = storage.join(workdir, CHECKPOINT_DIR)
    digest = read_checksums(folder).get(str(step))
    if digest is None and storage.isdir(storage.join(folder, str(step))):
        digest = checkpoint_digest(storage.join(folder, str(step)))
    return {
        "data": hashlib.sha256(data.encode()).hexdigest()[:16],
        "seed": cfg.seed,
        "step": int(step),
        "checkpoint": digest,
    }


@dataclasses.dataclass(frozen=True)
class RestoredRun:
    """A run rebuilt from its folder, its checkpoint restored (what :func:`restore_run` returns).

    Attributes:
      workdir: the run's folder; cfg: its :class:`TrainConfig`; task: its task.
      ensemble: the :class:`meshensemble.Ensemble` on the chosen mesh; state: restored.
      step: the checkpoint's step.
      sample: one input row ``[1, ...]`` of the run's shape and dtype (zeros).
      input_stats: the training split's feature statistics (float features), or None.
      resolved: ``config.json``'s ``resolved`` entry; identity: its ``data_identity``.
    """

    workdir: str
    cfg: TrainConfig
    task: Task
    ensemble: Any
    state: Any
    step: int
    sample: np.ndarray
    input_stats: Any
    resolved: dict[str, Any]
    identity: dict[str, Any]


def _num_train(cfg: TrainConfig, resolved: Mapping[str, Any]) -> int:
    held = resolved.get("data_identity") or {}
    return max(int(held.get("num_train") or cfg.batch_size or 1) - cfg.validation, 1)


def restore_run(
    workdir: str,
    mesh: Any = None,
    checkpoint: int | None = None,
    echo: Callable[[str], Any] | None = None,
    what: str = "using",
) -> RestoredRun:
    """Rebuilds a run's ensemble on ``mesh`` and restores a checkpoint, read-only.

    Damaged checkpoints are skipped (reported, never moved); when the one restored is not
    the newest, one line says which and why.

    Args:
      workdir: the run's folder.
      mesh: a ``Mesh``, ``"ensemble=E,data=D"``, a dict, or None (every device).
      checkpoint: the step; default the newest good one.
      echo: where notes go (default: nowhere).
      what: the verb of the note on a checkpoint other than the newest (``evaluating``).

    Returns:
      A :class:`RestoredRun`.

    Raises:
      FileNotFoundError: no run folder, ``config.json`` or checkpoint (or not that one).
      ValueError: a corrupt ``config.json``, or a bad mesh.
      meshensemble.CheckpointError: no readable checkpoint, or one that does not fit.

    Example:
      >>> restore_run("runs/toy").ensemble.predict(
      ...     restore_run("runs/toy").state, np.zeros((2, 1), np.float32))["mean"].shape
      (2, 1)
    """
    say = echo or (lambda line: None)
    cfg = load_run_config(workdir)
    check_checkpoint(workdir, checkpoint)
    resolved = dict((read_saved_config(workdir) or {}).get("resolved") or {})
    task = run_task(cfg, resolved)
    sample, stats = run_input(resolved)
    ens = build_ensemble(
        cfg, run_mesh(mesh, cfg.members), _num_train(cfg, resolved), sample, task=task,
        input_stats=stats, steps_per_epoch=resolved.get("steps_per_epoch"),
    )  # fmt: skip
    newest, lines = max(list_checkpoints(workdir), default=None), []
    state, _, step = restore_checkpoint(
        workdir, ens, sample, checkpoint, echo=lines.append, move_damaged=False
    )
    if checkpoint is None and newest is not None and step != newest:
        tails = ("; trying the previous one", "; trying the newest remaining one")
        why = "; ".join(functools.reduce(lambda t, x: t.replace(x, ""), tails, ln) for ln in lines)
        which = f"not the newest ({newest})" if step < newest else "saved meanwhile"
        say(f"{what} checkpoint {step}, {which}: {why}")
    else:
        for line in lines:
            say(line)
    identity = dict(resolved.get("data_identity") or {})
    return RestoredRun(
        workdir, cfg, task, ens, state, int(step), sample, stats, resolved, identity
    )
