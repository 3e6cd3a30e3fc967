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
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshensemble.core.derive import check_label_range
from meshensemble.core.tasks import EvalSums, Reducer, Task, register
from meshensemble.numerics import statmath
from meshensemble.numerics import sums as sums_lib
from meshensemble.numerics import temperature as temperature_lib


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
