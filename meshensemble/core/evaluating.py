"""The host loop of :meth:`meshensemble.Ensemble.evaluate`: padded, masked batches in, sums out.

The per-batch program (``Ensemble.eval_fn``, :func:`meshensemble.core.steps.eval_stats`)
reduces each batch on the mesh; this loop feeds it and adds the batches' sums on the host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from meshensemble.core import inputs
from meshensemble.core.mesh import BATCH, MEMBERS, REPLICATED
from meshensemble.numerics import sums as sums_lib
from meshensemble.runtime.distributed import fetch


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
    n = len(labels)
    partial_sums, examples = [], []
    for start in range(0, n, batch):
        x, y = images[start : start + batch], labels[start : start + batch]
        k = len(y)
        mask = np.arange(batch) < k
        if k < batch:
            x, y = inputs.pad_to(x, batch), np.concatenate([y, np.zeros(batch - k, y.dtype)])
        sums, per_example = dispatched(fn(state, x, y, mask))
        partial_sums.append(sums)
        examples.append(per_example)
    # The sums are added on the host (no small programs to compile); N floats each
    # (confidence, correctness, mask) come to the host too, for the adaptive ECE.
    partial_sums, examples = fetch((partial_sums, examples))
    total = functools.reduce(lambda a, b: jax.tree.map(np.add, a, b), partial_sums)
    joined = {k: np.concatenate([e[k] for e in examples]) for k in sums_lib.EXAMPLE_STAT_KEYS}
    return sums_lib.finalize_stats(total, num_bins, examples=joined)


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
