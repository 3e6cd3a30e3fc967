"""Regression: each member predicts a Gaussian per target; the ensemble is their mixture.

:class:`Regression` is one implementation of :class:`meshensemble.tasks.Task`
(Lakshminarayanan et al., 2017): the model outputs ``[B, 2T]`` (means, then unconstrained
scales), each member's loss is the Gaussian negative log-likelihood, and the ensemble is
the uniform mixture of the members' Gaussians. Everything that combines members is
written with the :class:`~meshensemble.core.tasks.Reducer`: the mixture's moments are
``reduce.mean`` -ed, its log density is a log-mean-exp (``reduce.max``, then
``reduce.sum`` of ``exp``), its quantiles are bisected on the ``reduce.mean`` -ed CDF and
the CRPS's pairwise term meets every pair of members (``reduce.pairs``), so no device
gathers all members.

Example:
  >>> net = me.models.MLP(features=(50,), num_classes=2)   # outputs [B, 2 * targets]
  >>> reg = me.Ensemble(net, optax.adam(1e-2), 2, mesh, task=me.tasks.Regression(targets=1))
  >>> x = np.linspace(-1, 1, 8, dtype=np.float32)[:, None]        # [N, features]
  >>> out = reg.predict(reg.init(key, x[:1]), x)
  >>> {k: v.shape for k, v in out.items()}   # mean, variance and its two parts: [N, 1]
  {'aleatoric': (8, 1), 'epistemic': (8, 1), 'mean': (8, 1), 'variance': (8, 1)}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshensemble.core.tasks import EvalSums, Reducer, Task, register
from meshensemble.numerics import gaussian

MOMENT_KEYS = ("mean", "variance", "aleatoric", "epistemic")
"""The mixture's per-example moments, each ``[N, T]`` in the data's units."""


@register
@dataclasses.dataclass(frozen=True)
class Regression(Task):
    """Regression with ``targets`` real outputs: each member predicts a Gaussian per target.

    The model outputs ``[B, 2 * targets]``: the means ``mu`` (first ``targets`` columns)
    and unconstrained scales ``s`` (last ``targets``), with variance
    ``softplus(s) + min_variance``. With ``target_shift`` / ``target_scale`` (one value per
    target, e.g. the training targets' mean and standard deviation) the model works in
    standardised units and every prediction, loss and score is in the targets' own units:
    mean ``shift + scale * mu``, variance ``scale^2 * (softplus(s) + min_variance)``
    (the loss then differs from the standardised one by the constant ``mean(log scale)``,
    so the gradients are the same). Each member's loss is the Gaussian negative
    log-likelihood averaged over the targets; the ensemble is the uniform mixture of the
    members' Gaussians.

    Attributes:
      targets: ``T``, the number of real targets (positive).
      min_variance: the variance floor in standardised units (default ``1e-6``), which
        keeps the NLL finite when a member grows overconfident.
      target_shift: ``T`` floats added to the means, or None (0).
      target_scale: ``T`` positive floats multiplying the standard deviations, or None (1).

    Raises:
      ValueError: ``targets`` is not a positive integer, ``min_variance`` is not a
        positive finite float, or shift/scale do not have ``T`` finite values (scale > 0).

    Example:
      >>> me.tasks.Regression(targets=2).output_width()   # means and scales
      4
    """

    targets: int = 1
    min_variance: float = 1e-6
    target_shift: tuple[float, ...] | None = None
    target_scale: tuple[float, ...] | None = None
    name: ClassVar[str] = "regression"
    target_ndim: ClassVar[int] = 1
    target_dtype: ClassVar[Any] = np.float32
    member_metric_names: ClassVar[tuple[str, ...]] = ("rmse",)
    ensemble_metric_names: ClassVar[tuple[str, ...]] = ("nll", "rmse")
    cli_defaults: ClassVar[dict[str, Any]] = {
        "model": "mlp", "optimizer": "adam", "learning_rate": 0.01, "epochs": 100,
    }  # fmt: skip
    """SGD 0.1 for 10 epochs (10 steps on the toy's 20 rows) did not fit the 1-D toy or
    diabetes; Adam 0.01 for 100 epochs does. Features are tabular: the zoo's MLP."""

    def __post_init__(self) -> None:
        t = self.targets
        if not isinstance(t, int | np.integer) or isinstance(t, bool) or t < 1:
            raise ValueError(f"targets={t!r} must be a positive integer, e.g. targets=1")
        v = self.min_variance
        if not isinstance(v, int | float) or not np.isfinite(v) or v <= 0:
            raise ValueError(f"min_variance={v!r} must be a positive finite float, e.g. 1e-6")
        for name in ("target_shift", "target_scale"):
            value = getattr(self, name)
            if value is None:
                continue
            arr = np.asarray(value, np.float64).reshape(-1)
            bad = arr.size != t or not np.all(np.isfinite(arr))
            if bad or (name == "target_scale" and np.any(arr <= 0)):
                raise ValueError(
                    f"{name}={value!r} must be {t} finite values"
                    f"{' > 0' if name == 'target_scale' else ''}, one per target"
                )
            object.__setattr__(self, name, tuple(float(a) for a in arr))

    def output_width(self) -> int:
        """``2T``: the means, then the scales."""
        return 2 * self.targets

    def moments(self, outputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Each member's Gaussian from the model's outputs, in the targets' units.

        Args:
          outputs: ``[..., 2T]`` float outputs.

        Returns:
          ``(mean [..., T], variance [..., T])``.

        Raises:
          ValueError: ``outputs`` is not ``2T`` wide (the model's output width is wrong).
        """
        if outputs.shape[-1] != 2 * self.targets:  # static: raised while tracing
            raise ValueError(
                f"the model outputs {outputs.shape[-1]} values per example, but "
                f"Regression(targets={self.targets}) needs 2 * targets = {2 * self.targets} "
                f"(the means, then the scales); give the model {2 * self.targets} outputs"
            )
        mean, variance = gaussian.moments(outputs.astype(jnp.float32), self.min_variance)
        row = lambda v: jnp.asarray(v, jnp.float32).reshape((1,) * (mean.ndim - 1) + (-1,))
        if self.target_scale is not None:
            scale = row(self.target_scale)
            mean, variance = mean * scale, variance * scale**2
        if self.target_shift is not None:
            mean = mean + row(self.target_shift)
        return mean, variance

    def loss(self, outputs: jax.Array, targets: jax.Array) -> jax.Array:
        """Gaussian NLL per example, averaged over targets: ``outputs [B, 2T]``, ``targets [B, T]``.

        Returns:
          ``[B]`` losses.
        """
        mean, variance = self.moments(outputs)
        return -jnp.mean(gaussian.log_density(mean, variance, targets.astype(mean.dtype)), -1)

    def member_metrics(self, outputs: jax.Array, targets: jax.Array, reduce: Reducer) -> dict:
        """``rmse`` of the member's mean on its batch (the squared error averaged over ``data``)."""
        mean, _ = self.moments(outputs)
        return {"rmse": jnp.sqrt(reduce.data_mean(jnp.mean((mean - targets) ** 2)))}

    def member_predictions(self, outputs: jax.Array) -> dict[str, jax.Array]:
        """Each member's Gaussian: ``{"mean", "variance"}`` ``[..., b, T]``."""
        mean, variance = self.moments(outputs)
        return {"mean": mean, "variance": variance}

    def combine(self, predictions: dict[str, jax.Array], reduce: Reducer) -> dict[str, jax.Array]:
        """The mixture's moments: ``mean = E_m[mu_m]``, ``aleatoric = E_m[var_m]``,
        ``epistemic = E_m[(mu_m - mean)^2]`` (the second mean after the first, not
        ``E[mu^2] - mean^2``, which cancels catastrophically in float32) and ``variance =
        aleatoric + epistemic``, each ``[b, T]``."""
        mean, variance = predictions["mean"], predictions["variance"]
        mu = reduce.mean(mean)
        aleatoric = reduce.mean(variance)
        epistemic = reduce.mean((mean - mu[None]) ** 2)
        return {"mean": mu, "variance": aleatoric + epistemic, "aleatoric": aleatoric,
                "epistemic": epistemic}  # fmt: skip

    def ensemble_metrics(self, predictions: dict, targets: jax.Array, reduce: Reducer) -> dict:
        """``nll`` of the mixture (:meth:`log_density`) and ``rmse`` of its mean."""
        mean, variance = predictions["mean"], predictions["variance"]
        y = targets.astype(jnp.float32)
        nll = -jnp.mean(self.log_density(mean, variance, y, reduce))
        mixture_mean = reduce.mean(mean)
        nll, sq = reduce.data_mean((nll, jnp.mean((mixture_mean - y) ** 2)))
        return {"nll": nll, "rmse": jnp.sqrt(sq)}

    @staticmethod
    def log_density(mean: jax.Array, variance: jax.Array, y: jax.Array, reduce: Reducer):
        """``log (1/M sum_m N(y; mu_m, var_m))`` by a stable log-mean-exp over all members.

        The largest member log density (``reduce.max``, held constant for the gradient) is
        taken out before ``exp``; the rest is ``reduce.sum``-ed. ``mean, variance``: the
        local members' ``[m, b, T]``; ``y``: ``[b, T]``. Returns ``[b, T]``.
        """
        log_p = gaussian.log_density(mean, variance, y[None])
        top = lax.stop_gradient(reduce.max(log_p))
        total = reduce.sum(jnp.exp(log_p - top[None]))
        return top + jnp.log(total) - jnp.log(float(reduce.members))

    @staticmethod
    def quantiles(mean: jax.Array, variance: jax.Array, levels: tuple[float, ...],
                  reduce: Reducer) -> jax.Array:  # fmt: skip
        """The mixture's quantiles by bisection on its CDF (``reduce.mean`` of the members').

        The bracket is every member's ``mu +/- 10 sigma`` (``reduce.min`` / ``reduce.max``);
        :data:`~meshensemble.numerics.gaussian.BISECTION_STEPS` halvings follow. Returns
        ``[b, T, len(levels)]``.
        """
        sd = jnp.sqrt(variance)
        lo = reduce.min(mean - gaussian.BRACKET_SDS * sd)
        hi = reduce.max(mean + gaussian.BRACKET_SDS * sd)
        p = jnp.asarray(levels, jnp.float32)
        lo, hi = (jnp.broadcast_to(v[..., None], (*v.shape, p.size)) for v in (lo, hi))

        def halve(_, bracket):
            lo, hi = bracket
            mid = 0.5 * (lo + hi)
            below = reduce.mean(gaussian.cdf(mean[..., None], variance[..., None], mid[None]))
            below = below < p[None, None]
            return jnp.where(below, mid, lo), jnp.where(below, hi, mid)

        lo, hi = lax.fori_loop(0, gaussian.BISECTION_STEPS, halve, (lo, hi))
        return 0.5 * (lo + hi)

    def eval_sums(self, outputs, targets, mask, reduce: Reducer, **_) -> EvalSums:
        """Sums of the mixture's proper scores over the batch (masked), over ``data`` too.

        Per example and target: the mixture's log density, its mean's squared and absolute
        errors, its CRPS ``E|X - y| - E|X - X'| / 2`` (closed form for Gaussian mixtures,
        the pair term from every pair of members), whether ``y`` lies in its central
        50/90/95% intervals and their widths (bisected quantiles), and whether its PIT
        ``F(y)`` is below each calibration level. Returns the totals of
        :data:`~meshensemble.numerics.gaussian.SUM_KEYS`.
        """
        m = self.member_predictions(outputs)
        mean, variance, y = m["mean"], m["variance"], targets.astype(jnp.float32)
        mix = self.combine(m, reduce)
        w = mask.astype(jnp.float32)[:, None]
        cdf_y = reduce.mean(gaussian.cdf(mean, variance, y[None]))
        to_y = reduce.mean(gaussian.abs_moment(y[None] - mean, variance))
        pair = reduce.pairs(gaussian.pair_abs_sum, (mean, variance)) / float(reduce.members) ** 2
        crps = to_y - 0.5 * pair
        q = self.quantiles(mean, variance, gaussian.QUANTILE_LEVELS, reduce)
        lo, hi = q[..., 0::2], q[..., 1::2]
        inside = ((lo <= y[..., None]) & (y[..., None] <= hi)).astype(jnp.float32)
        levels = jnp.asarray(gaussian.CALIBRATION_LEVELS)[None, None]
        below = (cdf_y[..., None] <= levels).astype(jnp.float32)
        total = lambda v: jnp.sum(v * w, axis=(0, 1))
        wide = lambda v: jnp.sum(v * w[..., None], axis=(0, 1))
        sums = {
            "count": jnp.sum(w) * y.shape[-1],
            "nll": -total(self.log_density(mean, variance, y, reduce)),
            "squared_error": total((mix["mean"] - y) ** 2),
            "absolute_error": total(jnp.abs(mix["mean"] - y)),
            "crps": total(crps),
            "variance": total(mix["variance"]),
            "aleatoric": total(mix["aleatoric"]),
            "epistemic": total(mix["epistemic"]),
            "covered": wide(inside),
            "width": wide(hi - lo),
            "pit_below": wide(below),
        }
        return EvalSums(reduce.data_sum(sums))

    def finalize(self, sums: EvalSums, **_) -> dict[str, Any]:
        """:func:`meshensemble.numerics.gaussian.finalize` of the whole set's sums."""
        return gaussian.finalize(sums.totals)

    def serve(self, outputs: jax.Array, reduce: Reducer, members: bool) -> tuple[dict, dict]:
        """The mixture's moments (:data:`MOMENT_KEYS`) and, asked, each member's
        ``member_mean`` and ``member_variance``."""
        own = self.member_predictions(outputs)
        per_member = {"member_mean": own["mean"], "member_variance": own["variance"]}
        return self.combine(own, reduce), (per_member if members else {})

    def tempered(self, predict, temperature, num_members, members, logits=False):
        """Refused: a regression ensemble has no temperature or logits (one line)."""
        raise ValueError(
            "temperature and logits are for classification ensembles; scale a regression "
            "ensemble's variance with me.calibration.fit_variance_scale instead"
        )

    def as_targets(self, targets: Any) -> Any:
        """Float ``[N, T]`` (``[N]`` becomes ``[N, 1]`` when ``T = 1``).

        Raises:
          ValueError: non-float targets, or a last axis other than ``T``.
        """
        if not jnp.issubdtype(np.result_type(targets), jnp.floating):
            raise ValueError(
                f"regression targets have dtype {np.result_type(targets)}; give float targets "
                "(e.g. y.astype('float32'))"
            )
        if np.ndim(targets) == 1 and self.targets == 1:
            targets = targets[:, None]
        if np.ndim(targets) not in (2, 3) or np.shape(targets)[-1] != self.targets:
            raise ValueError(
                f"targets of shape {np.shape(targets)} do not end in {self.targets} targets; "
                f"give [N, {self.targets}]" + (" or [N]" if self.targets == 1 else "")
            )
        return targets

    def check_targets(self, targets: Any, width: Callable[[], int]) -> None:
        """A NaN or inf among host targets (one would make every member's loss NaN) is refused."""
        if isinstance(targets, np.ndarray) and not np.isfinite(targets).all():
            at = tuple(int(i) for i in np.argwhere(~np.isfinite(targets))[0])
            raise ValueError(
                f"regression targets hold {targets[at]} at index {at}; clean the data first (a "
                "NaN or inf target makes the loss NaN)"
            )
