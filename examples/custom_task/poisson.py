"""A task written outside the package: Poisson regression of counts (``me.tasks.Task``).

Each member outputs a log-rate ``z``; its loss is the Poisson NLL ``exp(z) - y z +
log y!``; the ensemble predicts the mean of the members' rates and scores the mixture of
their Poissons. Everything else (chunks, checkpoints, resume, evaluate, predict, export,
any mesh) is the engine's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import gammaln

import meshensemble as me


@dataclasses.dataclass(frozen=True)
class Poisson(me.tasks.Task):
    """Counts ``y >= 0`` (float targets ``[N, 1]``); members output a log-rate ``[N, 1]``."""

    name: ClassVar[str] = "poisson"
    target_ndim: ClassVar[int] = 1  # one example's target: a row of 1 count
    target_dtype: ClassVar[Any] = np.float32
    ensemble_metric_names: ClassVar[tuple[str, ...]] = ("nll",)

    def output_width(self) -> int:
        return 1

    def loss(self, outputs, targets):
        z, y = outputs.astype(jnp.float32), targets.astype(jnp.float32)
        return jnp.mean(jnp.exp(z) - y * z + gammaln(y + 1.0), axis=-1)

    def member_predictions(self, outputs):
        return jnp.exp(outputs.astype(jnp.float32))  # each member's rate

    def combine(self, predictions, reduce):
        return reduce.mean(predictions)  # the ensemble's predicted mean count

    def log_density(self, rates, y, reduce):
        """``log (1/M sum_m Poisson(y; rate_m))``: a log-mean-exp over every member."""
        log_p = y[None] * jnp.log(rates) - rates - gammaln(y[None] + 1.0)
        top = jax.lax.stop_gradient(reduce.max(log_p))
        return top + jnp.log(reduce.sum(jnp.exp(log_p - top[None]))) - jnp.log(reduce.members)

    def ensemble_metrics(self, predictions, targets, reduce):
        nll = -jnp.mean(self.log_density(predictions, targets.astype(jnp.float32), reduce))
        return {"nll": reduce.data_mean(nll)}

    def eval_sums(self, outputs, targets, mask, reduce, **_):
        rates, y = self.member_predictions(outputs), targets.astype(jnp.float32)
        w = mask.astype(jnp.float32)[:, None]
        mean = reduce.mean(rates)
        sums = {
            "count": jnp.sum(w),
            "nll": -jnp.sum(w * self.log_density(rates, y, reduce)),
            "squared_error": jnp.sum(w * (mean - y) ** 2),
        }
        return me.tasks.EvalSums(reduce.data_sum(sums))

    def finalize(self, sums, **_):
        s = {k: float(v) for k, v in sums.totals.items()}
        return {"nll": s["nll"] / s["count"], "rmse": (s["squared_error"] / s["count"]) ** 0.5}

    def as_targets(self, targets):
        if not np.issubdtype(np.result_type(targets), np.floating):
            raise ValueError(f"counts have dtype {np.result_type(targets)}; give floats")
        return targets[:, None] if np.ndim(targets) == 1 else targets

    def check_targets(self, targets, width):
        if isinstance(targets, np.ndarray) and not (np.isfinite(targets) & (targets >= 0)).all():
            raise ValueError("counts must be finite and >= 0; clean the data first")

    def check_dataset(self, dataset):
        self.check_targets(np.asarray(dataset.y_train), None)
