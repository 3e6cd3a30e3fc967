"""The training loop: data on the devices, K steps per compiled call, evaluation, outputs.

The training set is put on the mesh once (replicated: MNIST-sized sets fit on every
device). Each epoch's order is drawn on device from the seed (so the batches are the
same whatever the mesh) and every step gathers its batch on device, so no step waits on
a host copy. ``chunk_steps`` (K) steps run per compiled call (a ``lax.scan`` when K > 1).
A streaming path (host batches, one step per call) remains for data that does not fit.

Batches: each epoch uses ``N // batch_size`` full batches; the remaining
``N % batch_size`` examples of that epoch's order are left out (each epoch draws a new
order, so every example is used over a run).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from meshensemble import data as data_lib
from meshensemble.core import steps
from meshensemble.core.backends import put
from meshensemble.core.distributed import fetch
from meshensemble.core.ensemble import Ensemble
from meshensemble.core.mesh import (
    ENSEMBLE,
    MEMBERS,
    REPLICATED,
    make_mesh,
    parse_mesh,
)
from meshensemble.core.state import EnsembleState
from meshensemble.metrics import prefix_metrics
from meshensemble.models import REGISTRY as MODEL_NAMES
from meshensemble.models.conv import CONV_CHOICES, resolve_conv
from meshensemble.training.checkpoint import Checkpointer

log = logging.getLogger("meshensemble")

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "warmup_cosine")
SHUFFLES = ("shared", "per-member")
PRECISIONS: dict[str, Any] = {"fp32": None, "bf16": jnp.bfloat16}
"""``TrainConfig.precision`` -> the ensemble's ``compute_dtype``."""
CONV_MODELS = ("cnn", "howto_cnn")
"""Models whose convolutions ``TrainConfig.conv`` picks."""
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"


