"""A run's data: loaded from its config (or given), checked by its task, held out, summarised.

:func:`load_config_data` loads what a config's data settings name (``--source``,
``--data-file``, ``--data-dir``; ``auto`` with no file takes the task's own data, e.g.
regression's ``toy1d``); :func:`run_data` adds what the training loop needs before any
step: the task's checks of the data (:meth:`meshensemble.tasks.Task.check_dataset`), the
data identity every process agrees on (and a resumed run's), the validation split, and the
inputs' record (shape, dtype, per-feature statistics of float features, which the members
standardise with on device).

Example:
  >>> cfg = me.TrainConfig(task="regression", source="toy1d", validation=4, batch_size=8)
  >>> data = run_data(cfg, None, None, me.tasks.Regression(), print)
  data: the 1-D toy y = x^3 + noise, seed 0 (20 train / 200 test)
  >>> data.train.num_train, data.held_out["count"], data.inputs["shape"]
  (16, 4, [1])
"""

from __future__ import annotations

import dataclasses
import zipfile
from collections.abc import Callable
from typing import Any

import numpy as np

from meshensemble import data as data_lib
from meshensemble.core.tasks import Task
from meshensemble.data.split import split_validation
from meshensemble.training.config import TrainConfig
from meshensemble.training.feeder import check_lazy_input
from meshensemble.training.identity import agree_data, check_same_run, data_identity, run_fields

TABLE_LOADERS = {"toy1d": data_lib.toy1d, "diabetes": data_lib.diabetes}
"""The loaders of :data:`~meshensemble.training.config.TABLE_SOURCES` (tables with float
targets, not in :func:`meshensemble.data.load_dataset`), by source name."""


def _float_targets(path: str) -> bool:
    """Whether an npz's ``y_train`` holds floats (not class ids); False when unreadable."""
    try:
        with np.load(path, allow_pickle=False) as f:
            return "y_train" in f.files and np.issubdtype(f["y_train"].dtype, np.floating)
    except (OSError, ValueError, zipfile.BadZipFile):
        return False


def load_config_data(
    cfg: TrainConfig,
    task: Task,
    *,
    source: str | None = None,
    data_file: str | None = None,
    data_dir: str | None = None,
    log: Callable[[str], Any] | None = None,
) -> data_lib.Dataset:
    """The data ``cfg`` names (or the overriding ``source``/``data_file``/``data_dir``).

    ``auto`` with no file loads the task's :attr:`~meshensemble.tasks.Task.auto_source`
    when it has one; an npz whose ``y_train`` holds floats is read as float targets.

    Raises:
      meshensemble.data.DataError: the loaders' one-line errors.

    Example:
      >>> load_config_data(me.TrainConfig(source="toy1d"), me.tasks.Regression()).num_train
      20
    """
    src = source or cfg.source
    path = data_file if data_file is not None else cfg.data_file
    if src == "auto" and path is None and task.auto_source:
        src = task.auto_source
    if src in TABLE_LOADERS:
        ds = TABLE_LOADERS[src](seed=cfg.seed)
    elif src in ("npz", "auto") and path is not None and _float_targets(path):
        ds = data_lib.load_regression_npz(path)
    else:
        stream = cfg.input == "stream" or cfg.streaming  # tfds then opens a lazy train split
        return data_lib.load_dataset(
            cfg.dataset, src, path, data_dir or cfg.data_dir, log=log, stream=stream
        )
    if log is not None:
        log(f"data: {ds.note}")
    return ds


def input_record(x: Any) -> dict[str, Any]:
    """One input's shape and dtype, and for float features their per-feature (last axis)
    ``mean`` and ``std`` over ``x`` (a constant feature gets std 1: it is only centred).

    Example:
      >>> input_record(np.array([[0.0, 1.0], [2.0, 1.0]], np.float32))["stats"]
      {'mean': [1.0, 1.0], 'std': [1.0, 1.0]}
    """
    stats = None
    if np.issubdtype(np.dtype(x.dtype), np.floating) and not getattr(x, "lazy", False):
        flat = np.asarray(x).reshape(-1, x.shape[-1])  # in the features' own dtype
        std = flat.std(0)
        stats = {"mean": flat.mean(0).tolist(), "std": np.where(std > 0, std, 1.0).tolist()}
    return {"shape": list(x.shape[1:]), "dtype": str(np.dtype(x.dtype)), "stats": stats}


@dataclasses.dataclass(frozen=True)
class RunData:
    """What :func:`run_data` returns.

    Attributes:
      dataset: the data as loaded (before the validation split).
      train: the data the members train on (the validation split held out).
      validation: ``(x, y)`` held out, or None.
      identity: :func:`~meshensemble.training.identity.data_identity` of ``dataset``.
      held_out: the validation split's record (``config.json``), or None.
      inputs: :func:`input_record` of the training inputs.
    """

    dataset: data_lib.Dataset
    train: data_lib.Dataset
    validation: Any
    identity: dict[str, Any]
    held_out: dict[str, Any] | None
    inputs: dict[str, Any]


def run_data(
    cfg: TrainConfig,
    dataset: Any,
    saved: dict[str, Any] | None,
    task: Task,
    say: Callable[[str], Any],
    batch_size: int | None = None,
) -> RunData:
    """The run's training data, checked (every process the same, a resumed run's own, the
    task's checks), with its validation split and inputs' record.

    Args:
      cfg: the run's config; dataset: data given from Python, or None (loaded).
      saved: a resumed run's ``config.json`` object, or None.
      task: the run's task (its data checks); say: gets the loader's line.
      batch_size: the run's batch (the validation split must leave one); default cfg's.

    Raises:
      ValueError, meshensemble.data.DataError: one line naming the problem.
    """
    origin = "object" if dataset is not None else "config"  # evaluate reloads only "config"
    if dataset is None:
        dataset = load_config_data(cfg, task, log=say)
    check_lazy_input(cfg, dataset)  # a lazy train split never goes to the devices whole
    identity = data_identity(dataset, cfg.data_file, cfg.validation, cfg.seed, origin=origin)
    agree_data(identity, dataset.note)  # every process the same data, or all stop
    if saved is not None:
        check_same_run(cfg.workdir, saved, run_fields(cfg), identity)
    train, held_out, validation = dataset, None, None
    if cfg.validation:
        split = split_validation(dataset, cfg.validation, cfg.seed, batch_size=batch_size or 1)
        train, held_out, validation = split.train, split.record(), (split.x, split.y)
    task.check_dataset(train)
    return RunData(dataset, train, validation, identity, held_out, input_record(train.x_train))
