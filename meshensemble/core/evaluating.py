"""The host loop of :meth:`meshensemble.Ensemble.evaluate`: padded, masked batches in, sums out.

The per-batch program (``Ensemble.eval_fn``, :func:`meshensemble.core.steps.eval_stats`)
reduces each batch on the mesh; this loop feeds it and adds the batches' sums on the host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from meshensemble.core import inputs, stats
from meshensemble.core.distributed import fetch


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
      :func:`meshensemble.core.stats.finalize_stats` of the summed batches.

    Example:
      >>> evaluate_batches(ens.eval_fn(), state, images, labels, 1000, 15)["accuracy"]
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
    joined = {k: np.concatenate([e[k] for e in examples]) for k in stats.EXAMPLE_STAT_KEYS}
    return stats.finalize_stats(total, num_bins, examples=joined)
