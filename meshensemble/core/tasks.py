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
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from meshensemble.core.mesh import ENSEMBLE, MEMBERS, REPLICATED
from meshensemble.numerics.statmath import softmax_cross_entropy as softmax_cross_entropy
from meshensemble.runtime.plugins import load_object

__all__ = [
    "EvalSums",
    "LocalReducer",
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


@dataclasses.dataclass(frozen=True)
class LocalReducer:
    """A :class:`Reducer` over members all held in one place (no mesh, no collectives).

    What an exported artifact (every member on one device) and a task's own tests use:
    ``mean``/``sum``/``max``/``min`` over the leading member axis, ``pool`` and the data
    reductions the identity, ``pairs`` one call on the whole stack.

    Attributes:
      members: ``M``.

    Example:
      >>> LocalReducer(2).mean(jnp.array([[1.0], [3.0]]))
      Array([2.], dtype=float32)
    """

    members: int

    def mean(self, x: PyTree) -> PyTree:
        """The mean over the member axis 0."""
        return jax.tree.map(lambda v: jnp.mean(v, axis=0), x)

    def sum(self, x: PyTree) -> PyTree:
        """The sum over the member axis 0."""
        return jax.tree.map(lambda v: jnp.sum(v, axis=0), x)

    def max(self, x: PyTree) -> PyTree:
        """The maximum over the member axis 0."""
        return jax.tree.map(lambda v: jnp.max(v, axis=0), x)

    def min(self, x: PyTree) -> PyTree:
        """The minimum over the member axis 0."""
        return jax.tree.map(lambda v: jnp.min(v, axis=0), x)

    def pool(self, x: PyTree) -> PyTree:
        """``x``: every member is local, so the local mean is the mean."""
        return x

    def data_mean(self, x: PyTree) -> PyTree:
        """``x``: the whole batch is here."""
        return x

    def data_sum(self, x: PyTree) -> PyTree:
        """``x``: the whole batch is here."""
        return x

    def pairs(self, fn: Callable[[PyTree, PyTree], jax.Array], x: PyTree) -> jax.Array:
        """``fn(x, x)``: every pair of members is in the one stack."""
        return fn(x, x)


class EvalSums(NamedTuple):
    """What a task's per-device evaluation returns for one batch, by layout.

    Its four fields: ``totals``, sums over the batch, the same on every device
    (replicated), e.g. ``{"nll": [], "count": []}``, the batches' added on the host;
    ``members``, per-member sums, leaves ``[m, ...]`` (split over ``ensemble``), added too;
    ``examples``, per-example values, leaves ``[b, ...]`` (split over ``data``),
    concatenated over batches (the padding's rows dropped); ``member_examples``,
    per-member, per-example values ``[m, b, ...]``, concatenated on axis 1.

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
    ``ensemble_metrics``, ``eval_sums``, ``serve``, ``finish_device``) run inside the
    compiled step on local views: ``outputs`` ``[m, b, ...]`` (the model's float32
    outputs, ``m`` local members, ``b`` this device's examples; ``member_metrics`` gets one
    member's ``[b, ...]``) and reduce with the :class:`Reducer` they are given. A task is a
    frozen dataclass (hashable: programs are cached by it).

    Attributes:
      name: the registered name, recorded in ``config.json`` (``--task NAME``).
      target_ndim, target_dtype: the dimensions of one example's target (0 for a class id,
        1 for a row) and the dtype targets are placed on the devices with.
      input_word, target_word: what messages call a batch's inputs and targets.
      auto_source: the data ``--source auto`` loads for this task when no file is given
        (None: the default chain, MNIST).
      uncalibrated_flag: the ``predict`` flag that writes outputs without the calibration's
        scale (``"no_temperature"``, ``"no_variance_scale"``), or None.
      conformal_name, conformal_view: what the calibrated conformal outputs are called
        (e.g. ``"prediction sets"``) and the :meth:`view` that returns them (``"sets"``,
        ``"intervals"``; ``""``: none).
      member_metric_names: what :meth:`member_metrics` returns (per member, ``[m]``).
      ensemble_metric_names: what :meth:`ensemble_metrics` returns; the train step reports
        them as ``ensemble_<name>`` (scalars; NaN for per-member batches).
      cli_defaults: ``TrainConfig`` values this task uses where the user gave none.
      validation_metrics: the validation metrics a run logs that ``--early-stopping`` and
        ``--keep-best`` may watch: ``{name: (metrics.jsonl key, "min" | "max")}`` (``max``:
        higher is better), e.g. ``{"val_nll": ("val_nll", "min")}``; default none.
      run_calibration: the options of :meth:`calibrate` (e.g. ``{"alpha": 0.1}``) with which
        a finished run that holds a validation split fits its own calibration, saved as
        ``evaluate --calibrate`` saves it; None (the default): a run fits none at its end.

    Example:
      >>> isinstance(ens.task, me.tasks.Task), ens.task.name
      (True, 'classification')
    """

    name: ClassVar[str] = ""
    target_ndim: ClassVar[int] = 0
    target_dtype: ClassVar[Any] = np.int32
    input_word: ClassVar[str] = "inputs"
    target_word: ClassVar[str] = "targets"
    conformal_name: ClassVar[str] = "conformal outputs"
    conformal_view: ClassVar[str] = ""
    auto_source: ClassVar[str | None] = None
    uncalibrated_flag: ClassVar[str | None] = None
    member_metric_names: ClassVar[tuple[str, ...]] = ()
    ensemble_metric_names: ClassVar[tuple[str, ...]] = ()
    cli_defaults: ClassVar[Mapping[str, Any]] = {}
    validation_metrics: ClassVar[Mapping[str, tuple[str, str]]] = {}
    run_calibration: ClassVar[Mapping[str, Any] | None] = None

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

    def calibration_scale(self, calibration: Any) -> Any:
        """The numbers of ``calibration`` (or None) :meth:`finish_device` applies: a float32
        array or a pytree of them (e.g. the temperature), passed to the predictor's program
        as an argument (another calibration compiles nothing new); default None."""
        return None

    def finish_device(
        self, out: dict[str, Any], scale: Any, calibrated: bool, sets: bool
    ) -> dict[str, Any]:
        """Per device: :meth:`serve`'s per-example outputs with the calibration's scale applied.

        Runs inside the predictor's program, in fixed blocks of rows
        (:mod:`meshensemble.serving.blocks`), so an example gets the same bits alone or in
        any batch: put here any arithmetic a threshold or a set depends on (XLA code
        compiled for another batch's shape may round otherwise). Rows must not interact.

        Args:
          out: :meth:`serve`'s ``per_example`` leaves ``[b, ...]`` (traced).
          scale: :meth:`calibration_scale` of the run's calibration (traced).
          calibrated: apply ``scale`` to the outputs (only when the run is calibrated).
          sets: add what :meth:`finish`'s conformal outputs need (only when calibrated).

        Returns:
          ``{name: [b, ...]}``, what :meth:`finish` gets (default: ``out`` as it is).
        """
        return dict(out)

    def finish(
        self, out: dict[str, Any], calibration: Any, calibrated: bool, sets: bool
    ) -> dict[str, Any]:
        """A served batch on the host (numpy), with the run's calibration applied.

        Args:
          out: :meth:`finish_device`'s outputs and :meth:`serve`'s ``per_member`` merged,
            numpy, padding dropped.
          calibration: :meth:`read_calibration`'s object, or None (uncalibrated).
          calibrated: apply the calibration's scale (``predict --no-temperature`` /
            ``--no-variance-scale`` turn it off).
          sets: add the calibration's conformal outputs (prediction sets, intervals).

        Returns:
          The arrays ``predict`` writes (default: ``out`` as it is).
        """
        return dict(out)

    def csv_keys(self, out: Mapping[str, Any]) -> list[str]:
        """The arrays of ``out`` a ``predict --out FILE.csv`` writes (default: those without
        a member axis)."""
        return [k for k in out if not k.startswith("member_")]

    def view(self, out: dict[str, Any], which: str) -> Any:
        """What ``Predictor.predict`` / ``predict_members`` / ``uncertainty`` /
        ``prediction_sets`` / ``intervals`` return from :meth:`finish`'s arrays.

        Args:
          out: :meth:`finish`'s dict; which: ``"predict"``, ``"members"``,
            ``"uncertainty"``, ``"sets"`` or ``"intervals"``.

        Raises:
          ValueError: the task has no such output (one line).
        """
        keys = {"predict": "prediction", "members": "member_prediction"}
        if which not in keys:
            raise ValueError(f"a {self.name} run has no {which.replace('_', ' ')}")
        return out[keys[which]]

    def exported(self, per_example: dict, per_member: dict, calibration: Any) -> dict:
        """The exported artifact's outputs from :meth:`serve`'s (jit-able; default both)."""
        return {**per_example, **per_member}

    def export_metadata(self, calibration: Any, width: int) -> dict[str, Any]:
        """The task's entries of ``export.json`` (outputs, calibration; ``width``: the
        model's output width); default none."""
        return {}

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
            f"temperature and logits are for classification ensembles; task {self.name!r} has "
            "neither (scale a regression ensemble's variance with "
            "me.calibration.fit_variance_scale instead)"
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
          dataset: the run's data after the validation split (None: the options alone).
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

    # ------------------------------------------------------------ calibration
    def check_calibration(
        self, n: int, alpha: float, method: str, note: Callable[[str], None]
    ) -> None:
        """Refuses (one line) a calibration on ``n`` validation examples, before any work.

        Args:
          n: the validation split's examples; alpha: the conformal miscoverage;
          method: the conformal score's name; note: where a warning line goes.

        Raises:
          ValueError: a bad option or too few examples (default: the task has no
            calibrator).
        """
        raise ValueError(f"task {self.name!r} has no calibration; drop --calibrate")

    def calibrate(self, ens: Any, state: Any, validation: Any, test: Any, **options) -> tuple:
        """Fits the calibrator on ``validation = (x, y)``, scores ``test``.

        ``options``: ``alpha``, ``method``, ``batch_size``, ``num_bins``.

        Returns:
          ``(section, figures)``: ``evaluation.json``'s ``calibration`` (JSON) and
          ``{file name: draw(path)}``.
        """
        raise ValueError(f"task {self.name!r} has no calibration; drop --calibrate")

    def read_calibration(self, section: Mapping[str, Any]) -> Any:
        """The object :meth:`finish` applies, from a saved ``calibration`` section.

        Raises:
          ValueError: a corrupt section (the message says which part).
        """
        raise ValueError(f"task {self.name!r} has no calibration")

    def calibration_summary(self, calibration: Any, applied: bool, out: Mapping) -> str:
        """How ``predict``'s line describes the calibration it used (``applied``: its scale
        was applied; ``out``: the arrays written)."""
        return "calibrated" if applied else "calibration not applied"

    def calibration_line(self, section: Mapping[str, Any]) -> str:
        """One line summarising a ``calibration`` section."""
        return f"calibration: {', '.join(sorted(section))}"

    def calibration_flags(self, section: Mapping[str, Any]) -> list[str]:
        """The ``evaluate --calibrate`` flags that fit a saved ``calibration`` section again
        (its options, e.g. ``["--alpha", "0.1"]``), for messages; default none."""
        return []

    def uncalibrated_line(self, workdir: str, why: str) -> str:
        """The last line of a finished run that :attr:`run_calibration` could not calibrate.

        Args:
          workdir: the run's folder; why: the reason and its fix (one clause, from the
            engine: no validation split, no checkpoint, a split too small).

        Returns:
          One line (asked only of tasks with :attr:`run_calibration`).
        """
        return f"note: uncalibrated, {why}"

    # ------------------------------------------------------------ evaluation of a run
    default_ood: ClassVar[tuple[str, ...]] = ()

    def record_scores(self, scores: Mapping[str, Any], split: str) -> dict[str, Any]:
        """:meth:`finalize`'s scores as ``metrics.jsonl`` and ``evaluation.json`` name them."""
        return {f"{split}_{k}": v for k, v in scores.items()}

    def check_ood(self, names: Any, dataset_name: str, ood_file: Any) -> list[str]:
        """The OOD set names ``evaluate`` uses, checked before any work (one line).

        Args:
          names: the sets asked for (``()``: none); dataset_name: the run's dataset;
          ood_file: a file for one of them, or None.

        Raises:
          ValueError: the task has no such set (default: it has none).
        """
        if list(names) or ood_file is not None:
            raise ValueError(f"task {self.name!r} offers no OOD sets; drop --ood and --ood-file")
        return []

    def evaluate_more(self, ens: Any, state: Any, data: Any, ood: Any, **options) -> tuple:
        """What ``evaluate`` adds to the test scores (e.g. OOD detection, reliability).

        Args:
          ens, state: the restored run; data: its :class:`~meshensemble.data.Dataset`.
          ood: OOD set names (``()``: none).
          options: ``result`` (the test scores so far), ``batch_size``, ``num_bins``,
            ``ood_file``, ``data_dir``, ``say``.

        Returns:
          ``(scores, figures)``: entries added to the result, and ``{file name:
          draw(path)}``; default ``({}, {})``.

        """
        return {}, {}

    def report(self, result: Mapping[str, Any]) -> str:
        """The text ``evaluate`` prints of its result (default: the test scores)."""
        return ", ".join(f"{k} {v:.4f}" for k, v in result.items() if k.startswith("test_") and
                         _num(v))  # fmt: skip

    # ------------------------------------------------------------ reports of a run
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
          predict: ``x -> (ensemble's prediction, members' predictions)`` of the trained
            ensemble, on the host (every process calls it; only process 0 draws).
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
