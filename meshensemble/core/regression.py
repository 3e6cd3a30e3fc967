"""A regression ensemble's predictions and scores from the host (the task's side of ``Ensemble``).

:meth:`meshensemble.Ensemble.predict`, ``predict_members`` and ``evaluate`` call these
for a :class:`~meshensemble.core.tasks.Regression` task. They pad the inputs to the
``data`` axis, run the per-device functions of :mod:`meshensemble.core.steps` (built once
with :meth:`~meshensemble.Ensemble.build`) and, for ``evaluate``, stream padded, masked
batches whose sums are finalised by :func:`meshensemble.numerics.gaussian.finalize`.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from meshensemble.core import inputs, steps
from meshensemble.core.backends import put
from meshensemble.core.mesh import BATCH, ENSEMBLE, MEMBER_BATCH, REPLICATED
from meshensemble.numerics import gaussian
from meshensemble.runtime.distributed import fetch

MAX_IN_FLIGHT = 2
"""Evaluation batches dispatched ahead of the host before it waits for the oldest."""


def _inputs(ens: Any, state: Any, x: Any) -> tuple[Any, int]:
    inputs.check_state(state, ens.num_members)
    x = inputs.as_array(x, "x")
    n = int(np.shape(x)[0]) if np.ndim(x) else 0
    if n == 0:
        raise ValueError(f"x of shape {np.shape(x)} holds no example; give at least one row")
    return x, n


def predict(
    ens: Any, state: Any, x: Any, members: bool, temperature: Any = None, logits: bool = False
) -> dict[str, jax.Array]:
    """The mixture's moments (or each member's Gaussian) for ``x``, computed on the mesh.

    Args:
      ens: a :class:`meshensemble.Ensemble` with a regression task.
      state: its state.
      x: ``[N, ...]`` inputs, any ``N``.
      members: each member's ``{"mean", "variance"}`` ``[members, N, T]`` (True) or the
        mixture's ``{"mean", "variance", "aleatoric", "epistemic"}`` ``[N, T]`` (False).
      temperature, logits: classification's options; must be None / False.

    Returns:
      The dict of arrays (members split over ``ensemble``).

    Raises:
      ValueError: a temperature or ``logits=True`` (classification only), or no rows.
    """
    if temperature is not None or logits:
        raise ValueError(
            "temperature and logits are for classification ensembles; scale a regression "
            "ensemble's variance with me.calibration.fit_variance_scale instead"
        )
    x, n = _inputs(ens, state, x)
    per_device = steps.member_moments if members else steps.mixture_moments
    spec = MEMBER_BATCH if members else BATCH
    fn = ens.build(
        ("regression-predict", members),
        lambda cfg: functools.partial(per_device, cfg),
        (ens.state_specs(x), BATCH),
        spec,
        sample=x,
    )
    out = fn(state, inputs.pad(x, ens.data_size))
    if out["mean"].shape[-2] == n:  # the examples' axis of [members, N, T] and [N, T]
        return out
    whole = P(ENSEMBLE) if members else P()  # padding dropped: no longer divisible over data
    trim = lambda v: put(v, ens.mesh, whole)[:, :n] if members else put(v, ens.mesh, whole)[:n]
    return {k: trim(v) for k, v in out.items()}


def evaluate(ens: Any, state: Any, x: Any, y: Any, batch_size: int) -> dict[str, float]:
    """The mixture's proper scores over a whole set, streamed in padded, masked batches.

    Args:
      ens: a :class:`meshensemble.Ensemble` with a regression task.
      state: its state.
      x: ``[N, ...]`` inputs.
      y: ``[N, T]`` (or ``[N]`` when ``T = 1``) float targets.
      batch_size: examples per compiled call (rounded up to a multiple of ``data``).

    Returns:
      The dict of :func:`meshensemble.numerics.gaussian.finalize`.

    Raises:
      ValueError: no examples, ``x`` and ``y`` differ in length, or targets of the wrong
        shape or dtype.
    """
    x, n = _inputs(ens, state, x)
    inputs.check_positive_int("batch_size", batch_size)
    y = np.asarray(ens.task.as_targets(inputs.as_array(y, "y"), n), np.float32)
    if y.ndim != 2 or y.shape[0] != n:
        raise ValueError(
            f"x has {n} rows but y has shape {y.shape}; give one [T] target row per input"
        )
    fn = ens.build(
        "regression-evaluate",
        lambda cfg: functools.partial(steps.regression_eval_stats, cfg),
        (ens.state_specs(x), BATCH, BATCH, BATCH),
        {k: REPLICATED for k in gaussian.SUM_KEYS},
        sample=x,
    )
    b = ens.eval_batch_size(batch_size, n)
    partial_sums, in_flight = [], collections.deque()
    for start in range(0, n, b):
        xb, yb = x[start : start + b], y[start : start + b]
        mask = np.arange(b) < len(yb)
        sums = fn(state, inputs.pad_to(xb, b), inputs.pad_to(yb, b), mask)
        partial_sums.append(sums)
        in_flight.append(sums["count"])
        while len(in_flight) > MAX_IN_FLIGHT:
            in_flight.popleft().block_until_ready()
    fetched = fetch(partial_sums)
    total = functools.reduce(lambda a, c: jax.tree.map(np.add, a, c), fetched)
    return gaussian.finalize(total)
