"""Measured defaults for a run: the member strategy (and the CNN's convolution) by timing.

With ``TrainConfig.member_strategy="auto"`` (and ``conv="auto"`` for the CNN models) and
``autotune`` on, :func:`resolve_choices` times training steps of the candidates that can
differ (``vmap``/``loop``, times the convolutions of :func:`conv_candidates` when the
convolution is open; at one member per device ``vmap`` and ``loop`` are one program and
are not compared) on the run's own device, model and batch, with
:func:`meshensemble.runtime.autotune.decide`: the platform default first, then the others
while the budget lasts (:data:`~meshensemble.runtime.autotune.TUNING_SHARE`, 10 % of the
run's expected training time: :func:`planned_steps` x the default's first step), a
candidate abandoned at its first step when it is clearly slower. When measuring cannot pay
off, the run keeps the platform default and says so in one line.

Each candidate is timed with the run's own program (:func:`chunk_candidate`): the
training loop's :class:`~meshensemble.training.feeder.Feeder` chunk of that candidate's
ensemble, compiled as the run compiles it (the chunk ahead of time while the
initialisation compiles), stepping a fresh copy of the run's initial state through the
run's first batches, one step per call (with a chunk of K > 1 steps, as on GPUs, the
run's program of up to K steps is called for one step: the whole-epoch chunk is never
run). The run then trains with the chosen candidate's ensemble and feeder
(:attr:`Choice.ensemble`, :attr:`Choice.feeder`), so nothing the default compiled is
compiled again: a run that keeps the default compiles no more programs than a run with
``autotune`` off, and what timing it costs is a few steps. Those programs count as the
run's; the other candidates' are the tuner's (``compile.json``'s ``tuning``).

The choice is remembered in the choices file beside the compilation cache
(:func:`~meshensemble.runtime.autotune.choices_path`), so the next run of the same
configuration reads it instead of measuring; with the compilation cache off (or its
folder unusable) it is measured each run and not kept, and the run's line says so. When
the candidates ran in fp32 on a GPU or TPU and the budget has room, the winner is also
timed in bf16 and the run says how fast bf16 would be (:attr:`Choice.bf16_ratio`; the
precision never changes by itself). A resumed run takes the choice its ``config.json``
recorded (bitwise resume); ``autotune=False`` takes the platform defaults
(:func:`~meshensemble.core.ensemble.default_strategy`,
:func:`~meshensemble.models.conv.default_conv`); an explicit strategy or convolution
(``--member-strategy``, ``--conv``: the way to pin the choice for reproducible numbers)
is used as given and not measured. ``config.json``'s ``resolved`` entry records what the
run used and why.

Every candidate steps its own state (initialised again by the run, or copied by
:func:`step_candidate`), so no measurement touches the run's state: a tuned run trains
bitwise the same members as a run pinned to its choice.

Example:
  >>> cfg = me.TrainConfig(model="mlp", members=2, batch_size=32)   # 1 member per device
  >>> choice = resolve_choices(cfg, mesh, me.data.synthetic(64, 32), key, cache_dir=None)
  >>> choice.member_strategy, choice.conv, choice.how   # nothing to measure: the default
  ('loop', None, 'default')
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from meshensemble import data as data_lib
from meshensemble.core.ensemble import Ensemble, default_strategy
from meshensemble.core.mesh import ENSEMBLE
from meshensemble.core.state import EnsembleState
from meshensemble.models.conv import default_conv
from meshensemble.runtime import autotune
from meshensemble.runtime.compilation import LINE_WIDTH, CompileLog
from meshensemble.training.config import CONV_MODELS, TrainConfig, build_ensemble
from meshensemble.training.feeder import Feeder, resolve_input, train_targets

STRATEGY_CANDIDATES = ("vmap", "loop")
"""Member strategies measured when ``member_strategy="auto"``."""
CONV_CANDIDATES = ("xla", "im2col", "gemm_grad")
"""Convolutions measured when ``conv="auto"`` (CNN models only), besides the platform's
default (:func:`conv_candidates`)."""


def conv_candidates(platform: str) -> tuple[str, ...]:
    """The convolutions the tuner times on ``platform``: its default first, then the others.

    On CPU the default, ``"canonical"``, is XLA's convolution with its backward pass in
    XLA:CPU's fast layout; at one step per call it runs the same kernels as ``"xla"``,
    which is therefore not timed again.

    Args:
      platform: ``"cpu"``, ``"gpu"``, ``"tpu"`` ...

    Returns:
      The names, :func:`~meshensemble.models.conv.default_conv` first.

    Example:
      >>> conv_candidates("cpu"), conv_candidates("gpu")
      (('canonical', 'im2col', 'gemm_grad'), ('im2col', 'xla', 'gemm_grad'))
    """
    first = default_conv(platform)
    same = {"canonical": "xla"}.get(first)
    return (first, *(c for c in CONV_CANDIDATES if c not in (first, same)))


BF16_PLATFORMS = ("gpu", "tpu")
"""Platforms where a measuring run also times its choice in bf16 and says whether bf16
would be faster. Not CPU: XLA:CPU has no fast bf16 path (on this project's 2-core VM the
bf16 CNN step ran 1.86x the fp32 one), so timing it there only adds a compilation."""


TUNING_RECORD = "config.json resolved.tuning"
"""Where a run records the tuner's whole reasoning (its printed line says so)."""


