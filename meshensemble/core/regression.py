"""A regression ensemble's predictions and scores from the host (the task's side of ``Ensemble``).

:meth:`meshensemble.Ensemble.predict`, ``predict_members`` and ``evaluate`` call these
for a :class:`~meshensemble.core.tasks.Regression` task. They pad the inputs to the
``data`` axis, run the per-device functions of :mod:`meshensemble.core.steps` (built once
with :meth:`~meshensemble.Ensemble.build`) and, for ``evaluate``, stream padded, masked
batches whose sums are finalised by :func:`meshensemble.numerics.gaussian.finalize`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from meshensemble.core import inputs, steps, streaming
from meshensemble.core.mesh import BATCH, MEMBER_BATCH, REPLICATED
from meshensemble.numerics import gaussian


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
    return streaming.unpad_on_mesh(fn(state, streaming.pad(x, ens.data_size)), n, ens.mesh, members)


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
    total = streaming.HostSum()  # the batches' sums, added on the host in batch order
    run = lambda xb, yb, mask: fn(state, xb, yb, mask)
    streaming.stream(run, (x, y), b, b, total, axes=dict.fromkeys(gaussian.SUM_KEYS))
    return gaussian.finalize(total.total)
