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
  >>> sorted(os.listdir("runs/r"))
  ['checkpoints', 'compile.json', 'config.json', 'learning_curves.png', 'members.png',
   'metrics.jsonl']
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from meshensemble import data as data_lib
from meshensemble.core.derive import member_params
from meshensemble.core.ensemble import Ensemble
from meshensemble.core.layout import given_values
from meshensemble.core.mesh import describe_mesh, idle_devices, make_mesh
from meshensemble.core.sharding import model_axis_note
from meshensemble.core.state import EnsembleState
from meshensemble.data.split import split_validation
from meshensemble.metrics import prefix_metrics
from meshensemble.runtime.compilation import CompileLog, enable_compilation_cache
from meshensemble.runtime.distributed import fetch
from meshensemble.training.backbone import load_backbone
from meshensemble.training.checkpoint import (
    CHECKPOINT_DIR,
    Checkpointer,
    list_checkpoints,
    restore_checkpoint,
)
from meshensemble.training.config import (
    CONFIG_FILE,
    METRICS_FILE,
    TrainConfig,
    build_ensemble,
)
from meshensemble.training.feeder import Feeder, check_lazy_input
from meshensemble.training.guards import NonFiniteGuard, StopSignal
from meshensemble.training.identity import (
    agree_data,
    check_same_run,
    data_identity,
    read_saved_config,
    run_fields,
)
from meshensemble.training.outputs import (
    Progress,
    RunWriter,
    check_writable,
    clear_run,
    epoch_line,
    final_table,
    restore_nonfinite,
    strict_json,
    unfinished_run,
)
from meshensemble.training.pacing import Pacer
from meshensemble.training.plan import TrainPlan, plan_training
from meshensemble.training.tuning import concrete, resolve_choices

AHEAD_OF_TIME = True
"""Whether a fresh run compiles its training chunk and its evaluation in threads while the
members' initialisation compiles (:meth:`~meshensemble.training.feeder.Feeder.compile_ahead`,
:meth:`~meshensemble.training.feeder.Feeder.compile_eval_ahead`)."""
SETTLE_EVERY = 64
"""Chunks whose losses a run keeps on device before adding the older ones on the host."""


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
      pending: the ``[n, members]`` device losses of chunks not yet added to ``loss_sum``
        (added on the host by :meth:`settle`, so summing compiles no program of its own;
        not saved).

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
    pending: list[Any] = dataclasses.field(default_factory=list, repr=False)

    def settle(self, keep: int = 0) -> None:
        """Adds the pending chunk losses, all but the newest ``keep``, into ``loss_sum``.

        Args:
          keep: how many of the newest chunks to leave pending (those may still run;
            fetching them would wait for them).
        """
        done = self.pending[: max(len(self.pending) - keep, 0)]
        if not done:
            return
        self.pending = self.pending[len(done) :]
        total = np.zeros(np.shape(done[0])[1:], np.float32)
        total = total if self.loss_sum is None else np.asarray(self.loss_sum, np.float32)
        for losses in fetch(done):
            for row in np.asarray(losses, np.float32):  # step by step: the same sum however
                total = total + row  # the steps were split into calls (zero rows add 0)
        self.loss_sum = total

    def to_json(self) -> dict[str, Any]:
        """The checkpoint's ``loop`` entry (``loss_sum`` as a list of floats), strict JSON:
        a NaN/inf loss (a re-initialised member's) is written as null with a note
        (:func:`~meshensemble.training.outputs.strict_json`)."""
        self.settle()
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del out["pending"]
        if self.loss_sum is not None:
            out["loss_sum"] = [float(v) for v in np.asarray(self.loss_sum, np.float32)]
        return strict_json(out)

    @classmethod
    def from_json(cls, loop: dict[str, Any]) -> LoopPosition:
        """Reads a checkpoint's ``loop`` entry (keys it does not know are ignored; noted
        non-finite values come back as NaN/inf)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"pending"}
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
) -> TrainResult:
    """Trains an ensemble as ``cfg`` says and writes the run's outputs to ``cfg.workdir``.

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
      dataset: data to use instead of loading ``cfg.dataset`` from ``cfg.source``.
      echo: where human-readable lines go (default ``print`` on process 0; with
        ``cfg.quiet`` only the final table and the lines about resuming, stopping or
        re-initialising members).
      source: for a streamed run (``cfg.input``), where the training examples are read
        (a :mod:`meshensemble.data.stream` source, e.g. ArrayRecord files, holding the
        examples of ``dataset``'s train split in the same order); default those arrays.

    With ``cfg.task == "regression"`` the run is
    :func:`meshensemble.training.regression_run.train_regression`'s (Gaussian members on
    float targets, see docs/regression.md).

    Returns:
      A :class:`TrainResult` (a
      :class:`~meshensemble.training.regression_run.RegressionResult` for regression).

    Raises:
      ValueError: a bad config value, a workdir that is not writable, or a workdir that
        holds another run (one line naming the difference and the fixes);
        :class:`meshensemble.data.DataError` for data.
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
    cfg.validate()
    if cfg.task == "regression":  # the Gaussian regression run (--task regression)
        from meshensemble.training import regression_run

        return regression_run.train_regression(cfg, echo)
    stop = StopSignal.install()  # from the start: a SIGTERM during compilation counts too
    try:
        cache_dir = use_compilation_cache(cfg)
        with CompileLog() as log:
            return _train(cfg, dataset, echo, stop, log, cache_dir, source)
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
    before = (jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)
    path = None
    if cfg.compile_cache:
        path = enable_compilation_cache(cfg.compile_cache_dir)
    if path is not None:
        jax.config.update("jax_enable_compilation_cache", True)
    elif not cfg.compile_cache:
        jax.config.update("jax_enable_compilation_cache", False)
    after = (jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)
    if after != before:
        compilation_cache.reset_cache()  # JAX reads its options once: make it read them again
    return path


