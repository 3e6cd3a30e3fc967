"""The task seam: :class:`Task`, the open protocol the one engine asks about everything it trains.

A task says what a member outputs and its loss, which metrics a train step reports, how
the members' predictions combine, what an evaluation streams and scores, what
``predict``/``export`` serve, how a run is calibrated, checked and reported. The engine
(:mod:`meshensemble.core.steps`, :class:`meshensemble.Ensemble`, the training loop,
evaluation, serving and the command line) asks the task and never branches on which task
it is. Collectives stay in :mod:`meshensemble.core.steps`: a task's per-device methods get
a :class:`Reducer` handle (means, sums, maxima over every member of the whole ensemble,
sums over the batch split, pairs of members) and never call ``lax`` themselves.

The implementations live in :mod:`meshensemble.tasks` (``Classification``,
``Regression``); a user's task is a subclass of :class:`Task` anywhere (docs/tasks.md).
Tasks are found by name (:func:`register`, :func:`task_class`) or as ``"module:Class"``.

Example:
  >>> task_names()[:2]
  ('classification', 'regression')
  >>> task_class("regression").name
  'regression'
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple, Protocol

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec

from meshensemble.core.mesh import ENSEMBLE, MEMBERS, REPLICATED
from meshensemble.runtime.plugins import load_object

__all__ = [
    "EvalSums",
    "Reducer",
    "Task",
    "check_task",
    "metric_specs",
    "register",
    "softmax_cross_entropy",
    "task_class",
    "task_names",
]

PyTree = Any


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Default per-example loss: softmax cross-entropy with integer labels.

    Computed as the Flax HOWTO computes it, against one-hot labels
    (``optax.softmax_cross_entropy``): the same value as
    ``optax.softmax_cross_entropy_with_integer_labels`` up to float rounding, without
    its gather and scatter, which XLA:CPU runs slowly (2-3% of the user CNN's step on 8
    CPU devices).

    Args:
      logits: ``[B, classes]``.
      labels: ``[B]`` integer class indices.

    Returns:
      ``[B]`` losses.

    Example:
      >>> me.softmax_cross_entropy(jnp.zeros((2, 10)), jnp.array([1, 2]))  # log 10 each
      Array([2.3025851, 2.3025851], dtype=float32)
    """
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, logits.shape[-1]))


class Reducer(Protocol):
    """What a task's per-device methods reduce with (made by :mod:`meshensemble.core.steps`).

    Inside a step every device sees its local members' values stacked on a leading axis
    ``[m, ...]`` and its part of the batch; the reducer turns them into the whole
    ensemble's and the whole batch's (the collectives over ``ensemble`` and ``data``).
    Every device of an ``ensemble`` group gets the same answer.

    Attributes:
      members: ``M``, the ensemble's size (a Python int).

    Example:
      >>> class MeanOnly(me.tasks.Task):        # a task's combine, written with the reducer
      ...     def combine(self, predictions, reduce):
      ...         return reduce.mean(predictions)   # [m, b, ...] -> [b, ...], all M members
    """

    members: int

    def mean(self, x: PyTree) -> PyTree:
        """The mean over every member of ``x`` (leaves ``[m, ...]``): leaves ``[...]``."""

    def sum(self, x: PyTree) -> PyTree:
        """The sum over every member of ``x`` (leaves ``[m, ...]``): leaves ``[...]``."""

    def max(self, x: PyTree) -> PyTree:
        """The maximum over every member of ``x`` (leaves ``[m, ...]``): leaves ``[...]``."""

    def min(self, x: PyTree) -> PyTree:
        """The minimum over every member of ``x`` (leaves ``[m, ...]``): leaves ``[...]``."""

    def pool(self, x: PyTree) -> PyTree:
        """The mean over every device of ``x``, a statistic already averaged over the local
        members (each device holds the same number): the mean over all members."""

    def data_mean(self, x: PyTree) -> PyTree:
        """The mean of ``x`` over the parts of the batch (the ``data`` axis)."""

    def data_sum(self, x: PyTree) -> PyTree:
        """The sum of ``x`` over the parts of the batch (the ``data`` axis)."""

    def pairs(self, fn: Callable[[PyTree, PyTree], jax.Array], x: PyTree) -> jax.Array:
        """``sum_{devices d, e} fn(x_d, x_e)``: every ordered pair of members' local stacks
        meets once (members passed round the ``ensemble`` ring), summed."""