@dataclasses.dataclass
class Choice:
    """What a run uses for the two settings that ``auto`` leaves open.

    Attributes:
      member_strategy: ``"vmap"`` or ``"loop"``.
      conv: the convolution (``"xla"``, ``"im2col"``, ``"canonical"``, ``"gemm_grad"``),
        or None for a model without one.
      how: ``"given"`` (explicit), ``"default"`` (platform default: autotune off, one
        member per device with the convolution given, or measuring could not pay off
        within the tuner's budget), ``"recorded"`` (a resumed run's ``config.json``),
        ``"cached"`` (measured by an earlier run) or ``"measured"`` (measured now).
      reason: one line saying why, e.g. ``"loop: 9.1 ms/step against vmap 12.0 ms
        (measured now)"``.
      ensemble: when measured now, the winner's ensemble, already initialised with the
        run's key (reusing it saves compiling the initialisation again); else None.
      bf16_ratio: when fp32 candidates were measured (now or by the run that cached the
        choice), the winner's bf16 step time over its fp32 step time; else None.
      notes: lines about a damaged choices file the tuner ignored (each names the file).
      feeder: when measured now with the run's feeder, the winner's
        :class:`~meshensemble.training.feeder.Feeder` (of :attr:`ensemble`), its chunk
        program compiled: the run trains with it; else None.
    """

    member_strategy: str
    conv: str | None
    how: str
    reason: str
    ensemble: Ensemble | None = dataclasses.field(default=None, repr=False)
    bf16_ratio: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    feeder: Feeder | None = dataclasses.field(default=None, repr=False)

    def line(self) -> str:
        """The line a run prints, e.g. ``member strategy: loop, conv: im2col (...)``.

        A reason too long for one line of :data:`~meshensemble.runtime.compilation.LINE_WIDTH`
        characters (the tuner's measurements, its budget, where the choice is stored) is cut
        to its first clause; the line then says where the whole of it is: the run's
        ``config.json``, ``resolved.tuning.reason`` (:meth:`resolved`).
        """
        conv = f", conv: {self.conv}" if self.conv is not None else ""
        head = f"member strategy: {self.member_strategy}{conv}"
        whole = f"{head} ({self.reason})"
        if len(whole) <= LINE_WIDTH:
            return whole
        first = re.split(r" \(|, |; ", self.reason)[0]
        how = self.how + (", not stored" if "not stored" in self.reason else "")
        cut = f"{head} ({first}; {how}, reasons in {TUNING_RECORD})"
        return cut if len(cut) <= LINE_WIDTH else f"{head} ({how}, reasons in {TUNING_RECORD})"

    def lines(self) -> list[str]:
        """The :attr:`notes`, :meth:`line`, then the bf16 line when bf16 was measured."""
        bf16 = [] if self.bf16_ratio is None else [autotune.bf16_line(self.bf16_ratio)]
        return [*self.notes, self.line(), *bf16]

    def resolved(self) -> dict[str, Any]:
        """The ``config.json`` ``resolved`` entries: the choices and ``tuning``."""
        tuning: dict[str, Any] = {"how": self.how, "reason": self.reason}
        if self.bf16_ratio is not None:
            tuning["bf16_ratio"] = self.bf16_ratio
            tuning["bf16"] = autotune.bf16_line(self.bf16_ratio)
        return {"member_strategy": self.member_strategy, "conv": self.conv, "tuning": tuning}


