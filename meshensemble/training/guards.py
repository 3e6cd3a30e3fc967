"""What stops or repairs a run: SIGTERM/SIGINT, and members whose loss became NaN/inf.

:class:`StopSignal` turns SIGTERM/SIGINT into a request the loop honours at the end of the
running call (after saving a checkpoint); all processes agree on the step, through JAX's
preemption sync point when there are several (no collective per call). Calls are kept
short enough for that to come within ``TrainConfig.stop_within`` seconds by
:class:`meshensemble.training.pacing.Pacer`.
:class:`NonFiniteGuard` inspects each chunk's per-member losses one chunk behind (so it
never stalls the device queue) and either raises :class:`NonFiniteError` or
re-initialises only the bad members, at most :data:`MAX_REINITS` times per member; before
every checkpoint and evaluation it also checks the state itself, so a NaN/inf parameter is
never saved.

Example:
  >>> guard = NonFiniteGuard(ens, "reinit", key, images[:1])
  >>> metrics = {"loss": jnp.array([[0.5, jnp.nan]])}   # a chunk's [rows, members]: 1 diverged
  >>> state = guard.check(state, metrics, 20, print)    # looked at by the next call
  >>> state = guard.flush(state, print)
  non-finite loss in member(s) [1] at step 21: re-initialising them
"""

from __future__ import annotations

import itertools
import signal
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshensemble.core.ensemble import Ensemble
from meshensemble.core.state import EnsembleState, member_part, shared_part, with_shared
from meshensemble.errors import RunFailedError
from meshensemble.runtime.distributed import fetch

PREEMPTED = "a preemption notice (SIGTERM to one of the processes)"
""":attr:`StopSignal.signal` of processes that stopped at JAX's preemption sync point for a
SIGTERM (JAX's handler receives it, in whichever process it came to)."""
MAX_REINITS = 3
"""Re-initialisations allowed per member and per run (a resumed run counts afresh) with
``on_nonfinite="reinit"``: a member that becomes non-finite once more stops the run with
:class:`NonFiniteError` (a run that diverges from any start cannot be repaired this way)."""


class NonFiniteError(RunFailedError):
    """A member's loss or state became NaN or infinite (with ``on_nonfinite="stop"``, or
    more than :data:`MAX_REINITS` times for one member with ``"reinit"``)."""


_SYNC_CALLS = itertools.count(1)
"""This process's calls of JAX's preemption sync point so far (see :class:`StopSignal`)."""