class EvalSums(NamedTuple):
    """What a task's per-device evaluation returns for one batch, by layout.

    Attributes:
      totals: sums over the batch, the same on every device (replicated), e.g. ``{"nll":
        [], "count": []}``; the batches' are added on the host.
      members: per-member sums, leaves ``[m, ...]`` (split over ``ensemble``), added too.
      examples: per-example values, leaves ``[b, ...]`` (split over ``data``), concatenated
        over batches (the padding's rows dropped).
      member_examples: per-member, per-example values ``[m, b, ...]``, concatenated on axis 1.

    Example:
      >>> EvalSums({"count": jnp.float32(3)})._fields
      ('totals', 'members', 'examples', 'member_examples')
    """

    totals: PyTree
    members: PyTree = {}
    examples: PyTree = {}
    member_examples: PyTree = {}


class Task(abc.ABC):
    """The open protocol of a task: subclass it and fill in what the engine asks.

    Abstract (every task has them): :meth:`output_width`, :meth:`loss`,
    :meth:`member_predictions`, :meth:`combine`, :meth:`eval_sums`, :meth:`finalize`.
    Everything else has a default that a task may override:
    per-member and ensemble train metrics (none), serving outputs (the combined and
    member predictions), no OOD scores, no calibrator, generic report lines, no figures,
    the run's setup from data (:meth:`for_data`), its record in ``config.json``
    (:meth:`record`, :meth:`from_record`), dataset checks and command-line defaults.

    Per-device methods (``member_metrics``, ``member_predictions``, ``combine``,
    ``ensemble_metrics``, ``eval_sums``, ``serve``) run inside the compiled step on local
    views: ``outputs`` ``[m, b, ...]`` (the model's float32 outputs, ``m`` local members,
    ``b`` this device's examples; ``member_metrics`` gets one member's ``[b, ...]``) and
    reduce with the :class:`Reducer` they are given. A task is a frozen dataclass (hashable:
    programs are cached by it).

    Attributes:
      name: the registered name, recorded in ``config.json`` (``--task NAME``).
      target_ndim: dimensions of one example's target: 0 for a class id, 1 for a row.
      target_dtype: the dtype targets are placed on the devices with.
      input_word, target_word: what messages call a batch's inputs and targets.
      member_metric_names: what :meth:`member_metrics` returns (per member, ``[m]``).
      ensemble_metric_names: what :meth:`ensemble_metrics` returns; the train step reports
        them as ``ensemble_<name>`` (scalars; NaN for per-member batches).
      cli_defaults: ``TrainConfig`` values this task uses where the user gave none.

    Example:
      >>> isinstance(ens.task, me.tasks.Task), ens.task.name
      (True, 'classification')
    """

    name: ClassVar[str] = ""
    target_ndim: ClassVar[int] = 0
    target_dtype: ClassVar[Any] = np.int32
    input_word: ClassVar[str] = "inputs"
    target_word: ClassVar[str] = "targets"
    member_metric_names: ClassVar[tuple[str, ...]] = ()
    ensemble_metric_names: ClassVar[tuple[str, ...]] = ()
    cli_defaults: ClassVar[Mapping[str, Any]] = {}

    # ------------------------------------------------------------ the member
    @abc.abstractmethod
    def output_width(self) -> int:
        """The width of the model's last output axis this task needs (e.g. the classes)."""

    @abc.abstractmethod
    def loss(self, outputs: jax.Array, targets: jax.Array) -> jax.Array:
        """One member's per-example loss: ``outputs [b, W]``, ``targets [b, ...]`` -> ``[b]``."""

    def member_metrics(self, outputs: jax.Array, targets: jax.Array, reduce: Reducer) -> dict:
        """One member's train metrics on its batch, averaged over ``data`` (``reduce``).

        Args:
          outputs: ``[b, W]``; targets: ``[b, ...]``; reduce: the mesh's :class:`Reducer`.

        Returns:
          ``{name: scalar}`` for every name of :attr:`member_metric_names` (default none).
        """
        return {}

    # ------------------------------------------------------------ the ensemble
    @abc.abstractmethod
    def member_predictions(self, outputs: jax.Array) -> PyTree:
        """Each member's prediction from its outputs (e.g. its softmax), leaves ``[m, b, ...]``."""

    @abc.abstractmethod
    def combine(self, predictions: PyTree, reduce: Reducer) -> PyTree:
        """The ensemble's prediction from the members' (``reduce`` over all): ``[b, ...]``."""

    def ensemble_metrics(self, predictions: PyTree, targets: jax.Array, reduce: Reducer) -> dict:
        """The ensemble's train metrics on a shared batch (every member saw ``targets``).

        Returns:
          ``{name: scalar}`` for every name of :attr:`ensemble_metric_names` (default none).
        """
        return {}

    # ------------------------------------------------------------ evaluation
    @abc.abstractmethod
    def eval_sums(
        self, outputs: jax.Array, targets: jax.Array, mask: jax.Array, reduce: Reducer, **options
    ) -> EvalSums:
        """The sums one batch adds to an evaluation (``mask [b]`` is 0 on padding rows).

        ``options`` are the evaluation's keywords (``num_bins``); ignore the ones you do
        not use. Returns an :class:`EvalSums`.
        """

    @abc.abstractmethod
    def finalize(self, sums: EvalSums, **options) -> dict[str, Any]:
        """The scores of a whole set from its summed :class:`EvalSums` (host numpy).

        ``sums.examples`` holds every example's values in order (padding dropped).
        Returns a flat dict of floats and lists (``Ensemble.evaluate``'s result).
        """

    # ------------------------------------------------------------ serving
    def serve(self, outputs: jax.Array, reduce: Reducer, members: bool) -> tuple[dict, dict]:
        """What ``predict`` serves per batch: ``(per_example, per_member)`` dicts.

        ``per_example`` leaves ``[b, ...]`` (the same on every ``ensemble`` device),
        ``per_member`` leaves ``[m, b, ...]`` (only with ``members``). Default: the
        combined prediction under ``"prediction"`` and each member's under
        ``"member_prediction"``.
        """
        preds = self.member_predictions(outputs)
        return {"prediction": self.combine(preds, reduce)}, (
            {"member_prediction": preds} if members else {}
        )

    def finish(self, out: dict[str, Any], calibration: Any, **options) -> dict[str, Any]:
        """The served arrays of a batch on the host, ``calibration`` applied (default: as is)."""
        return dict(out)

    def output_keys(self, members: bool, calibrated: bool) -> tuple[str, ...]:
        """The keys ``predict`` writes, in order (default :meth:`serve`'s)."""
        return ("prediction",) + (("member_prediction",) if members else ())

    def tempered(
        self,
        predict: Callable[[bool, bool], Any],
        temperature: Any,
        num_members: int,
        members: bool,
        logits: bool = False,
    ) -> Any:
        """``Ensemble.predict``/``predict_members`` with a ``temperature`` or ``logits=True``.

        Args:
          predict: ``(members, logits) -> array``: the ensemble's uncalibrated program.
          temperature: as ``Ensemble.predict`` took it; num_members: ``M``.
          members: ``predict_members`` (True) or ``predict``; logits: the raw outputs.

        Raises:
          ValueError: the task has no temperature or logits (the default, one line).
        """
        raise ValueError(
            f"temperature and logits are options of classification ensembles; task "
            f"{self.name!r} has neither: drop them"
        )

    def ood_sums(
        self, outputs: jax.Array, targets: jax.Array, mask: jax.Array, reduce: Reducer, **options
    ) -> EvalSums:
        """Per-example OOD scores of a batch (tasks that offer OOD detection; default none)."""
        raise ValueError(f"task {self.name!r} offers no OOD scores")

    # ------------------------------------------------------------ host checks
    def as_targets(self, targets: Any) -> Any:
        """Targets as the steps take them (dtype, shape), checked on the host.

        Args:
          targets: ``[N, ...]`` or per member ``[members, N, ...]`` (numpy or ``jax.Array``).

        Returns:
          The targets, e.g. ``[N]`` floats as ``[N, 1]`` (default: as given).

        Raises:
          ValueError: one line naming the targets' dtype or shape and the fix.
        """
        return targets

    def check_targets(self, targets: Any, width: Callable[[], int]) -> None:
        """Checks the targets' values once their shape is right (default: nothing).

        Args:
          targets: from :meth:`as_targets`.
          width: ``() -> int``, the model's output width (computed when called).

        Raises:
          ValueError: one line naming the bad value (e.g. a label out of range).
        """
        return None

    def check_dataset(self, dataset: Any) -> None:
        """Refuses data this task cannot train on (one line); default: nothing."""
        return None

    # ------------------------------------------------------------ runs
    def for_data(self, dataset: Any, options: Mapping[str, Any]) -> Task:
        """This task set up for a run on ``dataset`` (e.g. statistics of its train split).

        Args:
          dataset: the run's data after the validation split.
          options: the run's ``TrainConfig`` fields (as a dict).

        Returns:
          The task the run trains (default ``self``).

        Raises:
          ValueError: an option this task does not take (e.g. ``label_smoothing``).
        """
        if options.get("label_smoothing"):
            raise ValueError(
                f"label_smoothing={options['label_smoothing']!r} is for class labels; task "
                f"{self.name!r} does not take it: leave --label-smoothing at 0"
            )
        return self

    def record(self) -> dict[str, Any]:
        """What ``config.json`` records of the task (``resolved.task``), for :meth:`from_record`."""
        return {"name": self.name}

    @classmethod
    def from_record(cls, record: Mapping[str, Any], resolved: Mapping[str, Any]) -> Task:
        """The task a run recorded (``resolved.task``, or older runs' own entries in
        ``resolved``); default ``cls()``."""
        return cls()

    # ------------------------------------------------------------ reports
    def epoch_line(self, record: Mapping[str, Any], epochs: int, seconds: float) -> str:
        """The line printed after each evaluation of a run (default: its test scores)."""
        loss = record.get("train_mean_member_loss", float("nan"))
        scores = ", ".join(
            f"{k[5:]} {v:.4f}" for k, v in record.items() if k.startswith("test_") and _num(v)
        )
        return f"epoch {record['epoch']}/{epochs} step {record['step']}: loss {loss:.4f}, " + (
            f"test {scores} | {seconds:.1f}s"
        )

    def final_table(self, record: Mapping[str, Any]) -> str:
        """The text printed at the end of a run (default: nothing)."""
        return ""

    def run_figures(self, history: list[dict[str, Any]], predict: Any, train: Any) -> dict:
        """Figures a finished run draws: ``{file name: draw(path)}`` (default none).

        Args:
          history: the run's ``metrics.jsonl`` records.
          predict: ``(x, members) -> host outputs`` of the trained ensemble (every process
            calls it; only process 0 draws).
          train: ``(x_train, y_train)``.
        """
        return {}


