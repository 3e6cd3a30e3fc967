"""Defaults chosen by measurement, on a budget: time candidate programs, keep the winner.

How the members a device holds are computed (``vmap`` or an unrolled ``loop``) and how a
CNN computes its convolutions (XLA's, or im2col matmuls) are each fastest on some devices
and models and slow on others. :func:`decide` times the candidates on the device and
model at hand and keeps the fastest, within a budget:

* the platform default is measured first: it is built and compiled, then its first
  timed step tells what the run's training will cost (``planned_steps`` x that step).
  A run times the default with its own compiled program (``reused``: the training
  loop's chunk program on a fresh copy of its initial state, from its first batches),
  so the default's build and compilation are the run's own, which it then reuses: they
  are reported apart and not counted against the budget; what timing the default adds
  is its warm-up and timed steps;
* the tuner spends at most :data:`TUNING_SHARE` (10 %) of that expected training time
  on top of that: before each further candidate, before building or compiling anything
  of it, it estimates that candidate's cost from what the default really cost (its
  build, compilation and warm-up step, plus ``rounds`` steps) and stops measuring when
  the cost would exceed the budget; when no other candidate fits, the run keeps the
  platform default and says so in one line, with what timing the default cost;
* a candidate whose first timed step is over :data:`ABANDON_FACTOR` (1.5x) the best
  median so far is abandoned there (it cannot win);
* a candidate replaces the default only when its median step is at least
  :data:`KEEP_MARGIN` (5 %) faster, so that the load of other jobs on a shared machine
  does not flip the choice (and with it the run's numbers) from run to run.

The choice is remembered in a small JSON file next to the compilation cache
(:func:`choices_path`), keyed by everything that decides it (device kind, JAX version,
model, shapes): the next run of the same configuration reads it instead of measuring.
With no cache folder nothing is stored, and the line says so. An entry of the wrong shape
is ignored with one line naming the file (and replaced by the new measurement). For
reproducible numbers, pin the choice (``--member-strategy`` and ``--conv``, or
``--no-autotune`` for the platform defaults); ``config.json`` records what a run used.

Every clock is injectable (``timer``), so the decisions are tested without timing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from meshensemble.runtime import storage

CHOICES_FILE = "meshensemble-choices.json"
"""File (beside the compilation cache's folder) holding the measured choices."""

TUNING_SHARE = 0.10
"""The most the tuner spends beyond what the run reuses, as a share of the run's expected
training time (the planned steps times the default's first timed step)."""

ABANDON_FACTOR = 1.5
"""A candidate whose first timed step exceeds this many times the best median so far is
abandoned without further steps."""

KEEP_MARGIN = 0.05
"""A candidate replaces the platform default only when its median step is at least this
share faster than the default's."""


def tuning_key(**parts: Any) -> str:
    """A stable key for a measured choice: a hash of ``parts`` plus the device and versions.

    Args:
      **parts: what decides the choice, e.g. ``what="member_strategy"``, ``model=repr(m)``,
        ``shapes=...``, ``members_per_device=2``; values are turned into text.

    Returns:
      A short hex key.

    Example:
      >>> len(tuning_key(what="member_strategy", model="CNN()", batch=128))
      16
    """
    device = jax.devices()[0]
    everything = {
        **{k: str(v) for k, v in parts.items()},
        "platform": device.platform,
        "device_kind": getattr(device, "device_kind", ""),
        "jax": jax.__version__,
    }
    text = json.dumps(everything, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def choices_path(cache_dir: str) -> str:
    """Where the choices live for a compilation cache folder: ``<cache_dir>/../CHOICES_FILE``.

    Args:
      cache_dir: the compilation cache's folder.

    Returns:
      The JSON file's path.

    Example:
      >>> choices_path("/home/me/.cache/meshensemble/jax")   # beside the cache folder
      '/home/me/.cache/meshensemble/meshensemble-choices.json'
    """
    return storage.join(os.path.dirname(storage.absolute(cache_dir).rstrip("/")), CHOICES_FILE)


def read_choices(path: str | None, warn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The recorded choices (``{}`` when the file is absent or unreadable).

    Args:
      path: the JSON file, or None.
      warn: called with one line naming the file when it exists but is not a JSON
        object (it is then ignored, and rewritten by the next measurement).

    Returns:
      ``{key: {"choice": name, "seconds": {name: s}, ...}}`` (entries unchecked: see
      :func:`valid_record`).

    Example:
      >>> read_choices("/nonexistent/choices.json")
      {}
    """
    if not path:
        return {}
    try:
        loaded = storage.read_json(path)
        problem = "" if isinstance(loaded, dict) else "not a JSON object"
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        problem = f"unreadable ({err})"
    if problem and warn:
        warn(f"ignored the auto-tuner's choices file {path}: {problem}; measuring")
    return {} if problem else loaded


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def valid_record(record: Any) -> bool:
    """Whether a choices-file entry has the shape this module writes.

    Args:
      record: one value of :func:`read_choices`.

    Returns:
      True for ``{"choice": str, "seconds": {str: number >= 0}}`` whose optional
      ``bf16_ratio``/``needs_s`` are numbers >= 0 and ``complete`` a bool.

    Example:
      >>> valid_record({"choice": "loop", "seconds": {"loop": "abc"}})
      False
    """
    if not isinstance(record, dict) or not isinstance(record.get("choice"), str):
        return False
    seconds = record.get("seconds")
    if not isinstance(seconds, dict) or not all(_number(s) for s in seconds.values()):
        return False
    if any(k in record and not _number(record[k]) for k in ("bf16_ratio", "needs_s")):
        return False
    return isinstance(record.get("complete", True), bool)


def _write_choice(path: str, key: str, record: dict[str, Any]) -> bool:
    """Adds one choice to the file atomically; False when it could not be written."""
    path = storage.absolute(path)  # a bare file name ("choices.json"): the working folder
    try:
        choices = read_choices(path)
        choices[key] = record
        storage.makedirs(os.path.dirname(path))
        storage.atomic_write_json(path, choices, indent=1, sort_keys=True, allow_nan=True)
    except OSError:
        return False
    return True


def _timed(fn: Callable[[], Any], timer: Callable[[], float]) -> float:
    start = timer()
    jax.block_until_ready(fn())
    return timer() - start


def time_candidates(
    candidates: Mapping[str, Callable[[], Any]],
    rounds: int = 3,
    timer: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median seconds of one call of each candidate, interleaved round by round.

    Each candidate is called once first (compilation and warm-up, not timed); then each
    round calls every candidate once, in turn, waiting for its result
    (``jax.block_until_ready``). No budget: :func:`measure` is the tuner's.

    Args:
      candidates: ``{name: fn}``; ``fn()`` runs one step and returns its outputs.
      rounds: timed calls per candidate.
      timer: the clock (injectable for tests).

    Returns:
      ``{name: median seconds}``.

    Raises:
      ValueError: no candidates, or ``rounds < 1``.

    Example:
      >>> clock = [0.0]   # a fake clock: each "step" below advances it by its seconds
      >>> def step(seconds):
      ...     return lambda: clock.__setitem__(0, clock[0] + seconds)
      >>> time_candidates({"vmap": step(0.5), "loop": step(0.25)}, timer=lambda: clock[0])
      {'vmap': 0.5, 'loop': 0.25}
    """
    if not candidates or rounds < 1:
        raise ValueError(f"need candidates and rounds >= 1, got {list(candidates)}, {rounds}")
    for fn in candidates.values():
        jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            times[name].append(_timed(fn, timer))
    return {name: statistics.median(ts) for name, ts in times.items()}


@dataclasses.dataclass
class Measurement:
    """What :func:`measure` found and spent.

    Attributes:
      seconds: per measured candidate, its median step (an abandoned candidate: its one
        timed step); the default is always there.
      abandoned: candidates stopped after one timed step (over :data:`ABANDON_FACTOR`
        times the best median so far).
      skipped: candidates not measured because their estimated cost exceeded the budget.
      spent_s: the tuner's time, from its start (builds and compilations included).
      budget_s: :data:`TUNING_SHARE` of ``expected_s`` (None: no budget).
      expected_s: the run's expected training time, planned steps x the default's first
        timed step (None when the planned steps are unknown).
      needs_s: the estimated cost of measuring one more candidate (the default's build,
        compilation and first call, plus ``rounds`` of its steps).
      reused_s: of ``spent_s``, the default's build and compilation when its programs
        are the run's own (``measure(..., reused=True)``): the run reuses them, so they
        are not the tuner's cost; else 0.
    """

    seconds: dict[str, float]
    abandoned: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    spent_s: float = 0.0
    budget_s: float | None = None
    expected_s: float | None = None
    needs_s: float = 0.0
    reused_s: float = 0.0

    @property
    def cost_s(self) -> float:
        """What the tuner added to the run: ``spent_s`` less ``reused_s``."""
        return max(self.spent_s - self.reused_s, 0.0)

    def winner(self, default: str, margin: float = KEEP_MARGIN) -> str:
        """The fastest fully measured candidate, or ``default`` unless beaten by ``margin``.

        Args:
          default: the platform default's name.
          margin: the share a candidate must be faster by to replace the default.

        Returns:
          A candidate name.
        """
        timed = {n: s for n, s in self.seconds.items() if n not in self.abandoned}
        best = min(timed, key=timed.__getitem__)
        return best if timed[best] < (1 - margin) * timed[default] else default


def measure(
    candidates: Mapping[str, Callable[[], Callable[[], Any]]],
    default: str,
    planned_steps: int | None = None,
    rounds: int = 3,
    timer: Callable[[], float] = time.perf_counter,
    share: float = TUNING_SHARE,
    reused: bool = False,
) -> Measurement:
    """Times the default, then each other candidate while the budget allows (see the module).

    The budget is checked before each other candidate's ``make()`` is called, from what
    the default really cost: a candidate that does not fit is never built.

    Args:
      candidates: ``{name: make}``; ``make()`` builds the candidate and returns its
        one-step callable; the first call of that callable compiles (untimed).
      default: the platform default's name (a key of ``candidates``), measured first.
      planned_steps: the run's training steps (None: no budget).
      rounds: timed steps per fully measured candidate.
      timer: the clock (injectable for tests).
      share: the budget as a share of the expected training time.
      reused: whether the default's programs are the run's own (the run reuses them):
        its build and compilation (its ``make()`` and first call, less one step) are then
        not counted against the budget (:attr:`Measurement.reused_s`).

    Returns:
      A :class:`Measurement`.

    Raises:
      ValueError: ``default`` is not a candidate, or ``rounds < 1``.

    Example:
      >>> clock = [0.0]   # a fake clock: each "step" below advances it by its seconds
      >>> def step(seconds):
      ...     return lambda: clock.__setitem__(0, clock[0] + seconds)
      >>> make_vmap, make_loop = lambda: step(0.5), lambda: step(0.25)   # build, then step
      >>> m = measure({"vmap": make_vmap, "loop": make_loop}, "loop", planned_steps=1000,
      ...             timer=lambda: clock[0])
      >>> m.winner("loop"), m.spent_s, m.budget_s   # budget: 10% of 1000 steps x 0.25 s
      ('loop', 2.0, 25.0)
    """
    if default not in candidates or rounds < 1:
        raise ValueError(f"need the default among {list(candidates)} and rounds >= 1")
    start = timer()
    fn = candidates[default]()
    jax.block_until_ready(fn())
    warm = timer() - start  # build, compilation and one (warm-up) step
    first = _timed(fn, timer)
    expected = None if planned_steps is None else planned_steps * first
    budget = None if expected is None else share * expected
    needs = warm + rounds * first  # another candidate: built, compiled, warmed up, timed
    shared = max(warm - first, 0.0) if reused else 0.0  # the run's own compilation
    others = [n for n in candidates if n != default]

    def affordable(then: float = 0.0) -> bool:  # before building anything of one more
        return budget is None or (timer() - start - shared) + then + needs <= budget

    def result(times: dict[str, list[float]], abandoned=(), skipped=()) -> Measurement:
        seconds = {n: statistics.median(ts) for n, ts in times.items()}
        spent = timer() - start
        return Measurement(
            seconds, tuple(abandoned), tuple(skipped), spent, budget, expected, needs, shared
        )

    if not others or not affordable((rounds - 1) * first):  # the default's other rounds too
        return result({default: [first]}, skipped=others)
    times = {default: [first] + [_timed(fn, timer) for _ in range(rounds - 1)]}
    abandoned: list[str] = []
    for i, name in enumerate(others):
        if not affordable():
            return result(times, abandoned, others[i:])
        fn = candidates[name]()
        jax.block_until_ready(fn())
        times[name] = [_timed(fn, timer)]
        best = min(statistics.median(v) for n, v in times.items() if n not in (*abandoned, name))
        if times[name][0] > ABANDON_FACTOR * best:
            abandoned.append(name)
            continue
        times[name] += [_timed(fn, timer) for _ in range(rounds - 1)]
    return result(times, abandoned)


@dataclasses.dataclass
class Decision:
    """What :func:`decide` chose, how, and the line that says why.

    Attributes:
      name: the chosen candidate.
      how: ``"cached"`` (read from the choices file), ``"measured"`` (measured now),
        ``"default"`` (measuring could not pay off: the platform default kept) or
        ``"only"`` (a single candidate).
      reason: one line, e.g. ``"loop: 9.1 ms/step against vmap 12.0 ms (measured now in
        1.2 s, 4% of the run's expected 30 s; stored in /x/meshensemble-choices.json)"``.
      measurement: the :class:`Measurement` when measured now, else None.
      stored: the choices file the decision was written to, or None.
      notes: lines about a damaged choices file (each names the file).
    """

    name: str
    how: str
    reason: str
    measurement: Measurement | None = None
    stored: str | None = None
    notes: list[str] = dataclasses.field(default_factory=list)


def decide(
    key: str,
    candidates: Mapping[str, Callable[[], Callable[[], Any]]],
    path: str | None,
    default: str | None = None,
    planned_steps: int | None = None,
    rounds: int = 3,
    timer: Callable[[], float] = time.perf_counter,
    share: float = TUNING_SHARE,
    pin: str | Mapping[str, str] = "",
    reused: bool = False,
) -> Decision:
    """The candidate to use: read from ``path`` when measured before, else measured now.

    A recorded entry is used unless it was cut short by a smaller budget than this run's
    (then the run measures again); an entry of the wrong shape is ignored with a note
    naming the file, and replaced by the new measurement.

    Args:
      key: from :func:`tuning_key`.
      candidates: ``{name: make}``; ``make()`` builds the candidate and returns its
        one-step callable (only called when a measurement is needed, so a cached choice
        builds nothing).
      path: the choices file (:func:`choices_path`), or None to measure without keeping.
      default: the platform default (default: the first candidate).
      planned_steps: the run's training steps, for the budget (None: no budget).
      rounds: timed steps per fully measured candidate.
      timer: the clock (injectable for tests).
      share: the budget's share of the expected training time.
      pin: how to pin the choice, quoted in the line when nothing is stored, e.g.
        ``"--member-strategy S --conv C"``, or per candidate ``{name: flags}`` (the
        chosen one's is quoted).
      reused: whether the default's programs are the run's own (see :func:`measure`).

    Returns:
      A :class:`Decision`.

    Raises:
      ValueError: no candidates, or a default that is not one of them.

    Example:
      >>> clock = [0.0]   # a fake clock: each "step" below advances it by its seconds
      >>> def step(seconds):
      ...     return lambda: clock.__setitem__(0, clock[0] + seconds)
      >>> make_vmap, make_loop = lambda: step(0.25), lambda: step(0.5)
      >>> key, path = tuning_key(what="member_strategy", model="MLP()"), "choices.json"
      >>> d = decide(key, {"vmap": make_vmap, "loop": make_loop}, path, "loop", 1000,
      ...            timer=lambda: clock[0])
      >>> d.name, d.how, d.reason
      ('vmap', 'measured', "vmap: 250.0 ms/step against loop 500.0 ms (measured now in 3.0 s,
      1% of the run's expected 500 s; stored in choices.json)")
      >>> decide(key, {"vmap": make_vmap, "loop": make_loop}, path, "loop", 1000).how
      'cached'
    """
    if not candidates:
        raise ValueError("decide needs at least one candidate")
    default = next(iter(candidates)) if default is None else default
    if default not in candidates:
        raise ValueError(f"default {default!r} is not a candidate of {list(candidates)}")
    notes: list[str] = []
    record = read_choices(path, notes.append).get(key)
    if record is not None and not valid_record(record):
        notes.append(
            f"ignored a damaged entry in the auto-tuner's choices file {path} "
            "(not the shape it writes); measuring again, which replaces it"
        )
    elif (
        record is not None
        and record["choice"] in candidates
        and _settled(record, planned_steps, share, default)
    ):
        reason = _reason(record["choice"], record["seconds"], f"measured earlier; read from {path}")
        return Decision(record["choice"], "cached", reason, notes=notes)
    if len(candidates) == 1:
        return Decision(default, "only", f"{default}: the only candidate", notes=notes)
    m = measure(candidates, default, planned_steps, rounds, timer, share, reused)
    name = m.winner(default)
    entry = {"choice": name, "seconds": m.seconds, "complete": not m.skipped, "needs_s": m.needs_s}
    stored = path if path and _write_choice(path, key, entry) else None
    how = "default" if m.skipped and name == default else "measured"
    pinned = pin.get(name, "") if isinstance(pin, Mapping) else pin
    return Decision(name, how, _describe(name, default, m, stored, pinned), m, stored, notes)


def _settled(record: Mapping[str, Any], planned: int | None, share: float, default: str) -> bool:
    """Whether a recorded decision stands for this run (a cut-short one: unless it can pay now)."""
    if record.get("complete", True):
        return True
    step = record["seconds"].get(default)
    if planned is None or step is None:
        return planned is not None  # no budget now: measure everything
    return record.get("needs_s", 0.0) > share * planned * step


def _describe(name: str, default: str, m: Measurement, stored: str | None, pin: str) -> str:
    """The decision's line: the times, the budget, and where (whether) the choice is kept."""
    where = (
        f"stored in {stored}"
        if stored
        else "not stored: no usable compilation cache folder, so each run measures again"
        + (f"; pin it with {pin}" if pin else "")
    )
    if m.skipped and len(m.seconds) == 1:
        return (
            f"{name}: {1e3 * m.seconds[name]:.1f} ms/step, the platform default kept: measuring "
            f"{len(m.skipped)} other candidate(s) would take ~{_secs(m.needs_s)} each, over the "
            f"tuner's budget of {_secs(m.budget_s)} ({TUNING_SHARE:.0%} of the run's expected "
            f"{_secs(m.expected_s)} of training; {_default_cost(m)}); {where}"
        )
    spend = f"measured now in {_secs(m.cost_s)}"
    if m.reused_s:
        spend += f" besides the default's {_secs(m.reused_s)} compilation, which the run reuses"
    if m.expected_s:
        spend += f", {m.cost_s / m.expected_s:.0%} of the run's expected {_secs(m.expected_s)}"
    skipped = f"; {len(m.skipped)} not measured (over budget)" if m.skipped else ""
    kept = ""
    if name == default and any(n not in m.abandoned for n in m.seconds if n != name):
        kept = f"; the default kept unless {KEEP_MARGIN:.0%} faster"
    return _reason(name, m.seconds, f"{spend}{skipped}{kept}; {where}", m.abandoned)


def _default_cost(m: Measurement) -> str:
    """What timing the default alone cost the run, for the line of a kept default."""
    if not m.reused_s:
        return f"timing the default took {_secs(m.spent_s)}"
    return (
        f"timing the default cost {_secs(m.cost_s)} beyond its {_secs(m.reused_s)} "
        "compilation, which the run reuses"
    )


def _secs(s: float | None) -> str:
    return "?" if s is None else f"{s:.1f} s" if s < 100 else f"{s:.0f} s"


def choose(
    key: str,
    candidates: Mapping[str, Callable[[], Callable[[], Any]]],
    path: str | None,
    rounds: int = 3,
    timer: Callable[[], float] = time.perf_counter,
    default: str | None = None,
    planned_steps: int | None = None,
) -> tuple[str, str]:
    """:func:`decide`'s name and line (no budget unless ``planned_steps`` is given).

    Args:
      key: from :func:`tuning_key`.
      candidates: ``{name: make}`` as :func:`decide` takes them.
      path: the choices file, or None.
      rounds: timed steps per candidate.
      timer: the clock (injectable for tests).
      default: the platform default (default: the first candidate).
      planned_steps: the run's training steps, for the budget.

    Returns:
      ``(name, reason)``.

    Raises:
      ValueError: no candidates.

    Example:
      >>> clock = [0.0]   # a fake clock: each "step" below advances it by its seconds
      >>> def step(seconds):
      ...     return lambda: clock.__setitem__(0, clock[0] + seconds)
      >>> make_vmap, make_loop = lambda: step(0.25), lambda: step(0.5)
      >>> key = tuning_key(what="member_strategy", model="MLP()")
      >>> candidates = {"vmap": make_vmap, "loop": make_loop}
      >>> name, why = choose(key, candidates, "choices.json", timer=lambda: clock[0])
      >>> name, why
      ('vmap', 'vmap: 250.0 ms/step against loop 500.0 ms (abandoned) (measured now in 2.0 s;
      stored in choices.json)')
    """
    d = decide(key, candidates, path, default, planned_steps, rounds, timer)
    return d.name, d.reason


def _reason(name: str, seconds: Mapping[str, float], how: str, abandoned: Any = ()) -> str:
    """``name``'s step time against the others' (the ``abandoned`` ones marked), then ``how``."""
    others = ", ".join(
        f"{n} {1e3 * s:.1f} ms{' (abandoned)' if n in abandoned else ''}"
        for n, s in seconds.items()
        if n != name
    )
    mine = seconds.get(name)
    head = f"{name}: {1e3 * mine:.1f} ms/step" if mine is not None else name
    return f"{head}{' against ' + others if others else ''} ({how})"


def precision_ratio(
    fp32: Callable[[], Any],
    bf16: Callable[[], Any],
    rounds: int = 3,
    timer: Callable[[], float] = time.perf_counter,
) -> float:
    """How long a bf16 step takes against the fp32 one, timed interleaved.

    Args:
      fp32: one fp32 step (the chosen candidate).
      bf16: the same candidate in bf16 (mixed precision).
      rounds: timed calls of each.
      timer: the clock (injectable for tests).

    Returns:
      ``bf16 seconds / fp32 seconds`` (medians); below 1 means bf16 is faster.

    Example:
      >>> clock = [0.0]   # a fake clock: each "step" below advances it by its seconds
      >>> def step(seconds):
      ...     return lambda: clock.__setitem__(0, clock[0] + seconds)
      >>> precision_ratio(step(0.5), step(0.25), timer=lambda: clock[0])
      0.5
    """
    seconds = time_candidates({"fp32": fp32, "bf16": bf16}, rounds, timer)
    return seconds["bf16"] / seconds["fp32"]


def bf16_line(ratio: float) -> str:
    """The line a run prints about bf16 when it measured fp32 candidates.

    Args:
      ratio: from :func:`precision_ratio`.

    Returns:
      e.g. ``"bf16 would run 0.62x the fp32 step time; precision stays fp32: pass
      --precision bf16 to use it"``.

    Example:
      >>> bf16_line(0.62)[:30]
      'bf16 would run 0.62x the fp32 '
    """
    return (
        f"bf16 would run {ratio:.2f}x the fp32 step time; precision stays fp32: "
        "pass --precision bf16 to use it"
    )


def recorded(path: str | None, key: str) -> dict[str, Any]:
    """The record of ``key`` in the choices file (``{}`` when absent).

    Args:
      path: the choices file, or None.
      key: from :func:`tuning_key`.

    Returns:
      ``{"choice": name, "seconds": {...}, ...}`` with any extra fields :func:`remember`
      added (e.g. ``"bf16_ratio"``); ``{}`` for an entry of the wrong shape
      (:func:`valid_record`).

    Example:
      >>> path, key = "choices.json", tuning_key(what="member_strategy", model="MLP()")
      >>> recorded(path, key)   # nothing recorded yet
      {}
      >>> remember(path, key, bf16_ratio=0.62)   # adds only to a recorded choice: nothing
      >>> recorded(path, key).get("bf16_ratio") is None
      True
    """
    record = read_choices(path).get(key)
    return record if valid_record(record) else {}


def remember(path: str | None, key: str, **extra: Any) -> None:
    """Adds fields to the recorded choice of ``key`` (nothing when it is not recorded).

    Args:
      path: the choices file, or None.
      key: from :func:`tuning_key`.
      **extra: JSON-serialisable fields, e.g. ``bf16_ratio=0.62``.

    Example:
      >>> path, key = "choices.json", tuning_key(what="member_strategy", model="MLP()")
      >>> step = lambda: jnp.ones(4)   # one step of either candidate
      >>> name, why = choose(key, {"vmap": lambda: step, "loop": lambda: step}, path)
      >>> remember(path, key, bf16_ratio=0.62)
      >>> recorded(path, key)["bf16_ratio"]
      0.62
    """
    record = recorded(path, key)
    if path and record:
        _write_choice(path, key, {**record, **extra})
