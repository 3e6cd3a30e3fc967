"""How many steps a compiled call may run, so that a stop is honoured within seconds.

With ``K`` steps per call (a whole epoch by default on accelerators), SIGTERM and
``--checkpoint-every`` can only be honoured between calls. A :class:`Pacer` bounds a
call's wall time: it measures the seconds per step from the first calls (a few short
calls of 1, 2, 4... steps, each waited for) and from then on caps the steps per call
at :func:`steps_within` of half of ``TrainConfig.stop_within``. A stop requested
during a call is then honoured after at most that call and the one queued behind it,
plus the checkpoint's save.

The calls all run one compiled program whose step count is an argument
(:meth:`meshensemble.training.Feeder.paced`), so a capped run computes bitwise the
same members as an uncapped one. Every measured time is agreed across processes (the
maximum, :func:`meshensemble.runtime.distributed.agree_max`), so every process computes
the same caps and runs the same calls.

Example:
  >>> pacer = Pacer(k=469, stop_within=10.0)
  >>> n = pacer.count(469)           # 1: nothing measured yet
  >>> n
  1
  >>> t = pacer.start()
  >>> state, metrics = ens.train_step(state, images, labels)   # the loop: feeder.run(...)
  >>> pacer.observe(n, metrics["loss"], t)    # the first call is not timed (it compiles)
  >>> pacer.cap
  1
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax

from meshensemble.runtime.distributed import agree_max

CALL_SHARE = 0.5
"""The share of ``stop_within`` one call may run: a stop can wait for two calls."""
MEASURE_SHARE = 0.05
"""Calls shorter than this share of ``stop_within`` are too short to time a step from
(dispatch costs dominate): the pacer doubles the next call's steps instead."""
SETTLED_SHARE = 0.25
"""A whole call of ``K`` steps shorter than this share of the call's budget stops the
measuring (the calls are no longer waited for: the device queue stays full)."""


def steps_within(seconds_per_step: float, budget: float, k: int) -> int:
    """The most steps, at most ``k`` and at least 1, that run within ``budget`` seconds.

    Args:
      seconds_per_step: the measured (agreed) wall time of one step.
      budget: the seconds a call may take.
      k: the steps per call the run asked for (the program's maximum).

    Returns:
      ``clamp(floor(budget / seconds_per_step), 1, k)``.

    Example:
      >>> steps_within(0.1, 5.0, 469), steps_within(0.001, 5.0, 469), steps_within(9.0, 5.0, 8)
      (50, 469, 1)
    """
    if seconds_per_step <= 0:
        return k
    return int(max(1, min(k, math.floor(budget / seconds_per_step))))


class Pacer:
    """Caps the steps of each call so that one call runs about ``stop_within / 2`` seconds.

    Inactive (every call runs what the loop asks) when ``k == 1`` or
    ``stop_within == 0``. While it measures, :meth:`observe` waits for each call to
    finish (so the time is the call's own) and agrees the time across processes; once
    a whole call of ``k`` steps is far inside the budget it stops measuring.

    Args:
      k: steps per call the run asked for (``TrainConfig.chunk_steps`` or the default).
      stop_within: ``TrainConfig.stop_within``: seconds within which a stop is honoured;
        0 turns the pacing off.
      clock: the time source (``time.perf_counter``; tests pass a fake one).

    Attributes:
      cap: the most steps the next call may run.
      seconds_per_step: the agreed measured time of a step, or None before a measure.
      measuring: whether calls are still timed.

    Example:
      >>> pacer = Pacer(469, 10.0)
      >>> pacer.cap
      1
    """

    def __init__(self, k: int, stop_within: float, clock: Any = time.perf_counter):
        self.k = int(k)
        self.budget = float(stop_within) * CALL_SHARE
        self.clock = clock
        self.measuring = self.k > 1 and self.budget > 0
        self.cap = 1 if self.measuring else self.k
        self.seconds_per_step: float | None = None
        self._calls = 0

    def count(self, want: int) -> int:
        """The steps to run in the next call: ``min(want, cap)``.

        Args:
          want: what the loop would run (up to the epoch's end, the run's end or the
            next checkpoint step).

        Returns:
          The steps for the next call, ``>= 1``.
        """
        return max(1, min(want, self.cap))

    def start(self) -> float:
        """The clock's time before a call is dispatched (pass it to :meth:`observe`)."""
        return self.clock()

    def observe(self, n: int, result: Any, started: float) -> None:
        """Times a call of ``n`` steps (waiting for ``result``) and updates :attr:`cap`.

        The first call is not timed (it compiles or loads the program). A call that took
        at least :data:`MEASURE_SHARE` of ``stop_within`` gives the step time and the cap
        (:func:`steps_within` of half of ``stop_within``); a shorter call that ran the
        whole cap doubles it. All processes call this for the same calls and agree on
        the time (the maximum), so they take the same decisions.

        Args:
          n: the steps the call ran.
          result: an output of the call (waited for while measuring).
          started: :meth:`start`'s value taken before the call.
        """
        if not self.measuring:
            return
        self._calls += 1
        jax.block_until_ready(result)
        seconds = agree_max(self.clock() - started)
        if self._calls > 1:  # the first call compiles: not a step time
            self.update(n, seconds)

    def update(self, n: int, seconds: float) -> None:
        """Updates :attr:`cap` from an agreed call time (the rule :meth:`observe` applies).

        Args:
          n: the steps of the call.
          seconds: its agreed wall time.

        Example:
          >>> pacer = Pacer(469, 10.0)
          >>> pacer.update(1, 0.1); pacer.cap        # a short call: double
          2
          >>> pacer.update(2, 1.0); pacer.cap        # 0.5 s a step: 5 s / 0.5 s
          10
        """
        if seconds >= MEASURE_SHARE * self.budget / CALL_SHARE:
            self.seconds_per_step = seconds / n
            self.cap = steps_within(self.seconds_per_step, self.budget, self.k)
        elif n >= self.cap:
            self.cap = min(self.k, 2 * self.cap)
        if n == self.k and seconds < SETTLED_SHARE * self.budget:
            self.measuring = False