@dataclasses.dataclass
class TrainConfig:
    """Everything a training run needs; the CLI's flags map one to one onto these fields.

    Defaults follow the Flax MNIST example (SGD 0.1 with momentum 0.9, batch 128,
    constant rate, 10 epochs), with an 8-member ensemble.

    Attributes:
      dataset: ``"mnist"`` or ``"fashion_mnist"``.
      source: ``"auto"``, ``"tfds"``, ``"npz"`` or ``"sample"`` (see
        :func:`meshensemble.data.load_dataset`).
      data_file: a Keras-layout ``.npz`` (for ``source="npz"`` or ``"auto"``).
      data_dir: TFDS data folder.
      model: ``"cnn"`` or ``"mlp"``.
      members: ensemble size.
      mesh: ``"ensemble=E,data=D"``; empty: all devices, ``ensemble = gcd(members,
        devices)`` and the rest on ``data``.
      backend: ``"shard_map"`` or ``"pmap"``.
      member_strategy: ``"auto"``, ``"vmap"`` or ``"loop"``.
      conv: how the CNN computes its convolutions (``cnn`` and ``howto_cnn`` only):
        ``"auto"`` (im2col matmuls on CPU, XLA's convolution elsewhere), ``"xla"``,
        ``"im2col"`` or ``"canonical"``; see :mod:`meshensemble.models.conv`.
      precision: ``"fp32"``, or ``"bf16"`` for mixed precision (bfloat16 compute,
        float32 master weights and optimizer state; for accelerators).
      epochs: epochs to train.
      batch_size: global batch size (every member sees this many examples a step).
      optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"``.
      learning_rate: peak learning rate.
      momentum: SGD momentum (0 for none).
      weight_decay: decoupled weight decay (adamw) or L2 added to the SGD/adam update.
      schedule: ``"constant"``, ``"cosine"`` or ``"warmup_cosine"`` (warm-up of
        ``warmup_epochs``).
      warmup_epochs: warm-up length for ``warmup_cosine``.
      shuffle: ``"shared"`` (all members see the same batches, as in the Flax HOWTO) or
        ``"per-member"`` (each member its own order).
      seed: seeds initialisation and data order.
      max_steps: stop after this many steps of the whole run (then evaluate once); the
        learning-rate schedule still spans ``epochs``, so a run resumed with a larger
        ``max_steps`` continues exactly.
      chunk_steps: steps per compiled call (K); None: 1 on CPU, a whole epoch elsewhere.
      eval_batch_size: examples per evaluation call.
      streaming: feed host batches one step at a time instead of on-device data.
      workdir: where config, metrics, plots and checkpoints go.
      tensorboard: also write TensorBoard event files.
      checkpoint: save the state at each epoch end and at the end.
      checkpoint_every: also save every this many steps (at chunk boundaries).
      keep: how many checkpoints to keep (the newest).
      resume: resume from the workdir's newest good checkpoint when there is one.
      overwrite: start over in a workdir that holds a run (deletes its outputs).
      on_nonfinite: ``"stop"`` (raise, keeping the last good checkpoint) or ``"reinit"``
        (re-initialise only the members whose loss became NaN/inf).
      quiet: print only the final table.
    """

    dataset: str = "mnist"
    source: str = "auto"
    data_file: str | None = None
    data_dir: str | None = None
    model: str = "cnn"
    members: int = 8
    mesh: str = ""
    backend: str = "shard_map"
    member_strategy: str = "auto"
    conv: str = "auto"
    precision: str = "fp32"
    epochs: int = 10
    batch_size: int = 128
    optimizer: str = "sgd"
    learning_rate: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0
    schedule: str = "constant"
    warmup_epochs: float = 1.0
    shuffle: str = "shared"
    seed: int = 0
    max_steps: int | None = None
    chunk_steps: int | None = None
    eval_batch_size: int = 1000
    streaming: bool = False
    workdir: str = "runs/mnist"
    tensorboard: bool = False
    checkpoint: bool = True
    checkpoint_every: int | None = None
    keep: int = 3
    resume: bool = True
    overwrite: bool = False
    on_nonfinite: str = "stop"
    quiet: bool = False

    def validate(self) -> TrainConfig:
        """Checks every field; raises ``ValueError`` naming the bad value and what is allowed."""
        choices = {
            "dataset": data_lib.DATASETS,
            "source": data_lib.SOURCES,
            "optimizer": OPTIMIZERS,
            "schedule": SCHEDULES,
            "shuffle": SHUFFLES,
            "backend": ("shard_map", "pmap"),
            "member_strategy": ("auto", "vmap", "loop"),
            "conv": CONV_CHOICES,
            "precision": tuple(PRECISIONS),
            "model": tuple(MODEL_NAMES),
            "on_nonfinite": ("stop", "reinit"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not allowed; choose one of "
                    f"{', '.join(allowed)}"
                )
        for name in ("members", "epochs", "batch_size", "eval_batch_size"):
            _positive_int(name, getattr(self, name))
        _positive_int("keep", self.keep)
        for name in ("max_steps", "chunk_steps", "checkpoint_every"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate={self.learning_rate!r} must be a positive number")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum={self.momentum!r} must be in [0, 1)")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay!r} must be >= 0")
        if self.mesh:
            parse_mesh(self.mesh)
        if self.conv != "auto" and self.model not in CONV_MODELS:
            raise ValueError(
                f"conv={self.conv!r} applies to the models {', '.join(CONV_MODELS)}, not "
                f"model={self.model!r}; leave conv at 'auto'"
            )
        return self


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def make_optimizer(cfg: TrainConfig, total_steps: int, steps_per_epoch: int):
    """The optax optimizer a config asks for.

    Args:
      cfg: the run's config.
      total_steps: the run's length, for decaying schedules.
      steps_per_epoch: for the warm-up length.

    Returns:
      An ``optax.GradientTransformation``.

    Example:
      >>> tx = make_optimizer(TrainConfig(), total_steps=4690, steps_per_epoch=469)
    """
    lr: Any = cfg.learning_rate
    if cfg.schedule == "cosine":
        lr = optax.cosine_decay_schedule(cfg.learning_rate, max(total_steps, 1))
    elif cfg.schedule == "warmup_cosine":
        warmup = max(1, int(cfg.warmup_epochs * steps_per_epoch))
        lr = optax.warmup_cosine_decay_schedule(
            0.0, cfg.learning_rate, min(warmup, max(total_steps - 1, 1)), max(total_steps, 2)
        )
    if cfg.optimizer == "adamw":
        return optax.adamw(lr, weight_decay=cfg.weight_decay)
    base = optax.sgd(lr, cfg.momentum or None) if cfg.optimizer == "sgd" else optax.adam(lr)
    if cfg.weight_decay:
        return optax.chain(optax.add_decayed_weights(cfg.weight_decay), base)
    return base


