"""What a run decides before it writes anything: its task, data, plan, ensemble, checkpoint.

:func:`prepare` is the setup half of :func:`meshensemble.training.train`: the run's task
(:func:`with_task`), its data checked (:func:`meshensemble.training.rundata.run_data`), the
plan, the tuned ensemble and, for a resumed run (:func:`saved_run`), its restored
checkpoint. A bad value is refused here in one line, before the workdir changes.

Example:
  >>> cfg, task = with_task(me.TrainConfig(), None)
  >>> task.name, run_keys(0)[0].shape
  ('classification', ())
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from meshensemble import data as data_lib
from meshensemble.core.derive import member_params
from meshensemble.core.ensemble import Ensemble
from meshensemble.core.layout import given_values
from meshensemble.core.mesh import make_mesh
from meshensemble.core.tasks import Task, task_class, task_names
from meshensemble.runtime import storage
from meshensemble.training.backbone import backbone_model_state, load_backbone
from meshensemble.training.checkpoint import CHECKPOINT_DIR, list_checkpoints, restore_checkpoint
from meshensemble.training.config import (
    CONFIG_FILE,
    METRICS_FILE,
    TrainConfig,
    build_ensemble,
    model_name,
)
from meshensemble.training.feeder import Feeder
from meshensemble.training.identity import check_same_run, read_saved_config, run_fields
from meshensemble.training.plan import TrainPlan, plan_training
from meshensemble.training.rundata import RunData, run_data
from meshensemble.training.tuning import concrete, resolve_choices


def with_task(cfg: TrainConfig, task: Task | type[Task] | None) -> tuple[TrainConfig, Task]:
    """``cfg`` naming ``task`` (when given) and the task instance the run starts from.

    A task class of this package registered under its name is named by it; any other by
    ``module:Class`` (a user's registry entry is not there in a later process), so a later
    command imports it again.

    Raises:
      ValueError: ``task`` is not a Task, or an unknown ``cfg.task``.

    Example:
      >>> cfg, task = with_task(me.TrainConfig(), me.tasks.Regression())
      >>> cfg.task, task.name
      ('regression', 'regression')
    """
    if task is None:
        return cfg, task_class(cfg.task)()
    task = task() if isinstance(task, type) and issubclass(task, Task) else task
    if not isinstance(task, Task):
        raise ValueError(f"task={task!r} is not a meshensemble.tasks.Task (instance or class)")
    cls = type(task)
    packaged = cls.__module__.startswith("meshensemble.")  # a user's module may not be loaded
    named = packaged and task.name in task_names() and task_class(task.name) is cls
    spec = task.name if named else f"{cls.__module__}:{cls.__qualname__}"
    return dataclasses.replace(cfg, task=spec), task


def _split(seed: Any) -> tuple[jax.Array, jax.Array]:
    return tuple(jax.random.split(jax.random.key(seed)))


_split_seed = jax.jit(_split)


def run_keys(seed: int) -> tuple[jax.Array, jax.Array]:
    """The run's two keys, ``jax.random.split(jax.random.key(seed))``, in one program.

    Args:
      seed: ``TrainConfig.seed``.

    Returns:
      ``(init_key, order_key)``, typed keys equal to the split of ``jax.random.key(seed)``.

    Example:
      >>> init_key, order_key = run_keys(0)
      >>> bool((jax.random.key_data(init_key) == jax.random.key_data(
      ...     jax.random.split(jax.random.key(0))[0])).all())
      True
    """
    if -(2**31) <= seed < 2**31:
        return _split_seed(np.int32(seed))
    return _split(seed)  # outside int32: the same split, not compiled


def held_outputs(workdir: str) -> list[str]:
    """The run files ``workdir`` holds (``config.json``, ``metrics.jsonl``, checkpoints).

    Example:
      >>> held_outputs("no/such/run")
      []
    """
    names = (CONFIG_FILE, METRICS_FILE, CHECKPOINT_DIR)
    return [n for n in names if storage.exists(storage.join(workdir, n))]


def saved_run(cfg: TrainConfig) -> dict[str, Any] | None:
    """The saved config of the run to resume, or None to start afresh; refuses to clobber.

    Raises:
      ValueError: a workdir holding a run that ``cfg`` may not resume (``--no-resume``, no
        checkpoint, no ``config.json``, or another run's fields), one line with the fixes.

    Example:
      >>> saved_run(me.TrainConfig(workdir="no/such/run")) is None   # a new run
      True
    """
    held = held_outputs(cfg.workdir)
    if not held or cfg.overwrite:
        return None
    where = f"workdir {cfg.workdir} holds a run ({', '.join(held)})"
    if not cfg.resume:
        raise ValueError(
            f"{where}; --no-resume would overwrite it: add --overwrite, or resume it, or use "
            "another --workdir"
        )
    if not list_checkpoints(cfg.workdir):
        raise ValueError(
            f"{where} but no checkpoint to resume from; add --overwrite to start over, or use "
            "another --workdir"
        )
    saved = read_saved_config(cfg.workdir)
    if saved is None:
        raise ValueError(
            f"{where} but no {CONFIG_FILE} saying which run it is; add --overwrite to start "
            "over, or use another --workdir"
        )
    check_same_run(cfg.workdir, saved, run_fields(cfg))
    return saved


@dataclasses.dataclass
class Setup:
    """What a run decides before it writes anything (:func:`prepare`).

    Attributes:
      data: its data; plan: its plan; sample: one input row; init_key: the members' key;
      feeder_for: ``ens -> Feeder`` of the run's data and order; choice: the tuner's;
      ens: the ensemble it trains (its task set up for the data); restored: the state,
      loop entry and step of a resumed run's checkpoint, else None.
    """

    data: RunData
    plan: TrainPlan
    sample: Any
    init_key: jax.Array
    feeder_for: Callable[[Ensemble], Feeder]
    choice: Any
    ens: Ensemble
    restored: Any


def prepare(cfg, dataset, saved, task, source, cache_dir, say, tell) -> Setup:
    """The run's data (checked), task, plan, tuned ensemble and restored checkpoint.

    Args:
      cfg: the run's config; dataset: data given from Python, or None; saved: a resumed
        run's ``config.json`` (or None); task: the run's task; source: a streamed source;
      cache_dir: the compilation cache; say, tell: where lines go.

    Returns:
      A :class:`Setup`.

    Raises:
      ValueError, meshensemble.data.DataError: a bad value (one line), nothing written.

    Example:
      >>> setup = prepare(me.TrainConfig(model="mlp", members=2, batch_size=32, source="npz",
      ...     data_file="mnist.npz", workdir="runs/p"), None, None, me.tasks.Classification(),
      ...     None, None, print, print)
      data: ...
      >>> setup.plan.steps_per_epoch, setup.ens.task.num_classes
      (3, 10)
    """
    data = run_data(cfg, dataset, saved, task, say, cfg.batch_size)
    train = data.train
    task = task.for_data(train, dataclasses.asdict(cfg))  # e.g. regression's target scale
    plan = plan_training(cfg, train.num_train, jax.device_count(), jax.devices()[0].platform)
    sample = train.x_train[:1]  # read once (a lazy split reads an example)
    check_inputs(cfg, train, sample)
    run_cfg = dataclasses.replace(cfg, batch_size=plan.batch)  # what the steps use
    mesh = make_mesh(**plan.mesh)
    init_key, order_key = run_keys(cfg.seed)
    stats, n = data.inputs["normalization"], train.num_train
    build = lambda c: build_ensemble(  # the run's ensemble for a config: the tuner builds too
        c, mesh, n, sample, task=task, input_stats=stats, steps_per_epoch=plan.steps_per_epoch
    )
    check_model(build(run_cfg), init_key, sample, model_name(cfg, sample))
    feeder_for = lambda e: Feeder(  # the run's feeder of an ensemble: the tuner times it
        e, train, run_cfg, order_key, plan.chunk, plan.steps_per_epoch, source=source
    )
    recorded = saved.get("resolved") if saved is not None else None
    choice = resolve_choices(
        run_cfg, mesh, train, init_key, cache_dir, recorded, feeder=feeder_for, build=build
    )
    ens = choice.ensemble or build(concrete(run_cfg, choice.member_strategy, choice.conv))
    restored = None
    if saved is not None:
        restored = restore_checkpoint(cfg.workdir, ens, sample, echo=tell)
        check_not_past_the_end(cfg, int(restored[2]), plan.steps_per_epoch)
    elif cfg.backbone:  # a backbone that does not fit is refused before anything is written
        shapes = member_params(ens.model, ens.input_transform, sample)
        what, shared = f"--backbone {cfg.backbone}", ens.layout.shared_mask(shapes)
        given_values(shapes, load_backbone(cfg.backbone), shared, 1, what)
        backbone_model_state(cfg.backbone, ens.model, ens.input_transform, sample)
    return Setup(data, plan, sample, init_key, feeder_for, choice, ens, restored)


def check_inputs(cfg: TrainConfig, train: data_lib.Dataset, sample: Any = None) -> None:
    """Refuses options the inputs cannot take: augmentation of features that are no images.

    Raises:
      ValueError: one line naming the option, the inputs' shape and the fix.

    Example:
      >>> check_inputs(me.TrainConfig(augment="shift"), me.data.toy1d())
      Traceback (most recent call last):
      ...
      ValueError: augment='shift' shifts or crops images [N, H, W, C]; these inputs are [N, 1]: ...
    """
    shape, images = tuple(train.x_train.shape[1:]), len(train.x_train.shape) >= 4
    if cfg.augment != "none" and not images:
        raise ValueError(
            f"augment={cfg.augment!r} shifts or crops images [N, H, W, C]; these inputs are "
            f"[N, {', '.join(map(str, shape))}]: leave --augment at none"
        )


def check_model(ens: Ensemble, key: jax.Array, sample: Any, name: str) -> None:
    """Refuses a model that cannot take the run's inputs, in one line (traced, not run).

    Raises:
      ValueError: the model's initialisation fails on ``sample``'s shape.

    Example:
      >>> check_model(ens, key, images[:1], "mlp")   # None: it takes them
    """
    try:
        jax.eval_shape(ens.init, key, sample)
    except Exception as err:  # a user's model may raise anything for another shape
        why, shape = " ".join(str(err).split())[:160], ", ".join(map(str, sample.shape[1:]))
        raise ValueError(
            f"model={name!r} cannot take inputs of shape [N, {shape}] "
            f"({type(err).__name__}: {why}); use a model for such inputs (e.g. --model mlp for "
            "features)"
        ) from None


def resolved_record(
    plan: TrainPlan,
    choices: dict[str, Any],
    cache_dir: Any,
    data: RunData,
    task: Task,
    cfg: TrainConfig,
    sample: Any = None,
) -> dict[str, Any]:
    """What ``config.json`` records of a run beside its config (``resolved``).

    Args:
      plan: the run's plan; choices: the tuner's (``Choice.resolved()``); cache_dir: the
        compilation cache in use; data: the run's data; task: set up for it; cfg: its config;
        sample: one input row (default read from the data).

    Returns:
      The JSON object: mesh, chunk, batch, steps per epoch, evaluations, the tuner's
      choices, model, the task's record, the inputs' record, the data's identity and
      validation split, devices and versions.

    Example:
      >>> sorted(resolved_record(plan_training(me.TrainConfig(), 4000, 1, "cpu"), {}, None,
      ...     run_data(me.TrainConfig(source="sample"), None, None, me.tasks.Classification(),
      ...              print), me.tasks.Classification(), me.TrainConfig()))[:3]
      data: ...
      ['batch_size', 'chunk_steps', 'compile_cache']
    """
    return {
        "mesh": plan.mesh,
        "chunk_steps": plan.chunk,
        "batch_size": plan.batch,
        "steps_per_epoch": plan.steps_per_epoch,
        "eval_every": plan.eval_every,
        **choices,
        "model": model_name(cfg, data.train.x_train[:1] if sample is None else sample),
        "task": task.record(),
        "input": data.inputs,
        "compile_cache": cache_dir,
        "data": data.dataset.note,
        "data_identity": data.identity,
        "validation": data.held_out,
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
    }


def check_not_past_the_end(cfg: TrainConfig, step: int, steps_per_epoch: int) -> None:
    """Refuses a resume whose ``epochs`` end before the checkpoint (config.json would lie).

    Raises:
      ValueError: one line naming the checkpoint and the ``--epochs`` it needs.

    Example:
      >>> check_not_past_the_end(me.TrainConfig(epochs=2), 10, 5)   # step 10 of 2 x 5: fine
    """
    if step > cfg.epochs * steps_per_epoch:
        need = -(-step // steps_per_epoch)
        raise ValueError(
            f"checkpoint {step} in {cfg.workdir} is past the end of an --epochs {cfg.epochs} "
            f"run (step {cfg.epochs * steps_per_epoch}); give --epochs {need} or more, or "
            "--overwrite to start over"
        )
