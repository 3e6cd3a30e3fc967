"""What stops or repairs a run: SIGTERM/SIGINT, and members whose loss became NaN/inf.

:class:`StopSignal` turns SIGTERM/SIGINT into a request the loop honours at the next
chunk boundary (after saving a checkpoint); all processes agree on it.
:class:`NonFiniteGuard` inspects each chunk's per-member losses one chunk behind (so it
never stalls the device queue) and either raises :class:`NonFiniteError` or
re-initialises only the bad members.

Example:
  >>> guard = NonFiniteGuard(ens, "reinit", init_key, images[:1])
  >>> state = guard.check(state, metrics, step, print)
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshensemble.core.distributed import fetch
from meshensemble.core.ensemble import Ensemble
from meshensemble.core.state import EnsembleState


class NonFiniteError(RuntimeError):
    """A member's loss became NaN or infinite (with ``on_nonfinite="stop"``)."""


class StopSignal:
    """SIGTERM/SIGINT ask the loop to save at the next chunk boundary and stop.

    Attributes:
      signal: the name of the signal received (``"SIGTERM"``...), ``"a peer's signal"``
        when another process received it, or None.

    Example:
      >>> stop = StopSignal.install()
      >>> try:
      ...     while not stop.requested(step): ...
      ... finally:
      ...     stop.uninstall()
    """

    def __init__(self) -> None:
        self.signal: str | None = None
        self._old: dict[int, Any] = {}

    @classmethod
    def install(cls) -> StopSignal:
        """Installs the handlers (in the main thread only; elsewhere signals stay as they are).

        Returns:
          The new :class:`StopSignal`.
        """
        stop = cls()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                stop._old[sig] = signal.signal(sig, stop._handle)
        return stop

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signal.Signals(signum).name

    def requested(self, step: int) -> bool:
        """Whether to stop after ``step``; all processes agree (the runtime's max).

        Args:
          step: the step just finished (for the reader; the answer does not depend on it).

        Returns:
          True when this process or any other received a signal.
        """
        flag = self.signal is not None
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            flag = bool(multihost_utils.process_allgather(np.int32(flag)).max())
            if flag and self.signal is None:
                self.signal = "a peer's signal"
        return flag

    def uninstall(self) -> None:
        """Restores the handlers that were there before :meth:`install`."""
        for sig, old in self._old.items():
            signal.signal(sig, old)


class NonFiniteGuard:
    """Detects a non-finite loss per member, one chunk behind (so it never stalls).

    ``on_nonfinite="stop"`` raises :class:`NonFiniteError` naming the members and the
    step; ``"reinit"`` re-initialises only those members and goes on.

    Args:
      ens: the ensemble being trained.
      on_nonfinite: ``"stop"`` or ``"reinit"``.
      init_key: the run's initialisation key.
      sample: an input batch for :meth:`meshensemble.Ensemble.init`, e.g. ``images[:1]``.

    Example:
      >>> guard = NonFiniteGuard(ens, "reinit", init_key, images[:1])
      >>> state = guard.check(state, metrics, step, print)   # after each chunk
      >>> state = guard.flush(state, print)                  # before saving or evaluating
    """

    def __init__(self, ens: Ensemble, on_nonfinite: str, init_key: jax.Array, sample: Any):
        if on_nonfinite not in ("stop", "reinit"):
            raise ValueError(f"on_nonfinite={on_nonfinite!r} is not allowed; choose stop, reinit")
        self.ens, self.on_nonfinite = ens, on_nonfinite
        self.init_key, self.sample = init_key, sample
        self._pending: tuple[int, jax.Array] | None = None

    def check(
        self,
        state: EnsembleState,
        metrics: dict[str, jax.Array],
        step: int,
        say: Callable[[str], None],
        last_checkpoint: Callable[[], int | None] = lambda: None,
    ) -> EnsembleState:
        """Inspects the previous chunk's losses; keeps this chunk's for the next call.

        Args:
          state: the state after the chunk just dispatched.
          metrics: that chunk's metrics; ``metrics["loss"]`` is ``[n, members]``.
          step: the run's step before that chunk.
          say: where the one-line report of a re-initialisation goes.
          last_checkpoint: the newest saved step, for the error message.

        Returns:
          ``state``, with re-initialised members if the previous chunk had bad ones.

        Raises:
          NonFiniteError: a bad loss with ``on_nonfinite="stop"``.
        """
        previous, self._pending = self._pending, (step, metrics["loss"])
        if previous is None:
            return state
        return self._inspect(state, *previous, say, last_checkpoint)

    def flush(
        self,
        state: EnsembleState,
        say: Callable[[str], None],
        last_checkpoint: Callable[[], int | None] = lambda: None,
    ) -> EnsembleState:
        """Inspects the pending chunk now (before a checkpoint or an evaluation).

        Args:
          state: the current state.
          say: where a re-initialisation's report goes.
          last_checkpoint: the newest saved step, for the error message.

        Returns:
          ``state``, repaired if needed.

        Raises:
          NonFiniteError: a bad loss with ``on_nonfinite="stop"``.
        """
        previous, self._pending = self._pending, None
        if previous is None:
            return state
        return self._inspect(state, *previous, say, last_checkpoint)

    def _inspect(self, state, first_step, losses, say, last_checkpoint) -> EnsembleState:
        bad = ~np.isfinite(fetch(losses))  # [n, members], already computed
        if not bad.any():
            return state
        members = sorted(set(np.nonzero(bad)[1].tolist()))
        at = first_step + 1 + int(np.nonzero(bad.any(1))[0][0])
        if self.on_nonfinite == "reinit":
            say(f"non-finite loss in member(s) {members} at step {at}: re-initialising them")
            key = jax.random.fold_in(self.init_key, at)
            return _reinit_members(self.ens, state, members, key, self.sample)
        last = last_checkpoint()
        keep = f"the last good checkpoint is {last}" if last is not None else "no checkpoint"
        raise NonFiniteError(
            f"non-finite loss in member(s) {members} at step {at}; {keep}; lower the learning "
            "rate, or pass --on-nonfinite reinit to re-initialise only those members"
        )


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
