"""The interleaved round-robin timer and its statistics.

Every case is timed in the same rounds, one call of each case per round, after
compilation and warm-up rounds, so that load from other jobs on the machine falls on all
cases alike; a case's time per step is the median over the rounds, with its
interquartile range.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np


class Timed(Protocol):
    """What the timer needs of a case: ``run()``, its ``samples`` and its spec's ``k``."""

    samples: list[float]
    spec: Any

    def run(self) -> None: ...


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn()`` takes.

    Args:
      fn: a function of no arguments that waits for its own results.

    Returns:
      The wall-clock seconds.

    Example:
      >>> timed(runner.run) > 0   # one call of a prepared runner
      True
    """
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def round_robin(
    runners: Iterable[Timed],
    repeats: int,
    warmup: int = 0,
    case_budget: float | None = None,
    say: Callable[[int, int], None] | None = None,
) -> None:
    """Times the runners round by round: one call of each per round, in the same order.

    Each timed call appends its seconds per step (the call's time over ``spec.k``) to the
    runner's ``samples``.

    Args:
      runners: prepared cases (compiled, first call made).
      repeats: timed rounds.
      warmup: untimed rounds first.
      case_budget: skip a runner in later rounds once its timed calls add up to this many
        seconds (it keeps at least one sample); None for no limit.
      say: called with ``(round, repeats)`` after each timed round.

    Example:
      >>> round_robin(runners.values(), repeats=2, warmup=1)
      >>> stats(runner.samples)["median"] > 0
      True
    """
    runners = list(runners)
    for _ in range(warmup):
        for runner in runners:
            runner.run()
    for rep in range(repeats):
        for runner in runners:
            spent = sum(runner.samples) * runner.spec.k
            if runner.samples and case_budget is not None and spent >= case_budget:
                continue
            t = time.perf_counter()
            runner.run()
            runner.samples.append((time.perf_counter() - t) / runner.spec.k)
        if say is not None:
            say(rep + 1, repeats)


def stats(samples: Sequence[float]) -> dict[str, Any]:
    """The median and quartiles of a case's samples.

    Args:
      samples: seconds per step, at least one.

    Returns:
      ``median``, ``q1``, ``q3``, ``iqr`` (``q3 - q1``), ``n`` and the ``samples``.

    Example:
      >>> stats([1.0, 2.0, 3.0])["median"]
      2.0
    """
    a = np.asarray(samples, np.float64)
    q1, med, q3 = (float(v) for v in np.percentile(a, [25, 50, 75]))
    return {"median": med, "q1": q1, "q3": q3, "iqr": q3 - q1, "n": len(a), "samples": a.tolist()}


def loadavg() -> list[float] | None:
    """The machine's 1, 5 and 15 minute load averages (other jobs' load shows here).

    Returns:
      The three averages, or None where the platform has none.

    Example:
      >>> len(loadavg())   # e.g. [0.52, 0.61, 0.7]
      3
    """
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None