class StopSignal:
    """SIGTERM/SIGINT ask the loop to save at the end of the running call and stop.

    One process: Python handlers record the signal and :meth:`requested` reads the flag.
    Several processes (``jax.distributed``): JAX's preemption service owns SIGTERM (its
    handler, installed by ``jax.distributed.initialize``, tells every process through the
    coordination service), and :meth:`requested` asks
    ``jax.experimental.multihost_utils.reached_preemption_sync_point``, a local check
    that returns True in every process at the same call: the one after the furthest
    process's call when the notice came. A SIGINT (Ctrl-C) is handed to that service as
    a SIGTERM of this process. So :meth:`requested` costs no cross-process call, and
    every process must call it equally often: once per chunk, at the same points (the
    sync point counts calls; the numbers continue across the runs of one process). With
    JAX's preemption service turned off (``jax_enable_preemption_service``), the processes
    gather their flags at each call instead (a collective per call).

    Attributes:
      signal: the name of the signal received (``"SIGTERM"``, ``"SIGINT"``), or
        :data:`PREEMPTED` when several processes stopped at a preemption notice (JAX's
        handler receives SIGTERM, so which process got it is not known here; ``"a
        peer's signal"`` with the service off), or None.

    Example:
      >>> stop, step = StopSignal.install(), 0
      >>> try:
      ...     while not stop.requested(step) and step < 3:   # a run's loop, once per chunk
      ...         step += 1
      ... finally:
      ...     stop.uninstall()
      >>> step   # no signal came
      3
    """

    def __init__(self, processes: int | None = None) -> None:
        self.signal: str | None = None
        self._old: dict[int, Any] = {}
        several = (processes or jax.process_count()) > 1
        service = bool(jax.config.jax_enable_preemption_service)
        self._synced = several and service
        self._gathered = several and not service  # JAX's service turned off: a collective

    @classmethod
    def install(cls, processes: int | None = None) -> StopSignal:
        """Installs the handlers (in the main thread only; elsewhere signals stay as they are).

        Args:
          processes: how many processes run (default ``jax.process_count()``).

        Returns:
          The new :class:`StopSignal`.
        """
        stop = cls(processes)
        if threading.current_thread() is threading.main_thread():
            mine = (signal.SIGINT,) if stop._synced else (signal.SIGTERM, signal.SIGINT)
            for sig in mine:  # with several processes SIGTERM stays JAX's
                stop._old[sig] = signal.signal(sig, stop._handle)
        return stop

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signal.Signals(signum).name
        if self._synced:  # JAX's preemption service hears SIGTERM: tell every process
            signal.raise_signal(signal.SIGTERM)

    def requested(self, step: int) -> bool:
        """Whether to stop after ``step``; all processes agree. Call it once per chunk.

        Args:
          step: the step just finished (for the reader; the answer does not depend on it).

        Returns:
          True when this process or any other received a signal (with several processes:
          at the call every process makes alike, the first after the notice reached all).
        """
        from jax.experimental import multihost_utils

        if self._gathered:
            flag = np.int32(self.signal is not None)
            if not multihost_utils.process_allgather(flag).max():
                return False
            self.signal = self.signal or "a peer's signal"
        elif not self._synced:
            return self.signal is not None
        elif not multihost_utils.reached_preemption_sync_point(next(_SYNC_CALLS)):
            return False
        self.signal = self.signal or PREEMPTED
        return True

    def uninstall(self) -> None:
        """Restores the handlers that were there before :meth:`install`."""
        for sig, old in self._old.items():
            signal.signal(sig, old)


@jax.jit
def finite_members(state: EnsembleState) -> jax.Array:
    """Whether each member's parameters, optimizer and model state are all finite.

    Args:
      state: an :class:`~meshensemble.core.state.EnsembleState` (leaves ``[members, ...]``,
        possibly sharded: only the ``[members]`` answer is reduced).

    Returns:
      bool ``[members]``.

    Example:
      >>> bool(finite_members(state).all())
      True
    """
    ok = _all_finite((state.params, state.opt_state, state.model_state), state.step.shape)
    return ok & _all_finite(shared_part(state))  # a layout's shared leaves: every member's


def _all_finite(tree: Any, members: tuple[int, ...] | None = None) -> jax.Array:
    """Whether every floating leaf of ``tree`` is finite (True for None or no leaves); with
    ``members`` (the ``[members]`` shape), per member: over each leaf's axes after the first."""
    per = int(members is not None)
    ok = jnp.ones(members if per else (), bool)
    for x in jax.tree.leaves(tree):
        if jnp.issubdtype(x.dtype, jnp.inexact) and x.ndim >= per:
            ok = ok & jnp.all(jnp.isfinite(x), axis=tuple(range(per, x.ndim)))
    return ok