def metric_specs(task: Task, steps: bool = False) -> dict[str, PartitionSpec]:
    """The layout of a train step's metrics: per member over ``ensemble``, or replicated.

    Args:
      task: the task (its metric names).
      steps: the metrics of a chunk, stacked over its steps (``[K, members]``, ``[K]``).

    Returns:
      ``{"loss", member metrics: split over ensemble; "ensemble_<name>": replicated}``.

    Example:
      >>> sorted(metric_specs(ens.task))
      ['accuracy', 'ensemble_accuracy', 'ensemble_nll', 'loss']
    """
    member = PartitionSpec(None, ENSEMBLE) if steps else MEMBERS
    specs = dict.fromkeys(("loss", *task.member_metric_names), member)
    return specs | {f"ensemble_{k}": REPLICATED for k in task.ensemble_metric_names}


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


_REGISTRY: dict[str, type[Task]] = {}


def register(cls: type[Task]) -> type[Task]:
    """Registers a :class:`Task` subclass under its ``name`` (a class decorator).

    Raises:
      ValueError: no name, or the name taken by another class.

    Example:
      >>> @register
      ... class Counts(me.tasks.Regression):
      ...     name = "counts_doc"
      >>> task_class("counts_doc") is Counts
      True
    """
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} has no name; set the class attribute name = '...'")
    if _REGISTRY.get(name, cls) is not cls:
        raise ValueError(f"task name {name!r} is taken by {_REGISTRY[name].__qualname__}")
    _REGISTRY[name] = cls
    return cls