def copy_state(state: EnsembleState) -> EnsembleState:
    """A copy of ``state`` in new buffers (the same shardings), safe to donate.

    Args:
      state: an ensemble state.

    Returns:
      An equal :class:`~meshensemble.core.state.EnsembleState` that shares no buffer.

    Example:
      >>> mine = copy_state(state)   # train on `mine`; `state` stays usable
      >>> mine, _ = ens.train_step(mine, images, labels)
      >>> (mine.step - state.step).tolist()   # [members]: `mine` took one more step
      [1, 1]
    """
    return _copy(state)


@jax.jit
def _copy(tree: Any) -> Any:
    return jax.tree.map(jnp.copy, tree)


def step_candidate(
    ens: Ensemble, state: EnsembleState, images: Any, labels: Any, copy: bool = True
) -> Callable[[], Any]:
    """A one-step callable of ``ens`` on a private copy of ``state`` and one batch.

    Args:
      ens: the candidate's ensemble.
      state: a state of that ensemble's shape (copied now: it is never donated).
      images: one batch ``[B, ...]``.
      labels: its labels ``[B]``.
      copy: False when ``state`` was made for this candidate alone (it is then trained
        in place, saving the copy's program).

    Returns:
      ``fn()``: one ``train_step`` of the copy (which it keeps), returning the metrics.

    Example:
      >>> fn = step_candidate(ens, state, images[:32], labels[:32])
      >>> fn()["loss"].shape   # one step's metrics: [members]
      (2,)
    """
    own = [copy_state(state) if copy else state]
    x = ens.place(images)
    y = train_targets(ens.task, labels)  # as the feeder

    def step() -> Any:
        own[0], metrics = ens.train_step(own[0], x, y)
        return metrics

    return step


def chunk_candidate(feeder: Feeder, init: Callable[[], EnsembleState]) -> Callable[[], Any]:
    """A one-step callable running ``feeder``'s own chunk program, as the run calls it.

    The chunk is compiled as the run compiles it (:meth:`Feeder.compile_ahead`, while
    ``init`` compiles), so a run that then trains with ``feeder`` compiles neither again.
    Each call runs the next step of epoch 1 (the run's first batches, in the run's
    order) on the candidate's own state, ``init()`` (the run initialises its own again).
    With a chunk of K > 1 steps (:attr:`Feeder.dynamic`, as on GPUs) the run's program
    of up to K steps is called for one step; with K = 1 (CPU) it is the run's step.

    Args:
      feeder: the run's feeder for the candidate's ensemble (on-device input).
      init: ``() -> state``, the run's initialisation of that ensemble.

    Returns:
      ``fn()``: one step of the candidate's state (which it keeps), returning the
      metrics (``[1, members]`` or ``[K, members]``).

    Raises:
      ValueError: the feeder streams host batches (timing it would read the stream).

    Example:
      >>> ds, cfg = me.data.synthetic(64, 32, seed=0), me.TrainConfig(members=2, batch_size=32)
      >>> feeder = me.training.Feeder(ens, ds, cfg, jax.random.key(1), k=1, steps_per_epoch=2)
      >>> fn = chunk_candidate(feeder, lambda: ens.init(key, images[:1]))
      >>> fn()["loss"].shape   # [1, members]
      (1, 2)
    """
    if feeder.streaming:
        raise ValueError("a streaming Feeder reads its batches once; time step_candidate instead")
    feeder.compile_ahead(init)  # the chunk compiles while the initialisation does
    own, done = [init()], [0]
    feeder.wait_compiled()  # compiled here, by whoever builds the candidate

    def step() -> Any:
        first = done[0] % feeder.steps_per_epoch
        own[0], metrics = feeder.run(own[0], 1, first, 1)
        done[0] += 1
        return metrics

    return step