@jax.jit
def select_members(mask: jax.Array, fresh: Any, old: Any) -> Any:
    """Takes the members where ``mask`` is True from ``fresh``, the others from ``old``.

    Built once (a module-level ``jax.jit``): the mask is an argument, so re-initialising
    other members later compiles nothing new.

    Args:
      mask: bool ``[members]``.
      fresh: a state tree whose leaves are ``[members, ...]`` (a ``SharedState``'s shared
        leaves are taken from it only where ``old``'s are not all finite).
      old: a tree of the same structure.

    Returns:
      The merged tree, sharded as ``old``.

    Example:
      >>> fresh = ens.init(key, images[:1])                 # step 0
      >>> mixed = select_members(np.array([True, False]), fresh, state)   # state: step 20
      >>> np.asarray(mixed.step).tolist()
      [0, 20]
    """
    pick = lambda a, b: jnp.where(mask.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
    members = jax.tree.map(pick, member_part(fresh), member_part(old))
    sharing = shared_part(old)
    if sharing is None:
        return members
    # a layout's shared leaves (no member axis) are kept unless they are not finite: then
    # every member was found non-finite, and all start again from ``fresh``
    keep = _all_finite(sharing)
    shared = jax.tree.map(lambda a, b: jnp.where(keep, b, a), shared_part(fresh), sharing)
    return with_shared(members, shared)


class NonFiniteGuard:
    """Detects a non-finite loss per member, one chunk behind, once per event.

    ``on_nonfinite="stop"`` raises :class:`NonFiniteError` naming the members and the
    step; ``"reinit"`` re-initialises only those members (key ``fold_in(init_key, step)``,
    fresh optimizer state) and goes on. The chunk dispatched before the re-initialisation
    was computed from the bad members, so its losses of those members are ignored: each
    event re-initialises a member once and training continues from the fresh member. A
    member is re-initialised at most ``max_reinits`` times per run; one more event raises
    :class:`NonFiniteError`. :meth:`flush` (before every checkpoint and evaluation) also
    checks the parameters and optimizer state themselves (a step with a finite loss can
    still leave NaN/inf weights), so a state with NaN/inf is never saved or evaluated.

    Args:
      ens: the ensemble being trained.
      on_nonfinite: ``"stop"`` or ``"reinit"``.
      init_key: the run's initialisation key.
      sample: an input batch for :meth:`meshensemble.Ensemble.init`, e.g. ``images[:1]``.
      max_reinits: re-initialisations allowed per member (default :data:`MAX_REINITS`).

    Example:
      >>> guard = NonFiniteGuard(ens, "reinit", key, images[:1])
      >>> metrics = {"loss": jnp.ones((4, 2))}               # a chunk of 4 steps, 2 members
      >>> state = guard.check(state, metrics, 20, print)   # after each chunk
      >>> state = guard.flush(state, print)                  # before saving or evaluating
      >>> guard.flush(state, print) is state                 # nothing bad: the same state
      True
    """

    def __init__(
        self,
        ens: Ensemble,
        on_nonfinite: str,
        init_key: jax.Array,
        sample: Any,
        max_reinits: int = MAX_REINITS,
    ):
        if on_nonfinite not in ("stop", "reinit"):
            raise ValueError(f"on_nonfinite={on_nonfinite!r} is not allowed; choose stop, reinit")
        if isinstance(max_reinits, bool) or not isinstance(max_reinits, int) or max_reinits < 0:
            raise ValueError(f"max_reinits={max_reinits!r} must be an int >= 0")
        self.ens, self.on_nonfinite = ens, on_nonfinite
        self.init_key, self.sample = init_key, sample
        self.max_reinits = max_reinits
        self.reinits = np.zeros(ens.num_members, int)  # re-initialisations so far, per member
        # (step before the chunk, its losses [n, members], members to ignore [members])
        self._pending: tuple[int, jax.Array, np.ndarray] | None = None
        self._step = 0  # the step the newest chunk ended at

    def check(
        self,
        state: EnsembleState,
        metrics: dict[str, jax.Array],
        step: int,
        say: Callable[[str], None],
        last_checkpoint: Callable[[], int | None] = lambda: None,
        steps: int | None = None,
    ) -> EnsembleState:
        """Inspects the previous chunk's losses; keeps this chunk's for the next call.

        Args:
          state: the state after the chunk just dispatched.
          metrics: that chunk's metrics; ``metrics["loss"]`` is ``[rows, members]``.
          step: the run's step before that chunk.
          say: where the one-line report of a re-initialisation goes.
          last_checkpoint: the newest saved step, for the error message.
          steps: how many steps the chunk ran: its losses are the last ``steps`` rows
            (a paced call, :meth:`meshensemble.training.Feeder.paced`); None: all rows.

        Returns:
          ``state``, with re-initialised members if the previous chunk had bad ones.

        Raises:
          NonFiniteError: a bad loss with ``on_nonfinite="stop"``, or a member bad once
            more after ``max_reinits`` re-initialisations.
        """
        previous = self._pending
        rows = metrics["loss"].shape[0]
        first = step - (rows - (rows if steps is None else steps))  # the zero rows' "step"
        self._pending = (first, metrics["loss"], np.zeros(self.ens.num_members, bool))
        self._step = first + rows
        if previous is None:
            if state is not None:  # compiles the state check now, not at the first save
                finite_members(state)
            return state
        state, redone = self._inspect(state, previous, say, last_checkpoint)
        # this chunk ran on the bad members: their losses in it say nothing new
        self._pending[2][redone] = True
        return state

    def flush(
        self,
        state: EnsembleState,
        say: Callable[[str], None],
        last_checkpoint: Callable[[], int | None] = lambda: None,
    ) -> EnsembleState:
        """Inspects the pending chunk and the state itself now (before a checkpoint or an
        evaluation).

        Args:
          state: the current state.
          say: where a re-initialisation's report goes.
          last_checkpoint: the newest saved step, for the error message.

        Returns:
          ``state``, repaired if needed: every member finite.

        Raises:
          NonFiniteError: a bad loss or state with ``on_nonfinite="stop"``, or a member
            bad once more after ``max_reinits`` re-initialisations.
        """
        previous, self._pending = self._pending, None
        if previous is not None:
            state = self._inspect(state, previous, say, last_checkpoint)[0]
        bad = ~np.asarray(fetch(finite_members(state))) if state is not None else np.zeros(1, bool)
        if bad.any():
            members = np.flatnonzero(bad).tolist()
            state = self._repair(state, members, self._step, "state", say, last_checkpoint)[0]
        return state

    def _inspect(self, state, pending, say, last_checkpoint) -> tuple[EnsembleState, np.ndarray]:
        first_step, losses, ignore = pending
        bad = ~np.isfinite(fetch(losses))  # [n, members], already computed
        bad[:, ignore] = False
        if not bad.any():
            return state, np.zeros(self.ens.num_members, bool)
        members = sorted(set(np.nonzero(bad)[1].tolist()))
        at = first_step + 1 + int(np.nonzero(bad.any(1))[0][0])
        return self._repair(state, members, at, "loss", say, last_checkpoint)

    def _repair(self, state, members, at, what, say, last_checkpoint):
        """Re-initialises ``members`` (or raises): ``(state, the re-initialised mask)``."""
        last = last_checkpoint()
        keep = f"the last good checkpoint is {last}" if last is not None else "no checkpoint"
        if self.on_nonfinite == "reinit":
            over = [m for m in members if self.reinits[m] >= self.max_reinits]
            if over:
                raise NonFiniteError(
                    f"non-finite {what} in member(s) {over} at step {at} after "
                    f"{self.max_reinits} re-initialisations each (the limit per member): the "
                    f"run diverges from any start; {keep} (none with NaN is saved); lower the "
                    "learning rate and train again"
                )
            say(f"non-finite {what} in member(s) {members} at step {at}: re-initialising them")
            self.reinits[members] += 1
            redone = np.isin(np.arange(self.ens.num_members), members)
            fresh = self.ens.init(jax.random.fold_in(self.init_key, at), self.sample)
            return select_members(jnp.asarray(redone), fresh, state), redone
        raise NonFiniteError(
            f"non-finite {what} in member(s) {members} at step {at}; {keep}; lower the learning "
            "rate, or pass --on-nonfinite reinit to re-initialise only those members"
        )