@jax.jit
def _split_seed(seed: jax.Array) -> tuple[jax.Array, jax.Array]:
    init_key, order_key = jax.random.split(jax.random.key(seed))
    return init_key, order_key


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
    init_key, order_key = jax.random.split(jax.random.key(seed))
    return init_key, order_key


def _held(workdir: str) -> list[str]:
    names = (CONFIG_FILE, METRICS_FILE, CHECKPOINT_DIR)
    return [n for n in names if os.path.exists(os.path.join(workdir, n))]


def _saved_run(cfg: TrainConfig) -> dict[str, Any] | None:
    """The saved config of the run to resume, or None to start afresh; refuses to clobber."""
    held = _held(cfg.workdir)
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


def _train(
    cfg: TrainConfig, dataset, echo, stop: StopSignal, log, cache_dir, source=None
) -> TrainResult:
    t0 = time.perf_counter()
    main = jax.process_index() == 0  # only process 0 prints and writes the run's files
    quiet = lambda s: None
    say = echo or (quiet if cfg.quiet or not main else print)
    tell = echo or (print if main else quiet)  # final table, resumes, stops: even when quiet
    check_writable(cfg.workdir)  # before any work
    saved = _saved_run(cfg)
    dataset, identity, held_out = _training_data(cfg, dataset, saved, say)
    platform = jax.devices()[0].platform
    plan = plan_training(cfg, len(dataset.train_labels), jax.device_count(), platform)
    mesh = make_mesh(**plan.mesh)
    init_key, order_key = run_keys(cfg.seed)
    recorded = saved.get("resolved") if saved is not None else None
    feeder_for = lambda e: Feeder(  # the run's feeder of an ensemble: the tuner times it
        e, dataset, cfg, order_key, plan.chunk, plan.steps_per_epoch, source=source
    )
    choice = resolve_choices(cfg, mesh, dataset, init_key, cache_dir, recorded, feeder=feeder_for)
    sample = dataset.train_images[:1]
    ens = choice.ensemble or build_ensemble(
        concrete(cfg, choice.member_strategy, choice.conv), mesh, len(dataset.train_labels), sample
    )
    restored = None
    if saved is not None:
        restored = restore_checkpoint(cfg.workdir, ens, sample, echo=tell)
        _check_not_past_the_end(cfg, int(restored[2]), plan.steps_per_epoch)
    elif cfg.backbone:  # a backbone that does not fit is refused before anything is written
        shapes = member_params(ens.model, ens.input_transform, sample)
        what, shared = f"--backbone {cfg.backbone}", ens.layout.shared_mask(shapes)
        given_values(shapes, load_backbone(cfg.backbone), shared, 1, what)
    if jax.process_count() > 1:  # every process decided before process 0 writes anything
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("meshensemble: workdir checked")
    if cfg.overwrite and main:
        clear_run(cfg.workdir)
    resolved = _resolved(plan, choice.resolved(), cache_dir, dataset, identity, held_out)
    keep_until = None if restored is None else restored[2]
    with unfinished_run(cfg.workdir, fresh=restored is None, enabled=main):
        writer = RunWriter(
            cfg.workdir, enabled=main, tensorboard=cfg.tensorboard, keep_until=keep_until
        )
        writer.write_config(cfg, resolved)
        say(_ensemble_line(cfg, ens, plan, platform))
        for line in choice.lines() if choice.how != "given" else ():
            say(line)
        feeder = choice.feeder or feeder_for(ens)  # the tuner's: its chunk already compiled
        say(feeder.input_why)
        state, pos = _start(cfg, ens, feeder, dataset, restored, init_key, sample, tell)
        note = model_axis_note(ens, state, sample)  # a model axis that splits nothing
        if note is not None:
            tell(note)
        ckpt = Checkpointer(cfg.workdir, cfg.keep, echo=tell) if cfg.checkpoint else None
        guard = NonFiniteGuard(ens, cfg.on_nonfinite, init_key, sample)
        run = _Run(cfg, ens, dataset, feeder, guard, ckpt, writer, stop, say, tell, t0, log)
        run.pacer = Pacer(1 if feeder.streaming else plan.chunk, cfg.stop_within)
        k, steps = plan.chunk, plan.steps_per_epoch
        try:
            state, pos, saved_at = run.loop(state, pos, steps, plan.total_steps, k, main)
        finally:
            if ckpt is not None:
                ckpt.close()
        return _finish(cfg, run, state, pos, saved_at)