def build_ensemble(cfg: TrainConfig, mesh: Mesh, num_train: int) -> Ensemble:
    """The :class:`meshensemble.Ensemble` a run's config describes, on ``mesh``.

    The learning-rate schedule spans ``cfg.epochs`` epochs of ``num_train`` examples (not
    ``max_steps``), so a run resumed with a larger ``max_steps`` continues exactly, and
    evaluation rebuilds the same optimizer-state structure.

    Args:
      cfg: the run's config.
      mesh: the mesh to run on (it may differ from the one the run was trained on).
      num_train: training examples, for the steps per epoch.

    Returns:
      The ensemble, with on-device normalisation of uint8 images.

    Example:
      >>> ens = build_ensemble(cfg, me.make_mesh(ensemble=8), num_train=60000)
    """
    from meshensemble.models import get_model

    steps_per_epoch = max(num_train // cfg.batch_size, 1)
    model = get_model(cfg.model)
    if cfg.model in CONV_MODELS:
        model = model.clone(conv=cfg.conv)
    return Ensemble(
        model,
        make_optimizer(cfg, cfg.epochs * steps_per_epoch, steps_per_epoch),
        cfg.members,
        mesh,
        backend=cfg.backend,
        member_strategy=cfg.member_strategy,
        input_transform=data_lib.normalize,
        compute_dtype=PRECISIONS[cfg.precision],
    )


def default_mesh_shape(members: int, devices: int) -> dict[str, int]:
    """The mesh a run uses when none is given: every device, members spread first.

    ``ensemble = gcd(members, devices)`` and ``data = devices / ensemble``.

    Example:
      >>> default_mesh_shape(8, 8), default_mesh_shape(1, 8), default_mesh_shape(8, 1)
      ({'ensemble': 8, 'data': 1}, {'ensemble': 1, 'data': 8}, {'ensemble': 1, 'data': 1})
    """
    e = math.gcd(members, devices)
    return {"ensemble": e, "data": devices // e}


def default_chunk_steps(platform: str, steps_per_epoch: int) -> int:
    """Steps per compiled call measured best on ``platform``.

    On CPU a train step inside a ``lax.scan`` body runs several times slower than as its
    own jitted call, so K=1 (asynchronous dispatch of on-device steps already hides the
    host); on accelerators a whole epoch per call removes the dispatch overhead.

    Example:
      >>> default_chunk_steps("cpu", 469), default_chunk_steps("gpu", 469)
      (1, 469)
    """
    return 1 if platform == "cpu" else steps_per_epoch


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
      ensemble: the :class:`meshensemble.Ensemble` that was trained.
      state: the final :class:`meshensemble.EnsembleState`.
      history: the records written to ``metrics.jsonl``.
      dataset: the data used.
      seconds: wall time of the run, compilation included.
      preempted: the run stopped on SIGTERM/SIGINT after saving a checkpoint.
    """

    ensemble: Ensemble
    state: EnsembleState
    history: list[dict[str, Any]]
    dataset: data_lib.Dataset
    seconds: float
    preempted: bool = False


def train(
    cfg: TrainConfig,
    dataset: data_lib.Dataset | None = None,
    echo: Callable[[str], None] | None = None,
) -> TrainResult:
    """Trains an ensemble as ``cfg`` says and writes the run's outputs to ``cfg.workdir``.

    Args:
      cfg: the run's config.
      dataset: data to use instead of loading ``cfg.dataset`` from ``cfg.source``.
      echo: where human-readable lines go (default ``print`` unless ``cfg.quiet``).

    Returns:
      A :class:`TrainResult`.

    Raises:
      ValueError: a bad config value (or :class:`meshensemble.data.DataError` for data).

    Example:
      >>> cfg = me.TrainConfig(epochs=1, source="sample", workdir="/tmp/run")
      >>> result = me.train.train(cfg)
      >>> result.history[-1]["test_ensemble_accuracy"]
    """
    cfg.validate()
    stop = _StopSignal.install()  # from the start: a SIGTERM during compilation counts too
    try:
        return _train(cfg, dataset, echo, stop)
    finally:
        stop.uninstall()


def _train(cfg, dataset, echo, stop) -> TrainResult:
    t0 = time.perf_counter()
    main = jax.process_index() == 0  # only process 0 prints and writes the run's files
    quiet = lambda s: None
    say = echo or (quiet if cfg.quiet or not main else print)
    tell = echo or (print if main else quiet)  # resumes, preemption: even when --quiet
    if dataset is None:
        dataset = data_lib.load_dataset(
            cfg.dataset, cfg.source, cfg.data_file, cfg.data_dir, log=say
        )
    n_train = len(dataset.train_labels)
    if cfg.batch_size > n_train:
        raise ValueError(
            f"batch_size={cfg.batch_size} is larger than the {n_train} training examples; "
            f"use --batch-size {n_train} or less"
        )
    mesh_shape = (
        parse_mesh(cfg.mesh) if cfg.mesh else default_mesh_shape(cfg.members, jax.device_count())
    )
    mesh = make_mesh(mesh_shape.get("ensemble"), mesh_shape.get("data", 1))
    steps_per_epoch = n_train // cfg.batch_size
    total_steps = cfg.epochs * steps_per_epoch
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    ens = build_ensemble(cfg, mesh, n_train)
    if cfg.batch_size % ens.data_size:
        raise ValueError(
            f"batch_size={cfg.batch_size} is not divisible by the mesh's data axis "
            f"({ens.data_size}); use a multiple of {ens.data_size}"
        )
    platform = mesh.devices.flat[0].platform
    k = cfg.chunk_steps or default_chunk_steps(platform, steps_per_epoch)
    k = min(k, steps_per_epoch)
    if steps_per_epoch % k:
        raise ValueError(
            f"chunk_steps={k} does not divide the {steps_per_epoch} steps of an epoch; "
            f"pick a divisor of {steps_per_epoch}"
        )

    resume = _resume_point(cfg, ens, dataset, tell)
    if jax.process_count() > 1:  # every process decided before process 0 writes anything
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("meshensemble: workdir checked")
    if main:
        _check_writable(cfg.workdir)
    if cfg.overwrite and main:
        _clear_run(cfg.workdir)
    writer = RunWriter(
        cfg.workdir,
        enabled=main,
        tensorboard=cfg.tensorboard,
        keep_until=None if resume is None else resume[2],
    )
    writer.write_config(cfg, dataset, mesh_shape, k, ens.member_strategy)
    say(
        f"ensemble: {cfg.members} x {cfg.model} on mesh ensemble={mesh.shape[ENSEMBLE]} x "
        f"data={ens.data_size} ({jax.device_count()} {platform} devices, "
        f"{ens.members_per_device} member(s)/device), backend={cfg.backend}, "
        f"strategy={ens.member_strategy}, {steps_per_epoch} steps/epoch, K={k}"
    )

    init_key, order_key = jax.random.split(jax.random.key(cfg.seed))
    loop = {"epoch": 1, "epoch_step": 0, "step": 0, "loss_sum": None, "loss_count": 0}
    if resume is None:
        state = ens.init(init_key, dataset.train_images[:1])
    else:
        state, loop, _ = resume
        tell(f"resumed from checkpoint {loop['step']} in {cfg.workdir} (epoch {loop['epoch']})")
    history = writer.history
    ckpt = Checkpointer(cfg.workdir, cfg.keep, echo=tell) if cfg.checkpoint else None
    feeder = _Feeder(ens, dataset, cfg, order_key, k, steps_per_epoch)
    guard = _NonFinite(ens, cfg, init_key, dataset.train_images[:1])
    add_loss = jax.jit(lambda acc, losses: acc + jnp.sum(losses, axis=0))
    loss_sum = (
        jnp.zeros((cfg.members,), jnp.float32)
        if loop["loss_sum"] is None
        else jnp.asarray(np.asarray(loop["loss_sum"], np.float32))
    )
    loss_sum = put(loss_sum, mesh, MEMBERS)
    epoch, epoch_step, step = loop["epoch"], loop["epoch_step"], loop["step"]
    loss_count = loop["loss_count"]
    if epoch_step == steps_per_epoch:
        epoch, epoch_step = epoch + 1, 0
    progress = _Progress(say, enabled=main and not cfg.quiet)
    saved_at = None
    try:
        while step < total_steps:
            if progress.bar is None:
                progress.start(epoch, cfg.epochs, steps_per_epoch, epoch_step)
            n = 1 if cfg.streaming else min(k, steps_per_epoch - epoch_step, total_steps - step)
            state, metrics = feeder.run(state, epoch, epoch_step, n)
            state = guard.check(state, metrics, step, say, ckpt)
            loss_sum = add_loss(loss_sum, metrics["loss"])
            loss_count += n
            step += n
            epoch_step += n
            progress.update(n, metrics)
            epoch_end = epoch_step == steps_per_epoch or step == total_steps
            if epoch_end:
                progress.close()
                state = guard.flush(state, step, say, ckpt)
                record = _evaluate_record(
                    ens, state, dataset, cfg, epoch, step, loss_sum, loss_count
                )
                loss_sum, loss_count = jnp.zeros_like(loss_sum), 0
                history.append(record)
                writer.write_metrics(record)
                say(_epoch_line(record, cfg.epochs, time.perf_counter() - t0))
            every = cfg.checkpoint_every
            due = epoch_end or (every and step // every > (step - n) // every)
            stopping = stop.requested(step)
            if ckpt is not None and (due or stopping):
                state = guard.flush(state, step, say, ckpt)
                position = {
                    "epoch": epoch,
                    "epoch_step": epoch_step,
                    "step": step,
                    "loss_sum": fetch(loss_sum).tolist(),
                    "loss_count": loss_count,
                }
                ckpt.save(step, state, position)
                saved_at = step
            if epoch_step == steps_per_epoch:
                epoch, epoch_step = epoch + 1, 0
            if stopping:
                progress.close()
                break
    finally:
        progress.close()
        if ckpt is not None:
            ckpt.close()
    seconds = time.perf_counter() - t0
    if stop.signal is not None:
        where = f"saved checkpoint {saved_at} in {ckpt.dir}" if saved_at else "no checkpoint"
        tell(f"stopped by {stop.signal} at step {step}: {where}; run the same command to resume")
        return TrainResult(ens, state, history, dataset, seconds, preempted=True)
    if main:
        writer.plots(history)
        writer.close()
    if history:
        say(final_table(history[-1]))
    say(f"done in {seconds:.1f}s; outputs in {cfg.workdir}")
    return TrainResult(ens, state, history, dataset, seconds)


def _check_writable(workdir: str) -> None:
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as err:
        raise ValueError(
            f"workdir {workdir} is not writable ({err.strerror or err}); pass a writable --workdir"
        ) from None


def _resume_point(cfg, ens, dataset, say):
    """The checkpoint to resume from, or None; refuses to clobber a run unless asked."""
    from meshensemble.training.checkpoint import list_checkpoints, restore_checkpoint

    held = [
        n
        for n in (CONFIG_FILE, METRICS_FILE, "checkpoints")
        if os.path.exists(os.path.join(cfg.workdir, n))
    ]
    if not held:
        return None
    if cfg.overwrite:
        return None
    if not cfg.resume:
        raise ValueError(
            f"workdir {cfg.workdir} holds a run ({', '.join(held)}); --no-resume would "
            "overwrite it: add --overwrite, or resume it, or use another --workdir"
        )
    if not list_checkpoints(cfg.workdir):
        raise ValueError(
            f"workdir {cfg.workdir} holds a run ({', '.join(held)}) but no checkpoint to "
            "resume from; add --overwrite to start over, or use another --workdir"
        )
    return restore_checkpoint(cfg.workdir, ens, dataset.train_images[:1], echo=say)


def _clear_run(workdir: str) -> None:
    import shutil

    shutil.rmtree(os.path.join(workdir, "checkpoints"), ignore_errors=True)
    shutil.rmtree(os.path.join(workdir, "tensorboard"), ignore_errors=True)
    for name in (CONFIG_FILE, METRICS_FILE, "learning_curves.png", "members.png"):
        path = os.path.join(workdir, name)
        if os.path.exists(path):
            os.remove(path)


class _StopSignal:
    """SIGTERM/SIGINT ask the loop to save at the next chunk boundary and stop."""

    def __init__(self):
        self.signal: str | None = None
        self._old: dict[int, Any] = {}

    @classmethod
    def install(cls) -> _StopSignal:
        import signal
        import threading

        stop = cls()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                stop._old[sig] = signal.signal(sig, stop._handle)
        return stop

    def _handle(self, signum, frame) -> None:
        import signal

        self.signal = signal.Signals(signum).name

    def requested(self, step: int) -> bool:
        """Whether to stop after ``step``; all processes agree (the runtime's max)."""
        flag = self.signal is not None
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            flag = bool(multihost_utils.process_allgather(np.int32(flag)).max())
            if flag and self.signal is None:
                self.signal = "a peer's signal"
        return flag

    def uninstall(self) -> None:
        import signal

        for sig, old in self._old.items():
            signal.signal(sig, old)


class _NonFinite:
    """Detects a non-finite loss per member, one chunk behind (so it never stalls).

    ``on_nonfinite="stop"`` raises :class:`NonFiniteError` naming the members and the
    step; ``"reinit"`` re-initialises only those members and goes on.
    """

    def __init__(self, ens, cfg, init_key, sample):
        self.ens, self.cfg, self.init_key, self.sample = ens, cfg, init_key, sample
        self.previous: tuple[int, jax.Array] | None = None

    def check(self, state, metrics, step, say, ckpt):
        previous, self.previous = self.previous, (step, metrics["loss"])
        return state if previous is None else self._inspect(state, *previous, say, ckpt)

    def flush(self, state, step, say, ckpt):
        previous, self.previous = self.previous, None
        return state if previous is None else self._inspect(state, *previous, say, ckpt)

    def _inspect(self, state, first_step, losses, say, ckpt):
        losses = fetch(losses)  # [n, members], already computed
        bad = ~np.isfinite(losses)
        if not bad.any():
            return state
        members = sorted(set(np.nonzero(bad)[1].tolist()))
        at = first_step + 1 + int(np.nonzero(bad.any(1))[0][0])
        if self.cfg.on_nonfinite == "reinit":
            say(f"non-finite loss in member(s) {members} at step {at}: re-initialising them")
            key = jax.random.fold_in(self.init_key, at)
            return _reinit_members(self.ens, state, members, key, self.sample)
        last = ckpt.mngr.latest_step() if ckpt is not None else None
        keep = f"the last good checkpoint is {last}" if last is not None else "no checkpoint"
        raise NonFiniteError(
            f"non-finite loss in member(s) {members} at step {at}; {keep}; lower the learning "
            "rate, or pass --on-nonfinite reinit to re-initialise only those members"
        )


class NonFiniteError(RuntimeError):
    """A member's loss became NaN or infinite."""


def _reinit_members(ens, state, members, key, sample):
    fresh = ens.init(key, sample)
    mask = np.zeros(state.num_members, bool)
    mask[members] = True
    pick = jax.jit(
        lambda new, old: jax.tree.map(
            lambda a, b: jnp.where(mask.reshape((-1,) + (1,) * (a.ndim - 1)), a, b), new, old
        )
    )
    return pick(fresh, state)


class _Feeder:
    """Runs K steps from on-device data, or one step from a host batch (streaming)."""

    def __init__(self, ens, dataset, cfg, order_key, k, steps_per_epoch):
        self.ens, self.cfg, self.k = ens, cfg, k
        self.batch = cfg.batch_size
        self.per_member = cfg.shuffle == "per-member"
        self.order_key = order_key
        self.n = len(dataset.train_labels)
        self.host = (dataset.train_images, dataset.train_labels)
        order_spec = MEMBERS if self.per_member else REPLICATED
        self._orders = jax.jit(
            self._draw,
            static_argnums=(1,),
            out_shardings=jax.sharding.NamedSharding(ens.mesh, order_spec),
        )
        self._epoch: tuple[int, jax.Array] | None = None
        if not cfg.streaming:
            self.images = put(dataset.train_images, ens.mesh, REPLICATED)
            self.labels = put(dataset.train_labels.astype(np.int32), ens.mesh, REPLICATED)
            stacked = {
                "loss": jax.sharding.PartitionSpec(None, ENSEMBLE),
                "accuracy": jax.sharding.PartitionSpec(None, ENSEMBLE),
                "ensemble_accuracy": REPLICATED,
                "ensemble_nll": REPLICATED,
            }
            self._chunks: dict[int, Callable[..., Any]] = {}
            self._make = lambda n: ens.build(
                ("chunk", n, self.batch, order_spec),
                lambda step_cfg: functools.partial(steps.train_chunk, step_cfg, n, self.batch),
                (MEMBERS, REPLICATED, REPLICATED, order_spec, REPLICATED),
                (MEMBERS, stacked),
                donate_argnums=(0,),
            )

    def _draw(self, epoch: jax.Array, members: int) -> jax.Array:
        key = jax.random.fold_in(self.order_key, epoch)
        if members:
            keys = jax.random.split(key, members)
            return jax.vmap(lambda kk: jax.random.permutation(kk, self.n))(keys)
        return jax.random.permutation(key, self.n)

    def order(self, epoch: int) -> jax.Array:
        """The epoch's order: ``[N]`` shared or ``[members, N]``; the same on any mesh."""
        if self._epoch is None or self._epoch[0] != epoch:
            members = self.cfg.members if self.per_member else 0
            self._epoch = (epoch, self._orders(jnp.int32(epoch), members))
        return self._epoch[1]

    def run(self, state, epoch: int, first: int, n: int):
        order = self.order(epoch)
        if self.cfg.streaming:
            host_order = fetch(order)
            idx = host_order[..., first * self.batch : (first + 1) * self.batch]
            x, y = self.host[0][idx], self.host[1][idx].astype(np.int32)
            state, metrics = self.ens.train_step(state, x, y)
            return state, jax.tree.map(lambda v: v[None], metrics)
        if n not in self._chunks:
            self._chunks[n] = self._make(n)
        return self._chunks[n](state, self.images, self.labels, order, jnp.int32(first))


def _evaluate_record(ens, state, dataset, cfg, epoch, step, loss_sum, loss_count):
    ev = ens.evaluate(state, dataset.test_images, dataset.test_labels, cfg.eval_batch_size)
    record: dict[str, Any] = {"epoch": epoch, "step": step}
    if loss_count:
        losses = fetch(loss_sum).astype(np.float64) / loss_count
        record["train_loss"] = [float(v) for v in losses]
        record["train_mean_member_loss"] = float(losses.mean())
    record.update(prefix_metrics(ev, "test"))
    return record


def _epoch_line(r: dict[str, Any], epochs: int, seconds: float) -> str:
    loss = r.get("train_mean_member_loss", float("nan"))
    return (
        f"epoch {r['epoch']}/{epochs} step {r['step']}: train loss {loss:.4f} | test ensemble "
        f"acc {100 * r['test_ensemble_accuracy']:.2f}% nll {r['test_ensemble_nll']:.4f} "
        f"ece {r['test_ensemble_ece']:.4f} | mean member acc "
        f"{100 * r['test_mean_member_accuracy']:.2f}% nll {r['test_mean_member_nll']:.4f} "
        f"| {seconds:.1f}s"
    )


def final_table(r: dict[str, Any]) -> str:
    """A text table of each member's and the ensemble's test metrics from a record.

    Args:
      r: a ``metrics.jsonl`` record.

    Returns:
      The table as one string.

    Example:
      >>> print(final_table(result.history[-1]))
    """
    head = f"{'':>10} {'accuracy':>9} {'nll':>8} {'brier':>8} {'ece':>8}"
    rows = [head, "-" * len(head)]
    for i, (a, n, b, e) in enumerate(
        zip(
            r["test_member_accuracy"],
            r["test_member_nll"],
            r["test_member_brier"],
            r["test_member_ece"],
        )
    ):
        rows.append(f"{'member ' + str(i):>10} {100 * a:8.2f}% {n:8.4f} {b:8.4f} {e:8.4f}")
    rows.append("-" * len(head))
    rows.append(
        f"{'mean':>10} {100 * r['test_mean_member_accuracy']:8.2f}% "
        f"{r['test_mean_member_nll']:8.4f} {r['test_mean_member_brier']:8.4f} "
        f"{r['test_mean_member_ece']:8.4f}"
    )
    rows.append(
        f"{'ensemble':>10} {100 * r['test_ensemble_accuracy']:8.2f}% "
        f"{r['test_ensemble_nll']:8.4f} {r['test_ensemble_brier']:8.4f} "
        f"{r['test_ensemble_ece']:8.4f}"
    )
    return "\n".join(rows)


class _Progress:
    """Live progress: a tqdm bar with the loss on a terminal, else a plain line per tenth."""

    def __init__(self, say: Callable[[str], None], enabled: bool):
        self.say = say
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.bar = None
        self._last: jax.Array | None = None
        self._plain: tuple[int, int, int, float] | None = None  # epoch, done, total, t0
        self._base = 0

    def start(self, epoch: int, epochs: int, total: int, initial: int = 0) -> None:
        if not self.enabled:
            return
        if self.tty:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total, initial=initial, desc=f"epoch {epoch}/{epochs}", leave=False
            )
        else:
            self.bar = True  # started
            self._plain = (epoch, initial, total, 0.0)
            self._base = initial

    def _loss(self) -> str:
        if self._last is None:
            return "n/a"
        local = [np.asarray(s.data) for s in self._last.addressable_shards]
        return f"{float(np.mean(local)):.4f}"

    def update(self, n: int, metrics: dict[str, jax.Array]) -> None:
        if self.bar is None:
            return
        if self._plain is not None:
            epoch, done, total, t0 = self._plain
            if not t0:  # the first chunk includes compilation: rates count from its end
                t0, self._base = time.perf_counter(), done + n
            tenth = max(1, total // 10)
            if (done + n) // tenth > done // tenth and done + n < total:
                rate = (done + n - self._base) / max(time.perf_counter() - t0, 1e-9)
                self.say(
                    f"  epoch {epoch}: step {done + n}/{total}, member loss {self._loss()}, "
                    f"{rate:.1f} steps/s"
                )
            self._plain = (epoch, done + n, total, t0)
        else:
            self.bar.update(n)
            if self._last is not None and self.bar.n % 5 < n:  # a step that has finished
                self.bar.set_postfix(loss=self._loss())
        self._last = metrics["loss"][-1]

    def close(self) -> None:
        if self.bar is not None and self.bar is not True:
            self.bar.close()
        self.bar = None
        self._plain = None


class RunWriter:
    """Writes a run's config, ``metrics.jsonl``, TensorBoard events and plots (process 0).

    Args:
      workdir: the run's folder (created).
      enabled: False in processes other than 0.
      tensorboard: also write TensorBoard event files (with ``tensorboardX``).
      keep_until: when resuming, the restored step: records after it are dropped from
        ``metrics.jsonl`` so no evaluation appears twice.
    """

    def __init__(
        self,
        workdir: str,
        enabled: bool = True,
        tensorboard: bool = False,
        keep_until: int | None = None,
    ):
        self.workdir = workdir
        self.enabled = enabled
        self.tb = None
        self.history: list[dict[str, Any]] = []
        self.metrics_path = os.path.join(workdir, METRICS_FILE)
        if keep_until is not None and os.path.exists(self.metrics_path):
            with open(self.metrics_path) as f:
                records = [json.loads(line) for line in f if line.strip()]
            self.history = [r for r in records if r["step"] <= keep_until]
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        with open(self.metrics_path, "w") as f:  # cut back to the restored step
            f.writelines(json.dumps(r) + "\n" for r in self.history)
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as err:
                raise ValueError(
                    "--tensorboard needs tensorboardX; pip install tensorboardX"
                ) from err
            self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write_config(self, cfg, dataset, mesh_shape, k, strategy) -> None:
        if not self.enabled:
            return
        resolved = dataclasses.asdict(cfg) | {
            "resolved": {
                "mesh": mesh_shape,
                "chunk_steps": k,
                "member_strategy": strategy,
                "conv": resolve_conv(cfg.conv) if cfg.model in CONV_MODELS else None,
                "data": dataset.note,
                "devices": jax.device_count(),
                "platform": jax.devices()[0].platform,
                "jax": jax.__version__,
            }
        }
        with open(os.path.join(self.workdir, CONFIG_FILE), "w") as f:
            json.dump(resolved, f, indent=2)

    def write_metrics(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for name, value in record.items():
                if isinstance(value, float):
                    self.tb.add_scalar(name, value, record["step"])
            self.tb.flush()

    def plots(self, history: list[dict[str, Any]]) -> None:
        if not self.enabled or not history:
            return
        from meshensemble import plots

        plots.learning_curves(history, os.path.join(self.workdir, "learning_curves.png"))
        plots.member_vs_ensemble(history[-1], os.path.join(self.workdir, "members.png"))

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