def task_names() -> tuple[str, ...]:
    """The registered task names, e.g. ``("classification", "regression")``."""
    return tuple(_REGISTRY)


def task_class(spec: str) -> type[Task]:
    """The task class ``spec`` names: a registered name or ``"module:Class"``.

    Raises:
      ValueError: an unknown name, a module that does not import, or not a Task subclass.

    Example:
      >>> task_class("meshensemble.tasks:Regression").name
      'regression'
    """
    if not isinstance(spec, str) or (":" not in spec and spec not in _REGISTRY):
        raise ValueError(
            f"task={spec!r} is unknown; choose one of {', '.join(_REGISTRY)} or give a "
            "Task subclass as module:Class"
        )
    cls = _REGISTRY[spec] if spec in _REGISTRY else load_object(spec, "task")
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ValueError(f"task={spec!r} is {cls!r}, not a subclass of meshensemble.tasks.Task")
    return cls


def check_task(task: Any) -> Task:
    """``task``, or the default task (classification) for None; TypeError otherwise.

    Example:
      >>> check_task(None).name
      'classification'
    """
    if task is None:
        return task_class("classification")()
    if isinstance(task, Task):
        return task
    raise TypeError(
        f"task={task!r} is not a task; pass an instance of a meshensemble.tasks.Task "
        "subclass, e.g. me.tasks.Classification() or me.tasks.Regression(targets=T)"
    )
