"""Classification: integer labels, softmax members, the mean of their softmax.

:class:`Classification` is one implementation of :class:`meshensemble.tasks.Task`: the
model outputs logits ``[B, C]``, each member's loss is the softmax cross-entropy (with
optional label smoothing), the ensemble's prediction is the mean of the members' softmax
(``reduce.mean``: the mean over local members, then ``pmean`` over ``ensemble``). Its
evaluation streams the sums of :mod:`meshensemble.numerics.sums` (accuracy, NLL, Brier,
ECE and adaptive ECE, diversity), its OOD scores those of
:mod:`meshensemble.numerics.statmath`.

Example:
  >>> model, tx = me.models.MLP((8,)), optax.sgd(0.1)
  >>> ens = me.Ensemble(model, tx, 2, mesh, task=me.tasks.Classification())
  >>> ens.task.name, ens.task.member_metric_names
  ('classification', ('accuracy',))
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshensemble import calibration as calibration_lib
from meshensemble import metrics
from meshensemble.calibration import run as calibration_run
from meshensemble.core.derive import check_label_range
from meshensemble.core.tasks import EvalSums, Reducer, Task, register
from meshensemble.numerics import statmath
from meshensemble.numerics import sums as sums_lib
from meshensemble.numerics import temperature as temperature_lib
from meshensemble.tasks import ood as ood_lib

UNCERTAINTY_KEYS = ("label", "confidence", "entropy", "mutual_information")
"""The per-example fields of ``Predictor.uncertainty`` of a classification run, each ``[N]``."""
PLOTS = ("learning_curves.png", "members.png")
"""The figures a classification run draws at its end."""


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What ``meshensemble evaluate --calibrate`` fitted for one checkpoint of a run.

    Attributes:
      temperature: ``T`` of "pool, then calibrate": ``softmax(log(mean_m p_m) / T)``.
      threshold: the split-conformal threshold ``q`` of the calibrated probabilities.
      method: the conformal score (one of :data:`meshensemble.calibration.METHODS`).
      alpha: the miscoverage rate the threshold was fitted for.
      step: the checkpoint it belongs to.

    Example:
      >>> Calibration(1.2, 0.9, "thr", 0.1, 20).temperature
      1.2
    """

    temperature: float
    threshold: float
    method: str
    alpha: float
    step: int


@functools.partial(jax.jit, static_argnames=("with_calibrated",))
def _finish(out: dict[str, jax.Array], t: Any, t_cal: Any, with_calibrated: bool) -> dict:
    """Per-example fields from :meth:`Classification.serve`'s outputs."""
    pooled = out["probs"]
    probs = pooled if t is None else temperature_lib.tempered(pooled, t)
    res = {
        "probs": probs,
        "label": jnp.argmax(probs, axis=-1).astype(jnp.int32),
        "confidence": jnp.max(probs, axis=-1),
        "entropy": statmath.shannon_entropy(probs),
        "mutual_information": jnp.maximum(
            statmath.shannon_entropy(pooled) - out["expected_entropy"], 0.0
        ),
    }
    if "member_probs" in out:
        res["member_probs"] = out["member_probs"]
    if with_calibrated:
        res["calibrated"] = temperature_lib.tempered(pooled, t_cal)
    return res


