"""What :meth:`meshensemble.Ensemble.evaluate` adds to the per-batch program: checks and sums.

The per-batch program (``Ensemble.eval_fn``, :func:`meshensemble.core.steps.eval_stats`)
reduces each batch on the mesh; the host streaming engine
(:func:`meshensemble.core.streaming.stream`) feeds it padded, masked batches, and the
batches' sums are added here on the host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from meshensemble.core import inputs, steps, streaming
from meshensemble.core.mesh import BATCH, DATA, ENSEMBLE, MEMBERS, REPLICATED
from meshensemble.numerics import statmath
from meshensemble.numerics import sums as sums_lib


def evaluate_batches(
    fn: Callable[..., Any],
    state: Any,
    images: Any,
    labels: np.ndarray,
    batch: int,
    num_bins: int,
    dispatched: Callable[[Any], Any] = lambda out: out,
) -> dict[str, Any]:
    """Runs ``fn`` over ``images`` in batches of ``batch`` and finalises the metrics.

    Args:
      fn: ``fn(state, x, y, mask) -> (sums, per_example)`` on ``batch`` examples.
      state: the ensemble state.
      images: ``[N, ...]``.
      labels: ``[N]`` integer class indices.
      batch: examples per call (a multiple of the ``data`` axis); the last batch is
        padded and masked.
      num_bins: bins of the expected calibration error.
      dispatched: called on each batch's result (the ensemble's bound on programs in
        flight); returns it.

    Returns:
      :func:`meshensemble.numerics.sums.finalize_stats` of the summed batches.

    Example:
      >>> m = evaluate_batches(ens.eval_fn(), state, images, labels, 1000, 15)
      >>> m["accuracy"] > 0.5, m["nll"] > 0   # python floats; the bars are learnt
      (True, True)
    """
    total, examples = streaming.HostSum(), []

    def run(x: np.ndarray, y: np.ndarray, mask: np.ndarray) -> dict[str, Any]:
        sums, per_example = dispatched(fn(state, x, y, mask))
        return {"sums": sums, **per_example}

    def sink(start: int, out: dict[str, Any]) -> None:
        # Sums added on the host in batch order (no small programs to compile); per
        # example only the confidence, correctness and mask come back, for the adaptive ECE.
        total(start, out.pop("sums"))
        examples.append(out)

    streaming.stream(run, (images, labels), batch, batch, sink, axes={"sums": None})
    joined = {k: np.concatenate([e[k] for e in examples]) for k in sums_lib.EXAMPLE_STAT_KEYS}
    return sums_lib.finalize_stats(total.total, num_bins, examples=joined)


def check_eval_set(images: Any, labels: Any) -> tuple[Any, np.ndarray, int]:
    """Checks an evaluation set: one integer label per image, at least one image.

    Args:
      images: ``[N, ...]`` (numpy, a list or a ``jax.Array``).
      labels: ``[N]`` integer class indices.

    Returns:
      ``(images, labels, N)``: the images as an array, the labels as numpy.

    Raises:
      ValueError: no example, lengths differ, or labels that are not integers.

    Example:
      >>> images, labels, n = check_eval_set(test_images, test_labels)
    """
    images, labels = inputs.as_array(images, "images"), np.asarray(labels)
    n = int(np.shape(images)[0]) if np.ndim(images) else 0
    if labels.shape != (n,) or n == 0:
        raise ValueError(
            f"images of shape {np.shape(images)} and labels of shape {labels.shape}: "
            "give one integer label per image and at least one image"
        )
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"labels have dtype {labels.dtype}; give integer class indices")
    return images, labels, n


def eval_specs() -> tuple[dict[str, P], dict[str, P]]:
    """Output specs of :func:`meshensemble.core.steps.eval_stats`.

    Returns:
      ``(sums, per_example)``: per-member sums split over ``ensemble``, ensemble sums
      replicated; the per-example values ``[B]`` split over ``data``.

    Example:
      >>> sums, per_example = eval_specs()
    """
    names = sums_lib.MEMBER_STAT_KEYS + sums_lib.ENSEMBLE_STAT_KEYS
    totals = {k: (MEMBERS if k.startswith("member_") else REPLICATED) for k in names}
    return totals, {k: BATCH for k in sums_lib.EXAMPLE_STAT_KEYS}


def ood_fn(ens: Any, num_bins: int, sample: Any) -> Callable[..., Any]:
    """The program of :func:`meshensemble.core.steps.ood_stats` over ``ens``'s mesh, built once.

    Args:
      ens: a classification :class:`meshensemble.Ensemble`.
      num_bins: equal-width confidence bins of the reliability sums.
      sample: inputs like the batches (their shape fixes a sharded state's layout).

    Returns:
      ``fn(state, images [b, ...], labels [b], mask [b]) -> dict`` with ``b`` a multiple of
      the ``data`` axis: ``scores`` ``[kinds, b]``, ``member_scores`` ``[kinds, members,
      b]`` and the replicated bin sums ``ensemble`` and ``member``.

    Raises:
      ValueError: ``ens`` is a regression ensemble.

    Example:
      >>> out = ood_fn(ens, 15, images)(state, images, labels, np.ones(32, bool))
      >>> out["scores"].shape, out["member_scores"].shape, out["ensemble"]["count"].shape
      ((5, 32), (4, 2, 32), (15,))
    """
    if ens.regression:
        raise ValueError("OOD scores are for classification ensembles; this one regresses")
    bins = dict.fromkeys(statmath.OOD_BIN_KEYS, REPLICATED)
    out_specs = {
        "scores": P(None, DATA),
        "member_scores": P(None, ENSEMBLE, DATA),
        "ensemble": bins,
        "member": bins,
    }
    return ens.build(
        ("ood", num_bins),
        lambda cfg: functools.partial(steps.ood_stats, cfg, num_bins),
        (ens.state_specs(sample), BATCH, BATCH, BATCH),
        out_specs,
        sample=sample,
    )