def _resolved(
    plan: TrainPlan,
    choices: dict[str, Any],
    cache_dir: Any,
    dataset: Any,
    identity: dict[str, Any],
    held_out: dict[str, Any] | None,
) -> dict[str, Any]:
    """What config.json records of the run beside its config (``resolved``)."""
    return {
        "mesh": plan.mesh,
        "chunk_steps": plan.chunk,
        **choices,
        "compile_cache": cache_dir,
        "data": dataset.note,
        "data_identity": identity,
        "validation": held_out,
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
    }


def _training_data(
    cfg: TrainConfig, dataset: Any, saved: dict[str, Any] | None, say: Callable[[str], None]
) -> tuple[Any, dict[str, Any], dict[str, Any] | None]:
    """The run's training data (loaded when not given), its identity and validation split.

    Every process checks it holds the same data, and a resumed run that it is the run's.
    """
    origin = "object" if dataset is not None else "config"  # evaluate reloads only "config"
    if dataset is None:
        streamed = cfg.input == "stream" or cfg.streaming  # tfds then opens a lazy train split
        dataset = data_lib.load_dataset(
            cfg.dataset, cfg.source, cfg.data_file, cfg.data_dir, log=say, stream=streamed
        )
    check_lazy_input(cfg, dataset)  # a lazy train split never goes to the devices whole
    identity = data_identity(dataset, cfg.data_file, cfg.validation, cfg.seed, origin=origin)
    agree_data(identity, dataset.note)  # every process the same data, or all stop
    if saved is not None:
        check_same_run(cfg.workdir, saved, run_fields(cfg), identity)
    held_out = None  # the validation split: never trained on; recorded in config.json
    if cfg.validation:
        split = split_validation(dataset, cfg.validation, cfg.seed, batch_size=cfg.batch_size)
        dataset, held_out = split.train, split.record()
    return dataset, identity, held_out