@register
@dataclasses.dataclass(frozen=True)
class Classification(Task):
    """Classification with integer labels (the default task of :class:`meshensemble.Ensemble`).

    The model outputs logits ``[B, classes]``; each member's loss is the softmax
    cross-entropy (or the Ensemble's ``loss_fn``); the ensemble's prediction is the mean
    of the members' softmax (``pmean`` over ``ensemble``).

    Attributes:
      num_classes: the classes (the model's output width), or None: whatever it outputs.
      label_smoothing: in ``[0, 1)``: the cross-entropy's target is ``(1 - s) * one_hot +
        s / classes`` (``optax.smooth_labels``); 0: the plain cross-entropy.

    Example:
      >>> me.tasks.Classification(num_classes=10).output_width()
      10
    """

    num_classes: int | None = None
    label_smoothing: float = 0.0
    name: ClassVar[str] = "classification"
    input_word: ClassVar[str] = "images"
    target_word: ClassVar[str] = "labels"
    uncalibrated_flag: ClassVar[str | None] = "no_temperature"
    conformal_name: ClassVar[str] = "prediction sets"
    conformal_view: ClassVar[str] = "sets"
    member_metric_names: ClassVar[tuple[str, ...]] = ("accuracy",)
    ensemble_metric_names: ClassVar[tuple[str, ...]] = ("accuracy", "nll")

    def __post_init__(self) -> None:
        s = self.label_smoothing
        if isinstance(s, bool) or not isinstance(s, int | float) or not 0 <= s < 1:
            raise ValueError(f"label_smoothing={s!r} must be in [0, 1)")

    def output_width(self) -> int | None:
        """The number of classes (None: not fixed by the task)."""
        return self.num_classes

    def loss(self, outputs: jax.Array, targets: jax.Array) -> jax.Array:
        """Softmax cross-entropy of ``logits [B, C]`` with integer ``labels [B]``: ``[B]``."""
        onehot = jax.nn.one_hot(targets, outputs.shape[-1])
        if self.label_smoothing:
            onehot = optax.smooth_labels(onehot, self.label_smoothing)
        return optax.softmax_cross_entropy(outputs, onehot)

    def member_metrics(self, outputs: jax.Array, targets: jax.Array, reduce: Reducer) -> dict:
        """``accuracy``: the member's argmax against the labels, averaged over ``data``."""
        return {"accuracy": reduce.data_mean(jnp.mean(jnp.argmax(outputs, -1) == targets))}

    def member_predictions(self, outputs: jax.Array) -> jax.Array:
        """Each member's softmax, float32 ``[..., b, C]``."""
        return jax.nn.softmax(outputs.astype(jnp.float32))

    def combine(self, predictions: jax.Array, reduce: Reducer) -> jax.Array:
        """The mean of the members' softmax, ``[b, C]``."""
        return reduce.mean(predictions)

    def ensemble_metrics(self, predictions: jax.Array, targets: jax.Array, reduce: Reducer):
        """``accuracy`` and ``nll`` of the members' mean softmax on the batch."""
        probs = reduce.mean(predictions)
        accuracy = jnp.mean(jnp.argmax(probs, -1) == targets)
        p = jnp.take_along_axis(probs, targets[:, None], axis=-1)[:, 0]
        nll = jnp.mean(-jnp.log(jnp.maximum(p, jnp.finfo(probs.dtype).tiny)))
        accuracy, nll = reduce.data_mean((accuracy, nll))
        return {"accuracy": accuracy, "nll": nll}

    def eval_sums(self, outputs, targets, mask, reduce: Reducer, num_bins: int = 15, **_):
        """The sums of :func:`meshensemble.numerics.sums.streaming_stats`, reduced on the mesh.

        The members' softmax never leaves the devices: the mean softmax and mean clipped
        log-softmax are ``reduce.mean`` -ed, the per-class argmax counts ``reduce.sum`` -ed,
        then each device sums its members on its part of the batch; the sums are summed
        over ``data``. Per example only the ensemble's confidence, correctness and the
        mask leave (for the adaptive ECE).
        """
        probs = self.member_predictions(outputs)
        c = probs.shape[-1]
        ens = reduce.mean(probs)
        votes = reduce.sum(jax.nn.one_hot(jnp.argmax(probs, axis=-1), c, dtype=probs.dtype))
        log_probs = reduce.mean(statmath.clipped_log(probs))
        mask = mask.astype(jnp.float32)
        sums = sums_lib.streaming_stats(
            probs, ens, targets, mask, num_bins, ensemble_votes=votes, ensemble_log_probs=log_probs
        )
        sums = reduce.data_sum(sums)
        members = {k: v for k, v in sums.items() if k.startswith("member_")}
        totals = {k: v for k, v in sums.items() if k not in members}
        return EvalSums(totals, members, sums_lib.example_stats(ens, targets, mask))

    def finalize(self, sums: EvalSums, num_bins: int = 15, **_) -> dict[str, Any]:
        """:func:`meshensemble.numerics.sums.finalize_stats` of the whole set's sums."""
        stats = {**sums.totals, **sums.members}
        return sums_lib.finalize_stats(stats, num_bins, examples=sums.examples)

    def serve(self, outputs: jax.Array, reduce: Reducer, members: bool) -> tuple[dict, dict]:
        """``probs`` (the mean softmax) and ``expected_entropy`` (the members' mean entropy)
        ``[b, ...]``; with ``members`` each member's softmax ``member_probs``."""
        probs = self.member_predictions(outputs)
        local = {"probs": jnp.mean(probs, axis=0),
                 "expected_entropy": jnp.mean(sums_lib.shannon_entropy(probs), axis=0)}  # fmt: skip
        return reduce.pool(local), ({"member_probs": probs} if members else {})

    def ood_sums(self, outputs, targets, mask, reduce: Reducer, num_bins: int = 15, **_):
        """Per-example OOD scores and reliability-diagram bin sums of a batch.

        The ensemble's scores (:data:`~meshensemble.numerics.statmath.OOD_SCORE_KINDS`)
        follow from the members' means (``reduce.pool`` of
        :func:`~meshensemble.numerics.statmath.logit_summaries`), each member's own scores
        from its logits alone; the bin sums of the ensemble's prediction and of all members
        pooled (the "mean member" curve) are summed over the batch.

        Returns:
          :class:`~meshensemble.core.tasks.EvalSums`: ``totals`` ``{"ensemble", "member"}``
          bin sums ``[num_bins]``; ``examples["scores"]`` ``[b, kinds]``;
          ``member_examples["scores"]`` ``[m, b, member kinds]``.
        """
        pooled = reduce.pool(statmath.logit_summaries(outputs))
        alone = jax.vmap(lambda zm: statmath.logit_summaries(zm[None]))(outputs)  # [m, b, ...]
        w = mask.astype(jnp.float32)

        def bins(probs: jax.Array) -> dict[str, jax.Array]:  # [..., b, C] -> [..., num_bins]
            ex = statmath.per_example(probs, targets, num_bins)
            sums = statmath.bin_sums(ex["conf"], ex["correct"], ex["bin"], w, num_bins)
            return dict(zip(statmath.OOD_BIN_KEYS, sums))

        member_bins = reduce.sum(bins(jax.nn.softmax(outputs, axis=-1)))  # all members pooled
        totals = {"ensemble": bins(pooled["probs"]), "member": member_bins}
        scores = [statmath.ood_score_of(k, pooled) for k in statmath.OOD_SCORE_KINDS]
        own = [statmath.ood_score_of(k, alone) for k in statmath.MEMBER_OOD_KINDS]
        return EvalSums(
            reduce.data_sum(totals), {}, {"scores": jnp.stack(scores, -1)},
            {"scores": jnp.stack(own, -1)},
        )  # fmt: skip

    def tempered(
        self,
        predict: Callable[[bool, bool], jax.Array],
        temperature: Any,
        num_members: int,
        members: bool,
        logits: bool = False,
    ) -> jax.Array:
        """``Ensemble.predict``/``predict_members`` with a temperature, or the logits.

        A scalar ``T`` calibrates the pooled prediction ("pool, then calibrate"):
        ``softmax(log max(mean_m p_m, eps) / T)``; ``[members]`` temperatures scale each
        member first ("calibrate, then pool"). ``logits=True`` (``predict_members``):
        the members' logits, divided by ``T`` when given.
        """
        t = temperature_lib.check_temperature(temperature, num_members)
        if members:
            out = predict(True, logits)
            if t is None:
                return out
            return temperature_lib.divided(out, t) if logits else temperature_lib.tempered(out, t)
        if t.ndim == 0:
            return temperature_lib.tempered(predict(False, False), t)
        return temperature_lib.mean_members(temperature_lib.tempered(predict(True, False), t))

    def as_targets(self, targets: Any) -> Any:
        """Integer labels; ValueError (one line) for another dtype."""
        if not jnp.issubdtype(np.result_type(targets), jnp.integer):
            raise ValueError(
                f"labels have dtype {np.result_type(targets)}; give integer class indices"
            )
        return targets

    def check_targets(self, targets: Any, width: Callable[[], int]) -> None:
        """Labels in ``[0, classes)``; ValueError naming their range otherwise."""
        check_label_range(targets, width())

    # ------------------------------------------------------------ serving
    def finish(self, out: dict, calibration: Any, calibrated: bool, sets: bool) -> dict:
        """``probs`` (tempered when ``calibrated``), ``label``, ``confidence``, ``entropy``,
        ``mutual_information`` ``[N]`` and, with ``sets``, the conformal
        ``prediction_set`` (always from the calibrated probabilities)."""
        cal = calibration if sets else None
        t = None if calibration is None or not calibrated else np.float32(calibration.temperature)
        t_cal = None if cal is None else np.float32(cal.temperature)
        done = _finish(out, t, t_cal, cal is not None)  # jit returns its dict sorted
        order = ("probs", *UNCERTAINTY_KEYS, "calibrated")
        res = {k: np.asarray(done[k]) for k in order if k in done}
        if cal is not None:
            chosen = calibration_lib.prediction_sets(
                res.pop("calibrated"), cal.threshold, cal.method
            )
            res["prediction_set"] = np.asarray(chosen)
        if "member_probs" in done:
            res["member_probs"] = np.asarray(done["member_probs"])
        return res

    def csv_keys(self, out: Mapping[str, Any]) -> list[str]:
        """``label``, ``confidence``, ``entropy``, ``mutual_information``, ``prediction_set``."""
        return [k for k in (*UNCERTAINTY_KEYS, "prediction_set") if k in out]

    def view(self, out: dict, which: str) -> Any:
        """``probs``, ``member_probs``, the :data:`UNCERTAINTY_KEYS` or ``prediction_set``."""
        if which == "uncertainty":
            return {k: out[k] for k in UNCERTAINTY_KEYS}
        keys = {"predict": "probs", "members": "member_probs", "sets": "prediction_set"}
        if which not in keys:
            raise ValueError("a classification run has no intervals; use prediction_sets(x)")
        return out[keys[which]]

    def exported(self, per_example: dict, per_member: dict, calibration: Any) -> dict:
        """``probs`` (tempered when calibrated) and ``member_probs``."""
        probs = per_example["probs"]
        if calibration is not None:
            probs = temperature_lib.tempered(probs, jnp.float32(calibration.temperature))
        return {"probs": probs, "member_probs": per_member["member_probs"]}

    def export_metadata(self, calibration: Any, width: int) -> dict[str, Any]:
        """``outputs``, ``classes``, ``temperature`` and ``conformal`` (None uncalibrated)."""
        scores = inspect.signature(calibration_lib.conformal_scores).parameters
        conformal = None
        if calibration is not None:
            conformal = {"method": calibration.method, "alpha": calibration.alpha,
                         "threshold": calibration.threshold, "k_reg": scores["k_reg"].default,
                         "lam": scores["lam"].default, "randomized": False}  # fmt: skip
        return {
            "outputs": {
                "probs": ["batch", "classes"],
                "member_probs": ["members", "batch", "classes"],
            },  # fmt: skip
            "classes": width,
            "temperature": None if calibration is None else calibration.temperature,
            "conformal": conformal,
        }

    # ------------------------------------------------------------ calibration
    def check_calibration(self, n: int, alpha: float, method: str, note: Callable) -> None:
        """Refuses a bad method or an alpha too small for ``n``; warns on small splits."""
        calibration_run.check_calibration(n, alpha, method, note)

    def calibrate(self, ens: Any, state: Any, validation: Any, test: Any, **options) -> tuple:
        """A temperature and a conformal threshold (:func:`~meshensemble.calibration.run.
        calibrate_ensemble`), and ``calibration.png``."""
        keys = ("alpha", "method", "batch_size", "num_bins")
        section, curves = calibration_run.calibrate_ensemble(
            ens, state, validation, test, **{k: options[k] for k in keys if k in options}
        )
        draw = lambda path: calibration_run.draw_calibration(path, section, curves)
        return section, {calibration_run.CALIBRATION_PLOT: draw}

    def read_calibration(self, section: Mapping[str, Any]) -> Calibration:
        """The :class:`Calibration` of a saved section (its ``step`` from ``fitted_for``)."""
        conformal = section["conformal"]
        cal = Calibration(
            float(section["temperature"]), float(conformal["threshold"]),
            str(conformal["method"]), float(conformal["alpha"]),
            int((section.get("fitted_for") or {}).get("step", -1)),
        )  # fmt: skip
        if cal.method not in calibration_lib.METHODS or not cal.temperature > 0:
            raise ValueError(f"{cal}")
        return cal

    def calibration_summary(self, calibration: Any, applied: bool, out: Mapping) -> str:
        """``temperature T applied`` (or not), and the sets' method and alpha."""
        how = f"temperature {calibration.temperature:.4g} {'applied' if applied else 'not applied'}"
        if "prediction_set" in out:
            how += f", {calibration.method} sets at alpha={calibration.alpha:g}"
        return how

    def calibration_line(self, section: Mapping[str, Any]) -> str:
        """:func:`meshensemble.calibration.run.calibration_line`."""
        return calibration_run.calibration_line(section)

    # ------------------------------------------------------------ runs and their reports
    default_ood: ClassVar[tuple[str, ...]] = ood_lib.DEFAULT_OOD

    def check_dataset(self, dataset: Any) -> None:
        """Integer class labels; float targets are refused in one line."""
        if not np.issubdtype(np.asarray(dataset.train_labels[:1]).dtype, np.integer):
            raise ValueError(
                f"{dataset.name} has float targets {np.shape(dataset.train_labels)}, not class "
                "labels; add --task regression (or give integer labels)"
            )

    def for_data(self, dataset: Any, options: Mapping[str, Any]) -> Classification:
        """The dataset's number of classes and the run's ``label_smoothing``."""
        classes = getattr(dataset, "num_classes", self.num_classes)
        return dataclasses.replace(
            self, num_classes=classes, label_smoothing=float(options.get("label_smoothing", 0))
        )

    def record(self) -> dict[str, Any]:
        """``name``, ``num_classes`` and ``label_smoothing``."""
        return {"name": self.name, "num_classes": self.num_classes,
                "label_smoothing": self.label_smoothing}  # fmt: skip

    @classmethod
    def from_record(cls, record: Mapping[str, Any], resolved: Mapping[str, Any]) -> Classification:
        """The recorded classes (older runs: the model's own, MNIST's 10)."""
        return cls(record.get("num_classes"), float(record.get("label_smoothing", 0.0)))

    def record_scores(self, scores: Mapping[str, Any], split: str) -> dict[str, Any]:
        """:func:`meshensemble.metrics.prefix_metrics`: ``{split}_ensemble_*``,
        ``{split}_member_*``, ``{split}_mean_member_*``."""
        return metrics.prefix_metrics(scores, split)

    def check_ood(self, names: Any, dataset_name: str, ood_file: Any) -> list[str]:
        """:func:`meshensemble.tasks.ood.check_ood`: noise, inverted, fashion_mnist."""
        return ood_lib.check_ood(names, dataset_name, ood_file)

    def evaluate_more(self, ens: Any, state: Any, data: Any, ood: Any, **options) -> tuple:
        """OOD detection on ``ood`` and the reliability diagram (:mod:`meshensemble.tasks.ood`)."""
        return ood_lib.evaluate_ood(ens, state, data, ood, **options)

    def report(self, result: Mapping[str, Any]) -> str:
        """The members' and ensemble's table, then uncertainty and OOD detection."""
        return self.final_table(result) + "\n" + ood_lib.summary_table(result)

    def epoch_line(self, record: Mapping[str, Any], epochs: int, seconds: float) -> str:
        """``epoch E/N step S: train loss ... | test ensemble acc ... | mean member ... | Ts``."""
        r, loss = record, record.get("train_mean_member_loss", float("nan"))
        return (
            f"epoch {r['epoch']}/{epochs} step {r['step']}: train loss {loss:.4f} | test "
            f"ensemble acc {100 * r['test_ensemble_accuracy']:.2f}% nll "
            f"{r['test_ensemble_nll']:.4f} ece {r['test_ensemble_ece']:.4f} | mean member acc "
            f"{100 * r['test_mean_member_accuracy']:.2f}% nll {r['test_mean_member_nll']:.4f} "
            f"| {seconds:.1f}s"
        )

    def final_table(self, record: Mapping[str, Any]) -> str:
        """Each member's and the ensemble's test accuracy, NLL, Brier and ECE."""
        return final_table(record)

    def run_figures(self, history: list[dict[str, Any]], predict: Any, train: Any) -> dict:
        """``learning_curves.png`` and ``members.png`` from the records."""
        from meshensemble import plots

        if not history:
            return {}
        return {PLOTS[0]: lambda path: plots.learning_curves(history, path),
                PLOTS[1]: lambda path: plots.member_vs_ensemble(history[-1], path)}  # fmt: skip