def open_settings(cfg: TrainConfig) -> tuple[bool, bool]:
    """Whether the run leaves the member strategy and the convolution to be chosen.

    Returns:
      ``(strategy_open, conv_open)``; the convolution is open only for
      :data:`~meshensemble.training.config.CONV_MODELS`.
    """
    return cfg.member_strategy == "auto", cfg.conv == "auto" and cfg.model in CONV_MODELS


def planned_steps(cfg: TrainConfig, dataset: data_lib.Dataset) -> int:
    """The training steps the run plans: ``epochs`` x full batches, capped by ``max_steps``.

    Args:
      cfg: the run's config.
      dataset: the run's data (after any validation split).

    Returns:
      The number of steps (what the tuner's budget is a share of).

    Example:
      >>> dataset = me.data.synthetic(num_train=4000, num_test=10)
      >>> planned_steps(TrainConfig(epochs=5, batch_size=128), dataset)  # 4,000 examples
      155
    """
    steps = cfg.epochs * (len(dataset.train_labels) // cfg.batch_size)
    return steps if cfg.max_steps is None else min(steps, cfg.max_steps)


def resolve_choices(
    cfg: TrainConfig,
    mesh: Mesh,
    dataset: data_lib.Dataset,
    init_key: jax.Array,
    cache_dir: str | None,
    recorded: dict[str, Any] | None = None,
    *,
    rounds: int = 3,
    timer: Callable[[], float] = time.perf_counter,
    feeder: Callable[[Ensemble], Feeder] | None = None,
    build: Callable[[TrainConfig], Ensemble] | None = None,
) -> Choice:
    """The member strategy and convolution the run uses, measured when ``auto`` asks for it.

    Only candidates that can differ are measured: at one member per device ``vmap`` and
    ``loop`` are the same program, so the strategy is the platform default there. The
    measurement has a budget (:func:`meshensemble.runtime.autotune.decide`):
    :data:`~meshensemble.runtime.autotune.TUNING_SHARE` of the run's expected training time
    (:func:`planned_steps` x the platform default's first step).

    Args:
      cfg: the run's config.
      mesh: the run's mesh.
      dataset: the run's data (its first ``batch_size`` training examples are the batch).
      init_key: the members' initialisation key (each candidate initialises its own state).
      cache_dir: the compilation cache folder in use, or None (then a measurement is not
        kept, and the run's line says so).
      recorded: a resumed run's ``config.json`` ``resolved`` entry, whose choices win.
      rounds: timed steps per candidate.
      timer: the clock (injectable for tests).
      feeder: ``feeder(ens)``, the run's :class:`~meshensemble.training.feeder.Feeder`
        for an ensemble (its data, order key and chunk). Given (as
        :func:`meshensemble.training.train` gives it), the default is timed with the
        run's own chunk program (:func:`chunk_candidate`), whose compilation is then not
        counted against the budget, every other candidate with its own feeder
        (:meth:`Feeder.for_ensemble`), and :attr:`Choice.feeder` is the winner's, for the
        run to train with. None, or a streaming feeder: each candidate is timed with
        :meth:`Ensemble.train_step` on the first batch (:func:`step_candidate`), and its
        compilation counts against the budget.
      build: ``build(cfg) -> Ensemble``, the run's ensemble for a candidate's config (its
        task and input statistics); default :func:`~meshensemble.training.config.build_ensemble`
        of ``cfg`` alone.

    Returns:
      A :class:`Choice`.

    Example:
      >>> cfg = me.TrainConfig(model="mlp", members=2, batch_size=32)
      >>> resolve_choices(cfg, mesh, me.data.synthetic(64, 32), key, None).line()
      'member strategy: loop (one member per device: vmap and loop are the same program (cpu))'
    """
    platform = mesh.devices.flat[0].platform
    strategy_open, conv_open = open_settings(cfg)
    has_conv = cfg.model in CONV_MODELS
    strategy = cfg.member_strategy if not strategy_open else default_strategy(platform)
    conv = (cfg.conv if not conv_open else default_conv(platform)) if has_conv else None
    if not (strategy_open or conv_open):
        return Choice(strategy, conv, "given", "as given")
    if recorded and recorded.get("member_strategy") in STRATEGY_CANDIDATES:
        strategy = recorded["member_strategy"] if strategy_open else strategy
        conv = recorded.get("conv", conv) if conv_open else conv
        return Choice(strategy, conv, "recorded", "recorded in the resumed run's config.json")
    if not cfg.autotune:
        return Choice(strategy, conv, "default", f"platform default for {platform}")
    members_per_device = cfg.members // int(mesh.shape[ENSEMBLE])
    if members_per_device == 1 and strategy_open:  # vmap and loop: one program
        strategy_open = False
        if not conv_open:
            why = f"one member per device: vmap and loop are the same program ({platform})"
            return Choice(strategy, conv, "default", why)
    built = _Candidates(cfg, mesh, dataset, init_key, feeder, build)
    opened = (strategy_open, conv_open)
    return _measured(built, cache_dir, opened, (strategy, conv), members_per_device, rounds, timer)


def _measured(
    built: _Candidates,
    cache_dir: str | None,
    opened: tuple[bool, bool],
    default: tuple[str, str | None],
    members_per_device: int,
    rounds: int,
    timer: Callable[[], float],
) -> Choice:
    """:func:`resolve_choices` once something is left to measure (``opened``: whether the
    strategy and the convolution are measured)."""
    cfg, mesh, dataset = built.cfg, built.mesh, built.dataset
    strategies = STRATEGY_CANDIDATES if opened[0] else (default[0],)
    convs = conv_candidates(_platform(mesh)) if opened[1] else (default[1],)
    names = {_name(s, c, *opened): (s, c) for s in strategies for c in convs}
    default_name = _name(*default, *opened)
    names = {default_name: names.pop(default_name), **names}  # the default first
    key = _key(cfg, mesh, dataset, sorted(names), members_per_device)
    path = autotune.choices_path(cache_dir) if cache_dir else None
    pin = {n: _name(*sc, *opened, flags=True) for n, sc in names.items()}  # quoted if chosen
    makers = {n: built.maker(*sc, tuning=n != default_name) for n, sc in names.items()}
    planned = planned_steps(cfg, dataset)
    decision = autotune.decide(
        key, makers, path, default_name, planned, rounds, timer, pin=pin, reused=built.reused
    )
    strategy, conv = names[decision.name]
    bf16_ratio = autotune.recorded(path, key).get("bf16_ratio")
    m = decision.measurement
    spare = (
        m is not None
        and not m.skipped
        and (m.budget_s is None or m.cost_s + m.needs_s <= m.budget_s)
    )
    timed_now = (strategy, conv) in built.stepping
    if cfg.precision == "fp32" and timed_now and spare and _platform(mesh) in BF16_PLATFORMS:
        bf16_cfg = dataclasses.replace(cfg, precision="bf16")  # when the budget has room
        bf16 = built.maker(strategy, conv, bf16_cfg, tuning=True)()
        with CompileLog.tuning():
            bf16_ratio = autotune.precision_ratio(
                built.stepping[strategy, conv], bf16, rounds, timer
            )
        autotune.remember(path, key, bf16_ratio=bf16_ratio)
    how = {"cached": "cached", "default": "default"}.get(decision.how, "measured")
    choice = Choice(strategy, conv, how, decision.reason, built.ensembles.get((strategy, conv)))
    choice.bf16_ratio, choice.notes = bf16_ratio, list(decision.notes)
    choice.feeder = built.feeders.get((strategy, conv))
    return choice


class _Candidates:
    """Builds the candidates :func:`_measured` times, and keeps what the run may reuse."""

    def __init__(self, cfg, mesh, dataset, init_key, feeder, build=None) -> None:
        self.cfg, self.mesh, self.dataset, self.init_key = cfg, mesh, dataset, init_key
        self.build = build or (lambda c: build_ensemble(c, mesh, len(dataset.y_train),
                                                         dataset.x_train[:1]))  # fmt: skip
        n, lazy = len(dataset.train_labels), data_lib.is_lazy(dataset)
        size = data_lib.stream.example_bytes(dataset)
        streams = feeder is not None and resolve_input(cfg, n, mesh, lazy, size)[0] == "stream"
        self.feeder = None if streams else feeder  # a stream is read once: the run's alone
        self.reused = self.feeder is not None  # the default is timed with the run's program
        self.first: Feeder | None = None  # the default's: the others share its data, order
        self.ensembles: dict[tuple[str, str | None], Ensemble] = {}
        self.feeders: dict[tuple[str, str | None], Feeder] = {}
        self.stepping: dict[tuple[str, str | None], Callable[[], Any]] = {}

    def maker(
        self, s: str, c: str | None, given: TrainConfig | None = None, tuning: bool = True
    ) -> Callable[[], Callable[[], Any]]:
        """``make()`` of candidate ``(s, c)``: what it compiles is the tuner's if ``tuning``
        (else the run's own: the default timed with the run's feeder)."""

        def build() -> Callable[[], Any]:
            mine = tuning or not self.reused
            with CompileLog.tuning() if mine else contextlib.nullcontext():
                step, ens, feeder = self._build(s, c, given or self.cfg)
            if given is None:
                self.ensembles[s, c], self.stepping[s, c] = ens, step
                if feeder is not None:
                    self.feeders[s, c] = feeder
            return _compiling_as_tuning(step) if mine else step

        return build

    def _build(self, s: str, c: str | None, cfg: TrainConfig):
        """The candidate's step callable, ensemble and feeder (None: timed with train_step)."""
        ds, sample = self.dataset, self.dataset.x_train[:1]
        ens = self.build(concrete(cfg, s, c))
        init = lambda: ens.init(self.init_key, sample)  # the run's key: the run's state
        feeder = None
        if self.feeder is not None:
            feeder = self.first.for_ensemble(ens) if self.first else self.feeder(ens)
            self.first = self.first or feeder
        if feeder is None:
            images, labels = ds.x_train[: cfg.batch_size], ds.y_train[: cfg.batch_size]
            return step_candidate(ens, init(), images, labels, copy=False), ens, feeder
        return chunk_candidate(feeder, init), ens, feeder


def _compiling_as_tuning(step: Callable[[], Any]) -> Callable[[], Any]:
    """``step`` whose first call (where a lazily compiled program compiles) is the tuner's."""
    called = [False]

    def first_as_tuning() -> Any:
        if called[0]:
            return step()
        called[0] = True
        with CompileLog.tuning():
            return step()

    return first_as_tuning


def _key(
    cfg: TrainConfig, mesh: Mesh, dataset: data_lib.Dataset, names: list[str], per_device: int
) -> str:
    """The choices file's key: everything that decides the choice."""
    return autotune.tuning_key(
        what="member_strategy,conv",
        candidates=names,
        model=cfg.model,
        members=cfg.members,
        members_per_device=per_device,
        mesh=dict(mesh.shape),
        batch=cfg.batch_size,
        data=(tuple(dataset.train_images.shape[1:]), str(dataset.train_images.dtype)),
        precision=cfg.precision,
        backend=cfg.backend,
    )


def _platform(mesh: Mesh) -> str:
    return mesh.devices.flat[0].platform


def concrete(cfg: TrainConfig, strategy: str, conv: str | None) -> TrainConfig:
    """``cfg`` with the chosen strategy and convolution in place of ``auto``.

    Args:
      cfg: the run's config.
      strategy: the member strategy.
      conv: the convolution, or None for a model without one.

    Returns:
      A copy of ``cfg`` (what :func:`~meshensemble.training.config.build_ensemble` takes).
    """
    return dataclasses.replace(
        cfg, member_strategy=strategy, conv=cfg.conv if conv is None else conv
    )


def _name(
    strategy: str, conv: str | None, strategy_open: bool, conv_open: bool, flags: bool = False
) -> str:
    """A candidate's name (e.g. ``vmap/im2col``), or with ``flags`` how to pin it
    (``--member-strategy vmap --conv im2col``): the open settings only."""
    parts = [("--member-strategy", strategy, strategy_open), ("--conv", str(conv), conv_open)]
    if flags:
        return " ".join(f"{flag} {value}" for flag, value, is_open in parts if is_open)
    return "/".join(value for _, value, is_open in parts if is_open)
