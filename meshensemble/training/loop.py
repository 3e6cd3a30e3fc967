"""The training loop: :func:`train` sets a run up, resumes it, runs its chunks and evaluates.

A run in a workdir is resumed only when it is the same run (see
:mod:`meshensemble.training.identity`); everything is checked before the workdir
changes. The steps come from a :class:`~meshensemble.training.feeder.Feeder` (K steps per
compiled call from on-device data, or host batches); the position in the run is a
:class:`LoopPosition`, saved with every checkpoint.

Example:
  >>> cfg = me.TrainConfig(model="mlp", members=4, epochs=1, batch_size=32, source="npz",
  ...                      data_file="mnist.npz", workdir="runs/r")
  >>> result = me.training.train(cfg, echo=lambda line: None)   # no printed lines
  >>> import os
  >>> sorted(os.listdir("runs/r"))   # outputs.json: the figures, for --overwrite to remove
  ['checkpoints', 'compile.json', 'config.json', 'learning_curves.png', 'members.png',
   'metrics.jsonl', 'outputs.json']
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from meshensemble import data as data_lib
from meshensemble.core.ensemble import Ensemble
from meshensemble.core.mesh import describe_mesh, idle_devices
from meshensemble.core.sharding import model_axis_note
from meshensemble.core.state import EnsembleState
from meshensemble.core.tasks import Task
from meshensemble.models import get_model
from meshensemble.models.user import is_spec
from meshensemble.runtime.compilation import CompileLog, enable_compilation_cache
from meshensemble.runtime.distributed import fetch
from meshensemble.training.backbone import backbone_model_state, load_backbone, with_model_state
from meshensemble.training.calibrate import calibrate_finished_run
from meshensemble.training.checkpoint import Checkpointer
from meshensemble.training.config import TrainConfig
from meshensemble.training.feeder import Feeder
from meshensemble.training.guards import NonFiniteGuard, StopSignal
from meshensemble.training.monitor import Monitors
from meshensemble.training.outputs import (
    Progress,
    RunWriter,
    check_writable,
    clear_run,
    restore_nonfinite,
    strict_json,
    unfinished_run,
)
from meshensemble.training.pacing import Pacer
from meshensemble.training.plan import TrainPlan
from meshensemble.training.rundata import RunData
from meshensemble.training.setup import prepare, resolved_record, saved_run, with_task
from meshensemble.training.setup import run_keys as run_keys

AHEAD_OF_TIME = True
"""Whether a fresh run compiles its training chunk and its evaluation in threads while the
members' initialisation compiles (:meth:`~meshensemble.training.feeder.Feeder.compile_ahead`,
:meth:`~meshensemble.training.feeder.Feeder.compile_eval_ahead`)."""
SETTLE_EVERY = 64
"""Chunks whose losses a run keeps on device before adding the older ones on the host."""


def is_log_step(step: int, steps_per_epoch: int) -> bool:
    """Whether the learning curve gets a train-loss point at global ``step``: at most ten an
    epoch (every ``ceil(steps_per_epoch / 10)`` steps of it) and each epoch's end.

    Example:
      >>> [s for s in range(1, 13) if is_log_step(s, 6)]   # 6 steps an epoch: every step
      [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
      >>> [s for s in range(1, 27) if is_log_step(s, 13)]  # every 2nd step, and the ends
      [2, 4, 6, 8, 10, 12, 13, 15, 17, 19, 21, 23, 25, 26]
    """
    return (step % steps_per_epoch) % -(-steps_per_epoch // 10) == 0


@dataclasses.dataclass
class LoopPosition:
    """Where a run is: saved as the checkpoint's ``loop`` JSON and restored from it.

    Attributes:
      epoch: the current epoch, from 1.
      epoch_step: steps done in that epoch (``steps_per_epoch`` once it is complete).
      step: steps done in the whole run.
      loss_sum: the per-member sum of the train losses of this epoch so far, ``[members]``
        (host float32 while training, a list in JSON, None before the first step).
      loss_count: how many steps ``loss_sum`` and ``pending`` hold.
      curve: the learning curve's points not yet in a ``metrics.jsonl`` record: ``[step,
        [members] mean train loss since the previous point]`` at each :func:`is_log_step`.
      curve_sum, curve_count: the per-member loss sum (float32, a list in JSON) and steps
        since the last point.
      monitors: what early stopping and keep-best have seen
        (:class:`~meshensemble.training.monitor.Monitors`: best value, its step,
        evaluations since), so a resumed run decides as an uninterrupted one.
      pending: the ``(steps, first step, [n, members] device losses)`` of chunks not yet
        added to ``loss_sum`` (added on the host by :meth:`settle`, so summing compiles no
        program of its own; not saved).
      steps_per_epoch: the run's, for the curve's points (not saved; 0: no points).

    Example:
      >>> LoopPosition.from_json({"epoch": 2, "epoch_step": 0, "step": 469,
      ...                         "loss_sum": None, "loss_count": 0}).step
      469
    """

    epoch: int = 1
    epoch_step: int = 0
    step: int = 0
    loss_sum: Any = None
    loss_count: int = 0
    curve: list[Any] = dataclasses.field(default_factory=list)
    curve_sum: Any = None
    curve_count: int = 0
    monitors: dict[str, Any] = dataclasses.field(default_factory=dict)
    pending: list[Any] = dataclasses.field(default_factory=list, repr=False)
    steps_per_epoch: int = dataclasses.field(default=0, repr=False)

    def add(self, n: int, losses: Any) -> None:
        """Queues the ``n`` steps after :attr:`step` of a chunk (its losses stay on device)."""
        self.pending.append((n, self.step, losses))

    def settle(self, keep: int = 0) -> None:
        """Adds the pending chunk losses, all but the newest ``keep``, into ``loss_sum`` and
        the learning curve.

        Args:
          keep: how many of the newest chunks to leave pending (those may still run;
            fetching them would wait for them).
        """
        done = self.pending[: max(len(self.pending) - keep, 0)]
        if not done:
            return
        self.pending = self.pending[len(done) :]
        width = np.shape(done[0][2])[1:]
        held = lambda v: np.zeros(width, np.float32) if v is None else np.asarray(v, np.float32)
        total, part = held(self.loss_sum), held(self.curve_sum)
        for (n, first, _), losses in zip(done, fetch([d[2] for d in done])):
            for i, row in enumerate(np.asarray(losses, np.float32)[-n:]):  # the steps run
                total = total + row  # step by step: the same sums however the steps were split
                part, self.curve_count = part + row, self.curve_count + 1
                if self.steps_per_epoch and is_log_step(first + i + 1, self.steps_per_epoch):
                    mean = np.asarray(part, np.float64) / self.curve_count
                    self.curve.append([first + i + 1, [float(v) for v in mean]])
                    part, self.curve_count = np.zeros_like(part), 0
        self.loss_sum, self.curve_sum = total, part

    def to_json(self) -> dict[str, Any]:
        """The checkpoint's ``loop`` entry (``loss_sum`` as a list of floats), strict JSON:
        a NaN/inf loss (a re-initialised member's) is written as null with a note
        (:func:`~meshensemble.training.outputs.strict_json`)."""
        self.settle()
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del out["pending"], out["steps_per_epoch"]
        for name in ("loss_sum", "curve_sum"):
            if out[name] is not None:
                out[name] = [float(v) for v in np.asarray(out[name], np.float32)]
        return strict_json(out)

    @classmethod
    def from_json(cls, loop: dict[str, Any]) -> LoopPosition:
        """Reads a checkpoint's ``loop`` entry (keys it does not know are ignored; noted
        non-finite values come back as NaN/inf)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"pending", "steps_per_epoch"}
        return cls(**{k: v for k, v in restore_nonfinite(loop).items() if k in names})


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
      signal: what stopped it: ``"SIGINT"``, ``"SIGTERM"``, ``"a peer's signal"``, or None
        (the command line exits 130 after a SIGINT, 0 otherwise).
      compile: what the run compiled
        (:meth:`meshensemble.runtime.compilation.CompileLog.summary`, also in the workdir's
        ``compile.json``).
    """

    ensemble: Ensemble
    state: EnsembleState
    history: list[dict[str, Any]]
    dataset: data_lib.Dataset
    seconds: float
    preempted: bool = False
    compile: dict[str, Any] = dataclasses.field(default_factory=dict)
    signal: str | None = None


def train(
    cfg: TrainConfig,
    dataset: data_lib.Dataset | None = None,
    echo: Callable[[str], None] | None = None,
    *,
    source: Any = None,
    task: Task | type[Task] | None = None,
) -> TrainResult:
    """Trains an ensemble as ``cfg`` says and writes the run's outputs to ``cfg.workdir``.

    One loop for every task: the task (``cfg.task``, or ``task``) says what the members
    output and learn, what a step reports and an evaluation scores, and how the run is
    reported; everything else is the same for all (K-step chunks from on-device data or a
    streamed input, bagging, augmentation, the compilation cache and log, the auto-tuner,
    ahead-of-time compilation, pacing, the non-finite guard, the stop signal, resuming).

    With ``cfg.compile_cache`` (the default) JAX's persistent compilation cache is turned
    on first (:func:`use_compilation_cache`: this sets JAX's global cache options for the
    whole process); every compilation of the run is logged, printed in one line after the
    first evaluation and written to ``compile.json`` in the workdir. With
    ``member_strategy``/``conv`` at ``auto`` and ``cfg.autotune``, the candidates are
    timed first (:mod:`meshensemble.training.tuning`), each with the run's own chunk
    program; the run then trains with the chosen one's, compiled once.

    A workdir that holds a run is resumed from its newest good checkpoint, but only
    when it is the same run: the fields of
    :data:`~meshensemble.training.identity.RUN_FIELDS` and the data actually used must
    match what its ``config.json`` recorded. ``max_steps`` belongs to one call: a
    later call with a larger value (or none) continues the run. A new run that fails
    before its first checkpoint removes the files it wrote
    (:func:`~meshensemble.training.outputs.unfinished_run`); a resumed one never does.

    Args:
      cfg: the run's config.
      dataset: data to use instead of loading it from ``cfg``'s data settings.
      echo: where human-readable lines go (default ``print`` on process 0; with
        ``cfg.quiet`` only the final table and the lines about resuming, stopping or
        re-initialising members).
      source: for a streamed run (``cfg.input``), where the training examples are read
        (a :mod:`meshensemble.data.stream` source, e.g. ArrayRecord files, holding the
        examples of ``dataset``'s train split in the same order); default those arrays.
      task: a :class:`meshensemble.tasks.Task` (instance or class) to train instead of
        ``cfg.task``'s; the run records it (its registered name, else ``module:Class``,
        which ``evaluate``/``predict``/``export`` import again).

    Returns:
      A :class:`TrainResult`.

    Raises:
      ValueError: a bad config value, a workdir that is not writable, or a workdir that
        holds another run (one line naming the difference and the fixes); data the task
        refuses; :class:`meshensemble.data.DataError` for data.
      meshensemble.training.NonFiniteError: a member's loss became NaN/inf
        (``on_nonfinite="stop"``).
      meshensemble.CheckpointError: a checkpoint could not be written.
      meshensemble.training.outputs.OutputError: an output file could not be written.

    Example:
      >>> cfg = me.TrainConfig(model="mlp", members=4, epochs=1, batch_size=32, source="npz",
      ...                      data_file="mnist.npz", workdir="runs/run", quiet=True)
      >>> result = me.training.train(cfg)
      accuracy nll brier ece
      ...
      >>> 0 <= result.history[-1]["test_ensemble_accuracy"] <= 1
      True
    """
    cfg, task = with_task(cfg, task)
    cfg.validate()
    monitors = Monitors.from_config(cfg, task)  # a metric the task does not log: one line
    if is_spec(cfg.model):
        get_model(cfg.model)  # a user's module that does not import: one line, before the data
    stop = StopSignal.install()  # from the start: a SIGTERM during compilation counts too
    try:
        cache_dir = use_compilation_cache(cfg)
        with CompileLog() as log:
            return _train(cfg, dataset, echo, stop, log, cache_dir, source, task, monitors)
    finally:
        stop.uninstall()


def use_compilation_cache(cfg: TrainConfig) -> str | None:
    """Sets JAX's persistent compilation cache as ``cfg`` says, for the whole process.

    With ``cfg.compile_cache`` the cache is enabled in ``cfg.compile_cache_dir`` (default
    :func:`meshensemble.runtime.compilation.default_cache_dir`, which honours
    ``$JAX_COMPILATION_CACHE_DIR``) for every program, small ones included; without, JAX's
    cache is disabled. These are JAX's global options: they stay set after the run. A
    change of folder or of on/off takes effect at once (JAX's cache is re-initialised).

    Args:
      cfg: the run's config.

    Returns:
      The cache folder in use, or None (off, or the folder cannot be written: the run
      then compiles as usual).

    Example:
      >>> from meshensemble.runtime.compilation import default_cache_dir
      >>> use_compilation_cache(me.TrainConfig()) == default_cache_dir()  # the default
      True
    """
    now = lambda: (jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)
    before = now()
    path = enable_compilation_cache(cfg.compile_cache_dir) if cfg.compile_cache else None
    if path is not None or not cfg.compile_cache:  # a folder it cannot write: left as it was
        jax.config.update("jax_enable_compilation_cache", path is not None)
    if now() != before:
        compilation_cache.reset_cache()  # JAX reads its options once: make it read them again
    return path


def _train(cfg, dataset, echo, stop, log, cache_dir, source, task, monitors) -> TrainResult:
    """:func:`train`'s run, given its arguments, stop signal, compile log and watches."""
    t0 = time.perf_counter()
    main = jax.process_index() == 0  # only process 0 prints and writes the run's files
    quiet = lambda s: None
    say = echo or (quiet if cfg.quiet or not main else print)
    tell = echo or (print if main else quiet)  # final table, resumes, stops: even when quiet
    check_writable(cfg.workdir)  # before any work
    saved = saved_run(cfg)
    setup = prepare(cfg, dataset, saved, task, source, cache_dir, say, tell)
    ens, plan, choice = setup.ens, setup.plan, setup.choice
    sample, restored = setup.sample, setup.restored
    if jax.process_count() > 1:  # every process decided before process 0 writes anything
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("meshensemble: workdir checked")
    if cfg.overwrite and main:  # only process 0 clears, after every process checked
        clear_run(cfg.workdir)
    resolved = resolved_record(
        plan, choice.resolved(), cache_dir, setup.data, ens.task, cfg, sample
    )
    keep_until = None if restored is None else restored[2]
    held = (restored[1].get("monitors") or {}) if restored is not None else {}
    if monitors.best_record(held) is not None:  # a resumed run names its best so far
        resolved["keep_best"] = monitors.best_record(held)
    with unfinished_run(cfg.workdir, fresh=restored is None, enabled=main):
        writer = RunWriter(
            cfg.workdir, enabled=main, tensorboard=cfg.tensorboard, keep_until=keep_until
        )
        writer.write_config(cfg, resolved)
        say(_ensemble_line(cfg, ens, plan, jax.devices()[0].platform))
        for line in choice.lines() if choice.how != "given" else ():
            say(line)
        feeder = choice.feeder or setup.feeder_for(ens)  # the tuner's: its chunk compiled
        say(feeder.input_why)
        init_key, train = setup.init_key, setup.data.train
        state, pos = _start(cfg, ens, feeder, train, restored, init_key, sample, tell)
        note = model_axis_note(ens, state, sample)  # a model axis that splits nothing
        if note is not None:
            tell(note)
        pinning = monitors.best is not None  # keep-best: the best is never deleted
        ckpt = Checkpointer(cfg.workdir, cfg.keep, tell, pinning) if cfg.checkpoint else None
        guard = NonFiniteGuard(ens, cfg.on_nonfinite, init_key, sample)
        data = setup.data
        run = _Run(cfg, ens, data, feeder, guard, ckpt, writer, stop, say, tell, t0, log, plan)
        run.monitors, run.resolved = monitors, resolved
        run.pacer = Pacer(1 if feeder.streaming else plan.chunk, cfg.stop_within)
        try:
            state, pos, saved_at = run.loop(state, pos, main)
        finally:
            if ckpt is not None:
                ckpt.close()
        return _finish(cfg, run, state, pos, saved_at)


def _ensemble_line(cfg: TrainConfig, ens: Ensemble, plan: TrainPlan, platform: str) -> str:
    """The line describing the ensemble, its mesh and its chunk (under 120 characters for
    the zoo's models; the rest is in ``config.json``'s ``resolved`` entry)."""
    idle = idle_devices(ens.mesh)
    backend = "" if cfg.backend == "shard_map" else f", backend {cfg.backend}"
    return (
        f"ensemble: {cfg.members} x {cfg.model}, mesh {describe_mesh(ens.mesh)} on "
        f"{jax.device_count()} {platform}{f' ({idle} idle)' if idle else ''}, "
        f"{ens.members_per_device}/device{backend}; {plan.steps_per_epoch} steps/epoch, "
        f"K={plan.chunk}"
    )


def _start(
    cfg: TrainConfig,
    ens: Ensemble,
    feeder: Feeder,
    dataset: Any,
    restored: Any,
    init_key: jax.Array,
    sample: Any,
    tell: Callable[[str], None],
) -> tuple[EnsembleState, LoopPosition]:
    """The state and position the loop starts from: initialised, or restored."""
    if restored is not None:
        state, pos = restored[0], LoopPosition.from_json(restored[1])
        feeder.restore_input(restored[1])
        tell(f"resumed from checkpoint {pos.step} in {cfg.workdir} (epoch {pos.epoch})")
        return state, pos
    if AHEAD_OF_TIME:  # the chunk compiles in a thread while the initialisation does
        init = lambda: ens.init(init_key, sample)
        feeder.compile_ahead(init)
        feeder.compile_eval_ahead(init, dataset.x_test, dataset.y_test, cfg.eval_batch_size)
    if not cfg.backbone:
        return ens.init(init_key, sample), LoopPosition()
    state = ens.init(init_key, sample, params=load_backbone(cfg.backbone))
    stats = backbone_model_state(cfg.backbone, ens.model, ens.input_transform, sample)
    return with_model_state(state, stats), LoopPosition()  # BatchNorm's statistics too


def _finish(
    cfg: TrainConfig, run: _Run, state: EnsembleState, pos: LoopPosition, saved_at: Any
) -> TrainResult:
    """Writes the compile log and the task's figures and final table (or says where a stop
    left the run)."""
    say, tell, writer, ckpt, task = run.say, run.tell, run.writer, run.ckpt, run.ens.task
    seconds = time.perf_counter() - run.t0
    compiled = run.log.summary()
    if not run.compile_reported:
        say(run.log.line())
    writer.write_compile(compiled)
    history = writer.history
    train = run.data.train  # the examples trained on (and the test split)
    if run.monitors.stopping(pos.monitors):
        tell(run.monitors.stop_line(pos.monitors, pos.step))
    elif run.stopped or run.stop.signal is not None:
        saved = saved_at is not None and ckpt is not None
        where = f"saved checkpoint {saved_at} in {cfg.workdir}" if saved else "no checkpoint"
        signal = run.stop.signal or "a stop request"
        tell(f"stopped by {signal} at step {pos.step}: {where}; run the same command to resume")
        return TrainResult(run.ens, state, history, train, seconds, True, compiled, signal)
    predict = lambda x: fetch((run.ens.predict(state, x), run.ens.predict_members(state, x)))
    writer.figures(task.run_figures(history, predict, (train.x_train, train.y_train)))
    writer.close()
    table = task.final_table(history[-1]) if history else ""
    if table:
        tell(table)
    step = pos.step if ckpt is not None else None  # the last step is always saved (or restored)
    last = history[-1] if history else {}
    calibrated = calibrate_finished_run(cfg, run.ens, state, step, run.data, last, say)
    best = run.monitors.best_line(pos.monitors)  # said even when quiet
    (tell if best else say)(f"done in {seconds:.1f}s; outputs in {cfg.workdir}{best}")
    if calibrated:  # the task's own calibration (or why there is none): the run's last line
        tell(calibrated)
    return TrainResult(run.ens, state, history, train, seconds, False, compiled)


@dataclasses.dataclass
class _Run:
    """The pieces the run loop needs (built by :func:`train`)."""

    cfg: TrainConfig
    ens: Ensemble
    data: RunData
    feeder: Feeder
    guard: NonFiniteGuard
    ckpt: Checkpointer | None
    writer: RunWriter
    stop: StopSignal
    say: Callable[[str], None]
    tell: Callable[[str], None]
    t0: float
    log: CompileLog
    plan: TrainPlan
    compile_reported: bool = False
    stopped: bool = False
    pacer: Pacer = dataclasses.field(default_factory=lambda: Pacer(1, 0.0))
    monitors: Monitors = dataclasses.field(default_factory=Monitors)
    resolved: dict[str, Any] = dataclasses.field(default_factory=dict)

    def last_checkpoint(self) -> int | None:
        return self.ckpt.mngr.latest_step() if self.ckpt is not None else None

    def calls(self, pos: LoopPosition) -> int:
        """The steps of the next call: up to K, the epoch's end, a checkpoint step, the
        run's end, cut to honour ``stop_within`` (one when streaming)."""
        cfg, plan = self.cfg, self.plan
        n = min(plan.chunk, plan.steps_per_epoch - pos.epoch_step, plan.total_steps - pos.step)
        if cfg.checkpoint_every:  # a checkpoint step ends a call
            n = min(n, cfg.checkpoint_every - pos.step % cfg.checkpoint_every)
        return 1 if self.feeder.streaming else self.pacer.count(n)  # within stop_within

    def loop(self, state, pos: LoopPosition, main):
        """Runs chunks until the run's end or a stop signal; returns the state, position
        and the step of the last checkpoint saved (or None)."""
        cfg, guard, plan, steps = self.cfg, self.guard, self.plan, self.plan.steps_per_epoch
        zeros = np.zeros((cfg.members,), np.float32)
        pos.loss_sum = zeros if pos.loss_sum is None else np.asarray(pos.loss_sum, np.float32)
        pos.steps_per_epoch, watch = steps, self.monitors
        if pos.epoch_step == steps:
            pos.epoch, pos.epoch_step = pos.epoch + 1, 0
        progress = Progress(self.say, enabled=main and not cfg.quiet)
        saved_at = None
        try:
            while pos.step < plan.total_steps and not watch.stopping(pos.monitors):
                if not progress.started:
                    progress.start(pos.epoch, cfg.epochs, steps, pos.epoch_step)
                n = self.calls(pos)
                started = self.pacer.start()
                state, metrics = self.feeder.run(state, pos.epoch, pos.epoch_step, n)
                self.pacer.observe(n, metrics["loss"], started)
                state = guard.check(
                    state, metrics, pos.step, self.tell, self.last_checkpoint, steps=n
                )
                pos.add(n, metrics["loss"])  # summed on the host, never waited for
                if len(pos.pending) > SETTLE_EVERY:
                    pos.settle(keep=2)
                pos.loss_count += n
                pos.step += n
                pos.epoch_step += n
                progress.update(n, metrics)
                epoch_done = pos.epoch_step == steps
                periodic = epoch_done and pos.epoch % plan.eval_every == 0
                evaluated = pos.step == plan.total_steps or periodic
                if evaluated:
                    progress.close()
                    state = guard.flush(state, self.tell, self.last_checkpoint)
                    # not scheduled: the extra evaluation of a --max-steps stop
                    self.evaluate(state, pos, pos.step == cfg.epochs * steps or periodic)
                if epoch_done:  # a split epoch keeps its sum: its record covers it all
                    pos.loss_sum, pos.loss_count, pos.pending = np.zeros_like(pos.loss_sum), 0, []
                    progress.close()
                every = cfg.checkpoint_every
                due = evaluated or (every and pos.step // every > (pos.step - n) // every)
                stopping = self.stop.requested(pos.step)  # once per call, never per step
                if self.ckpt is not None and (due or stopping):
                    state = guard.flush(state, self.tell, self.last_checkpoint)  # never unchecked
                    pinned = [s for s in [watch.best_step(pos.monitors)] if s is not None]
                    loop = {**pos.to_json(), **self.feeder.input_state()}
                    self.ckpt.save(pos.step, state, loop, pinned=pinned)
                    saved_at = pos.step
                    self.name_best(pos)
                if epoch_done:
                    pos.epoch, pos.epoch_step = pos.epoch + 1, 0
                if stopping or watch.stopping(pos.monitors):
                    self.stopped = stopping  # a stop request, not early stopping
                    break
        finally:
            progress.close()
        return state, pos, saved_at

    def name_best(self, pos: LoopPosition) -> None:
        """Rewrites ``config.json`` when the best checkpoint kept changed (``keep_best``)."""
        held = self.monitors.best_record(pos.monitors)
        if held is not None and held != self.resolved.get("keep_best"):
            self.resolved["keep_best"] = held
            self.writer.write_config(self.cfg, self.resolved)

    def evaluate(self, state: EnsembleState, pos: LoopPosition, scheduled: bool = True) -> None:
        """Evaluates on the test split (and the validation split, when held out) and writes
        the record: the train loss of the epoch so far, the learning curve's points since
        the last record and, at a ``scheduled`` evaluation, what the watches decided."""
        cfg, task, test = self.cfg, self.ens.task, self.data.dataset
        record: dict[str, Any] = {"epoch": pos.epoch, "step": pos.step}
        pos.settle()
        if pos.loss_count:
            losses = np.asarray(pos.loss_sum, np.float64) / pos.loss_count
            record["train_loss"] = [float(v) for v in losses]
            record["train_mean_member_loss"] = float(losses.mean())
        if pos.curve:
            record["train_curve"] = {"step": [p[0] for p in pos.curve],
                                     "loss": [p[1] for p in pos.curve]}  # fmt: skip
            pos.curve = []
        sets = {"test": (test.x_test, test.y_test)}
        if self.data.validation is not None:
            sets["val"] = self.data.validation
        for name, (x, y) in sets.items():
            scores = self.ens.evaluate(state, x, y, cfg.eval_batch_size)
            record.update(task.record_scores(scores, name))
        if scheduled and self.monitors.active:  # the same replicated scores on every process
            pos.monitors = self.monitors.update(pos.monitors, record, pos.step)
            record.update({k: dict(v) for k, v in pos.monitors.items()})
        self.writer.history.append(record)
        self.writer.write_metrics(record)
        self.say(task.epoch_line(record, cfg.epochs, time.perf_counter() - self.t0))
        if not self.compile_reported:  # the run's programs are all compiled by now
            self.compile_reported = True
            self.say(self.log.line())
            self.writer.write_compile(self.log.summary())