def _check_not_past_the_end(cfg: TrainConfig, step: int, steps_per_epoch: int) -> None:
    """Refuses a resume whose ``epochs`` end before the checkpoint (config.json would lie)."""
    if step > cfg.epochs * steps_per_epoch:
        need = -(-step // steps_per_epoch)
        raise ValueError(
            f"checkpoint {step} in {cfg.workdir} is past the end of an --epochs {cfg.epochs} "
            f"run (step {cfg.epochs * steps_per_epoch}); give --epochs {need} or more, or "
            "--overwrite to start over"
        )


def _ensemble_line(cfg: TrainConfig, ens: Ensemble, plan: TrainPlan, platform: str) -> str:
    """The line describing the ensemble, its mesh and its chunk."""
    return (
        f"ensemble: {cfg.members} x {cfg.model} on mesh {describe_mesh(ens.mesh)} "
        f"({jax.device_count()} {platform} devices, {idle_devices(ens.mesh)} idle, "
        f"{ens.members_per_device} member(s)/device), backend={cfg.backend}, "
        f"strategy={ens.member_strategy}, {plan.steps_per_epoch} steps/epoch, K={plan.chunk}"
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
        feeder.compile_ahead(lambda: ens.init(init_key, sample))
        feeder.compile_eval_ahead(
            lambda: ens.init(init_key, sample),
            dataset.test_images,
            dataset.test_labels,
            cfg.eval_batch_size,
        )
    given = {"params": load_backbone(cfg.backbone)} if cfg.backbone else {}
    return ens.init(init_key, sample, **given), LoopPosition()


def _finish(
    cfg: TrainConfig, run: _Run, state: EnsembleState, pos: LoopPosition, saved_at: Any
) -> TrainResult:
    """Writes the compile log, plots and final table (or says where a stop left the run)."""
    say, tell, writer, ckpt = run.say, run.tell, run.writer, run.ckpt
    seconds = time.perf_counter() - run.t0
    compiled = run.log.summary()
    if not run.compile_reported:
        say(run.log.line())
    writer.write_compile(compiled)
    history = writer.history
    if run.stop.signal is not None:
        where = "no checkpoint"
        if saved_at is not None and ckpt is not None:
            where = f"saved checkpoint {saved_at} in {ckpt.dir}"
        tell(
            f"stopped by {run.stop.signal} at step {pos.step}: {where}; run the same command "
            "to resume"
        )
        return TrainResult(
            run.ens, state, history, run.dataset, seconds, True, compiled, run.stop.signal
        )
    writer.plots(history)
    writer.close()
    if history:
        tell(final_table(history[-1]))
    say(f"done in {seconds:.1f}s; outputs in {cfg.workdir}")
    return TrainResult(run.ens, state, history, run.dataset, seconds, False, compiled)


@dataclasses.dataclass
class _Run:
    """The pieces the run loop needs (built by :func:`train`)."""

    cfg: TrainConfig
    ens: Ensemble
    dataset: data_lib.Dataset
    feeder: Feeder
    guard: NonFiniteGuard
    ckpt: Checkpointer | None
    writer: RunWriter
    stop: StopSignal
    say: Callable[[str], None]
    tell: Callable[[str], None]
    t0: float
    log: CompileLog
    compile_reported: bool = False
    pacer: Pacer = dataclasses.field(default_factory=lambda: Pacer(1, 0.0))

    def last_checkpoint(self) -> int | None:
        return self.ckpt.mngr.latest_step() if self.ckpt is not None else None

    def loop(self, state, pos: LoopPosition, steps_per_epoch, total_steps, k, main):
        """Runs chunks until ``total_steps`` or a stop signal; returns the state, position
        and the step of the last checkpoint saved (or None)."""
        cfg, guard = self.cfg, self.guard
        zeros = np.zeros((cfg.members,), np.float32)
        pos.loss_sum = zeros if pos.loss_sum is None else np.asarray(pos.loss_sum, np.float32)
        if pos.epoch_step == steps_per_epoch:
            pos.epoch, pos.epoch_step = pos.epoch + 1, 0
        progress = Progress(self.say, enabled=main and not cfg.quiet)
        saved_at = None
        try:
            while pos.step < total_steps:
                if not progress.started:
                    progress.start(pos.epoch, cfg.epochs, steps_per_epoch, pos.epoch_step)
                n = min(k, steps_per_epoch - pos.epoch_step, total_steps - pos.step)
                if cfg.checkpoint_every:  # a checkpoint step ends a call
                    n = min(n, cfg.checkpoint_every - pos.step % cfg.checkpoint_every)
                n = 1 if self.feeder.streaming else self.pacer.count(n)  # within stop_within
                started = self.pacer.start()
                state, metrics = self.feeder.run(state, pos.epoch, pos.epoch_step, n)
                self.pacer.observe(n, metrics["loss"], started)
                state = guard.check(
                    state, metrics, pos.step, self.tell, self.last_checkpoint, steps=n
                )
                pos.pending.append(metrics["loss"])  # summed on the host, never waited for
                if len(pos.pending) > SETTLE_EVERY:
                    pos.settle(keep=2)
                pos.loss_count += n
                pos.step += n
                pos.epoch_step += n
                progress.update(n, metrics)
                epoch_done = pos.epoch_step == steps_per_epoch
                last = pos.step == total_steps
                if epoch_done or last:
                    progress.close()
                    state = guard.flush(state, self.tell, self.last_checkpoint)
                    self.evaluate(state, pos)
                    if epoch_done:  # a split epoch keeps its sum: its record covers it all
                        pos.loss_sum, pos.loss_count = np.zeros_like(pos.loss_sum), 0
                every = cfg.checkpoint_every
                due = epoch_done or last or (every and pos.step // every > (pos.step - n) // every)
                stopping = self.stop.requested(pos.step)
                if self.ckpt is not None and (due or stopping):
                    state = guard.flush(state, self.tell, self.last_checkpoint)
                    self.ckpt.save(pos.step, state, {**pos.to_json(), **self.feeder.input_state()})
                    saved_at = pos.step
                if epoch_done:
                    pos.epoch, pos.epoch_step = pos.epoch + 1, 0
                if stopping:
                    break
        finally:
            progress.close()
        return state, pos, saved_at

    def evaluate(self, state: EnsembleState, pos: LoopPosition) -> None:
        """Evaluates on the test set and writes the record (train loss of the epoch so far)."""
        ds, cfg = self.dataset, self.cfg
        ev = self.ens.evaluate(state, ds.test_images, ds.test_labels, cfg.eval_batch_size)
        record: dict[str, Any] = {"epoch": pos.epoch, "step": pos.step}
        pos.settle()
        if pos.loss_count:
            losses = np.asarray(pos.loss_sum, np.float64) / pos.loss_count
            record["train_loss"] = [float(v) for v in losses]
            record["train_mean_member_loss"] = float(losses.mean())
        record.update(prefix_metrics(ev, "test"))
        self.writer.history.append(record)
        self.writer.write_metrics(record)
        self.say(epoch_line(record, cfg.epochs, time.perf_counter() - self.t0))
        if not self.compile_reported:  # the run's programs are all compiled by now
            self.compile_reported = True
            self.say(self.log.line())
            self.writer.write_compile(self.log.summary())
