"""What :meth:`meshensemble.Ensemble.evaluate` adds to the per-batch program: checks and sums.

The per-batch program (``Ensemble.eval_fn``, :func:`meshensemble.core.steps.eval_stats`)
reduces each batch on the mesh with the task's sums; the host streaming engine
(:func:`meshensemble.core.streaming.stream`) feeds it padded, masked batches, and the
batches' sums are added here on the host and handed to the task's ``finalize``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from meshensemble.core import inputs, steps, streaming
from meshensemble.core.mesh import BATCH, MEMBER_BATCH, MEMBERS, REPLICATED
from meshensemble.core.tasks import EvalSums

EVAL_SPECS = EvalSums(REPLICATED, MEMBERS, BATCH, MEMBER_BATCH)
"""Output specs of :func:`meshensemble.core.steps.eval_stats` (and ``ood_stats``): a
:class:`~meshensemble.core.tasks.EvalSums`'s totals replicated, member sums split over
``ensemble``, per-example values over ``data``, per-member ones over both."""


def evaluate_batches(
    fn: Callable[..., Any],
    state: Any,
    images: Any,
    labels: Any,
    batch: int,
    finish: Callable[[EvalSums], dict[str, Any]],
    dispatched: Callable[[Any], Any] = lambda out: out,
) -> dict[str, Any]:
    """Runs ``fn`` over ``images`` in batches of ``batch`` and finalises the scores.

    Args:
      fn: ``fn(state, x, y, mask) -> EvalSums`` on ``batch`` examples.
      state: the ensemble state.
      images: ``[N, ...]``.
      labels: ``[N, ...]`` targets.
      batch: examples per call (a multiple of the ``data`` axis); the last batch is
        padded and masked.
      finish: the task's :meth:`~meshensemble.core.tasks.Task.finalize` (its options bound).
      dispatched: called on each batch's result (the ensemble's bound on programs in
        flight); returns it.

    Returns:
      ``finish`` of the summed batches (per-example values concatenated).

    Example:
      >>> finish = functools.partial(ens.task.finalize, num_bins=15)
      >>> m = evaluate_batches(ens.eval_fn(), state, images, labels, 1000, finish)
      >>> m["accuracy"] > 0.5, m["nll"] > 0   # python floats; the bars are learnt
      (True, True)
    """
    totals, members = streaming.HostSum(), streaming.HostSum()
    examples: list[Any] = []
    member_examples: list[Any] = []

    def run(x: np.ndarray, y: np.ndarray, mask: np.ndarray) -> dict[str, Any]:
        out = dispatched(fn(state, x, y, mask))
        return {"sums": (out.totals, out.members), "examples": out.examples,
                "member_examples": out.member_examples}  # fmt: skip

    def sink(start: int, out: dict[str, Any]) -> None:
        # Sums added on the host in batch order (no small programs to compile); per
        # example only what the task asked for comes back.
        totals(start, out["sums"][0])
        members(start, out["sums"][1])
        examples.append(out["examples"])
        member_examples.append(out["member_examples"])

    axes = {"sums": None, "examples": 0, "member_examples": 1}
    streaming.stream(run, (images, labels), batch, batch, sink, axes=axes)
    join = lambda parts, axis: jax.tree.map(lambda *v: np.concatenate(v, axis), *parts)
    return finish(
        EvalSums(totals.total, members.total, join(examples, 0), join(member_examples, 1))
    )


def check_eval_set(images: Any, labels: Any, task: Any) -> tuple[Any, Any, int]:
    """Checks an evaluation set: one target per input, at least one input.

    Args:
      images: inputs ``[N, ...]`` (numpy, a list or a ``jax.Array``).
      labels: targets ``[N, ...]`` (the task's :meth:`~meshensemble.core.tasks.Task.as_targets`).
      task: the ensemble's task.

    Returns:
      ``(images, targets, N)``: the inputs as an array, the targets as numpy.

    Raises:
      ValueError: no example, lengths differ, or targets of another dtype or shape.

    Example:
      >>> images, labels, n = check_eval_set(test_images, test_labels, ens.task)
    """
    images = inputs.as_array(images, "images")
    n = int(np.shape(images)[0]) if np.ndim(images) else 0
    labels = np.asarray(task.as_targets(np.asarray(labels)))
    if labels.shape[:1] != (n,) or labels.ndim != task.target_ndim + 1 or n == 0:
        xw, yw = task.input_word, task.target_word
        raise ValueError(
            f"{xw} of shape {np.shape(images)} and {yw} of shape {labels.shape}: give one "
            f"{yw.rstrip('s')} per {xw.rstrip('s')} and at least one {xw.rstrip('s')}"
        )
    return images, labels, n


def ood_fn(ens: Any, num_bins: int, sample: Any) -> Callable[..., Any]:
    """The program of :func:`meshensemble.core.steps.ood_stats` over ``ens``'s mesh, built once.

    Args:
      ens: an :class:`meshensemble.Ensemble` whose task offers OOD scores (``ood_sums``).
      num_bins: equal-width confidence bins of the reliability sums.
      sample: inputs like the batches (their shape fixes a sharded state's layout).

    Returns:
      ``fn(state, images [b, ...], labels [b], mask [b]) -> EvalSums`` with ``b`` a
      multiple of the ``data`` axis (the task's OOD scores and bin sums).

    Example:
      >>> out = ood_fn(ens, 15, images)(state, images, labels, np.ones(32, bool))
      >>> out.examples["scores"].shape, out.member_examples["scores"].shape
      ((32, 5), (2, 32, 4))
    """
    return ens.build(
        ("ood", num_bins),
        lambda cfg: functools.partial(steps.ood_stats, cfg, (("num_bins", num_bins),)),
        (ens.state_specs(sample), BATCH, BATCH, BATCH),
        EVAL_SPECS,
        sample=sample,
    )
