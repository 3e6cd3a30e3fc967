"""Early stopping and keep-best: a validation metric watched at each scheduled evaluation.

``--early-stopping METRIC:PATIENCE`` stops a run after ``PATIENCE`` evaluations in a row
without an improvement of ``METRIC``; ``--keep-best METRIC`` keeps the checkpoint where
``METRIC`` was best (never deleted by ``--keep``) and names it. ``METRIC`` is a validation
metric the run's task logs: the task's :attr:`~meshensemble.tasks.Task.validation_metrics`
names them, their ``metrics.jsonl`` keys and whether lower or higher is better; nothing
here knows a task by name.

What the watch has seen (best value, its step, evaluations since) is plain JSON kept in
the loop position saved with every checkpoint
(:class:`~meshensemble.training.loop.LoopPosition`), so a resumed run decides exactly as an
uninterrupted one; every process makes the same decision from the same replicated metrics.
Only the run's scheduled evaluations count (every ``eval_every`` epochs and the end), not
the extra one a ``--max-steps`` stop makes, so where a run was cut changes nothing.

Example:
  >>> watch = Monitors.from_config(me.TrainConfig(validation=100, early_stopping="val_nll:2"),
  ...                              me.tasks.Classification())
  >>> states = {}
  >>> for step, nll in ((10, 0.5), (20, 0.6), (30, 0.7)):
  ...     states = watch.update(states, {"val_ensemble_nll": nll}, step)
  >>> watch.stopping(states), states["early_stopping"]["step"]
  (True, 10)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from meshensemble.core.tasks import Task

EARLY = "early_stopping"
"""Key of the early-stopping watch in the loop position and in ``metrics.jsonl`` records."""
BEST = "keep_best"
"""Key of the keep-best watch in the loop position, ``metrics.jsonl`` and ``config.json``'s
``resolved`` entry (``{"metric", "key", "value", "step"}``)."""


def parse_early_stopping(spec: str) -> tuple[str, int]:
    """``"METRIC:PATIENCE"`` as ``(metric, patience)``.

    Raises:
      ValueError: not ``METRIC:PATIENCE`` with a positive integer patience (one line).

    Example:
      >>> parse_early_stopping("val_nll:3")
      ('val_nll', 3)
    """
    metric, sep, patience = str(spec).rpartition(":")
    if not sep or not metric or not patience.isdigit() or int(patience) < 1:
        raise ValueError(
            f"early_stopping={spec!r} must be METRIC:PATIENCE, e.g. val_nll:3 (stop after 3 "
            "evaluations without improvement)"
        )
    return metric, int(patience)


@dataclasses.dataclass(frozen=True)
class Watch:
    """One validation metric a run watches.

    Attributes:
      metric: the name given (e.g. ``"val_nll"``); key: its ``metrics.jsonl`` key (e.g.
      ``"val_ensemble_nll"``); higher: whether higher values are better.
    """

    metric: str
    key: str
    higher: bool

    @classmethod
    def of(cls, task: Task, metric: str, flag: str) -> Watch:
        """The watch of ``metric``, a name or key of ``task.validation_metrics``.

        Raises:
          ValueError: the task logs no such validation metric (one line listing those
            it logs).

        Example:
          >>> Watch.of(me.tasks.Regression(), "val_crps", "--keep-best")
          Watch(metric='val_crps', key='val_crps', higher=False)
        """
        known = dict(task.validation_metrics)
        by_key = {key: (key, way) for key, way in known.values()}
        if metric not in known and metric not in by_key:
            names = ", ".join(known) or "none"
            raise ValueError(
                f"{flag} {metric}: a {task.name} run logs no such validation metric; it logs "
                f"{names} (each also by its metrics.jsonl key)"
            )
        key, way = known.get(metric) or by_key[metric]
        return cls(metric, key, way == "max")

    def better(self, value: Any, best: Any) -> bool:
        """Whether ``value`` improves on ``best`` (None: nothing yet); NaN never does."""
        if not isinstance(value, int | float) or not math.isfinite(value):
            return False
        return best is None or (value > best if self.higher else value < best)

    def update(self, state: Mapping[str, Any] | None, value: Any, step: int) -> dict[str, Any]:
        """The state after an evaluation at ``step`` scored ``value`` (a new dict).

        A state of another metric (the run was resumed with another flag) starts over.

        Example:
          >>> w = Watch("val_nll", "val_nll", False)
          >>> w.update(w.update(None, 0.5, 10), 0.7, 20)
          {'metric': 'val_nll', 'value': 0.5, 'step': 10, 'since': 1}
        """
        if not state or state.get("metric") != self.metric:
            state = {"metric": self.metric, "value": None, "step": None, "since": 0}
        if self.better(value, state["value"]):
            return {"metric": self.metric, "value": float(value), "step": int(step), "since": 0}
        return {**state, "since": int(state["since"]) + 1}


@dataclasses.dataclass(frozen=True)
class Monitors:
    """What a run watches: early stopping and keep-best (either may be None).

    Attributes:
      early: the early-stopping watch; patience: its evaluations without improvement.
      best: the keep-best watch.
    """

    early: Watch | None = None
    patience: int = 0
    best: Watch | None = None

    @classmethod
    def from_config(cls, cfg: Any, task: Task) -> Monitors:
        """The watches ``cfg.early_stopping`` and ``cfg.keep_best`` ask for.

        Raises:
          ValueError: a metric the task does not log (one line; nothing written yet).
        """
        early, patience = None, 0
        if cfg.early_stopping:
            metric, patience = parse_early_stopping(cfg.early_stopping)
            early = Watch.of(task, metric, "--early-stopping")
        best = Watch.of(task, cfg.keep_best, "--keep-best") if cfg.keep_best else None
        return cls(early, patience, best)

    @property
    def active(self) -> bool:
        """Whether anything is watched."""
        return self.early is not None or self.best is not None

    def update(
        self, states: Mapping[str, Any], record: Mapping[str, Any], step: int
    ) -> dict[str, Any]:
        """The loop position's watch states after the evaluation ``record`` at ``step``."""
        out = dict(states)
        for name, watch in ((EARLY, self.early), (BEST, self.best)):
            if watch is not None:
                out[name] = watch.update(states.get(name), record.get(watch.key), step)
        return out

    def stopping(self, states: Mapping[str, Any]) -> bool:
        """Whether early stopping has run out of patience."""
        state = states.get(EARLY) or {}
        return self.early is not None and state.get("metric") == self.early.metric and (
            int(state.get("since", 0)) >= self.patience
        )

    def best_step(self, states: Mapping[str, Any]) -> int | None:
        """The step of the best checkpoint kept (keep-best), or None."""
        state = states.get(BEST) or {}
        if self.best is None or state.get("metric") != self.best.metric:
            return None
        return state.get("step")

    def best_record(self, states: Mapping[str, Any]) -> dict[str, Any] | None:
        """``config.json``'s ``resolved.keep_best``: ``{"metric", "key", "value", "step"}``."""
        if self.best_step(states) is None:
            return None
        state = states[BEST]
        return {"metric": self.best.metric, "key": self.best.key, "value": state["value"],
                "step": state["step"]}  # fmt: skip

    def stop_line(self, states: Mapping[str, Any], step: int) -> str:
        """The one line a run prints when early stopping ends it."""
        s = states[EARLY]
        best = "never finite" if s["step"] is None else f"best {s['value']:.4g} at step {s['step']}"
        return (
            f"early stopping at step {step}: {s['metric']} did not improve for {s['since']} "
            f"evaluations ({best})"
        )

    def best_line(self, states: Mapping[str, Any]) -> str:
        """What the run's last line adds about the best checkpoint ("" without one)."""
        held = self.best_record(states)
        if held is None:
            return ""
        return (
            f"; best checkpoint {held['step']} ({held['metric']} {held['value']:.4g}): "
            "--checkpoint best"
        )