def final_table(r: Mapping[str, Any]) -> str:
    """A text table of each member's and the ensemble's test metrics from a record.

    Args:
      r: a ``metrics.jsonl`` record.

    Returns:
      The table as one string.

    Example:
      >>> r = {f"test_member_{k}": [0.9, 0.8] for k in ("accuracy", "nll", "brier", "ece")}
      >>> r |= {f"test_{w}_{k}": 0.5 for w in ("mean_member", "ensemble")
      ...       for k in ("accuracy", "nll", "brier", "ece")}
      >>> print(final_table(r))    # e.g. final_table(result.history[-1])
                  accuracy      nll    brier      ece
      -----------------------------------------------
        member 0    90.00%   0.9000   0.9000   0.9000
        member 1    80.00%   0.8000   0.8000   0.8000
      -----------------------------------------------
            mean    50.00%   0.5000   0.5000   0.5000
        ensemble    50.00%   0.5000   0.5000   0.5000
    """
    head = f"{'':>10} {'accuracy':>9} {'nll':>8} {'brier':>8} {'ece':>8}"
    rows = [head, "-" * len(head)]
    members = zip(*(r[f"test_member_{k}"] for k in ("accuracy", "nll", "brier", "ece")))
    for i, (a, n, b, e) in enumerate(members):
        rows.append(f"{'member ' + str(i):>10} {100 * a:8.2f}% {n:8.4f} {b:8.4f} {e:8.4f}")
    rows.append("-" * len(head))
    for name, key in (("mean", "mean_member"), ("ensemble", "ensemble")):
        rows.append(
            f"{name:>10} {100 * r[f'test_{key}_accuracy']:8.2f}% {r[f'test_{key}_nll']:8.4f} "
            f"{r[f'test_{key}_brier']:8.4f} {r[f'test_{key}_ece']:8.4f}"
        )
    return "\n".join(rows)
