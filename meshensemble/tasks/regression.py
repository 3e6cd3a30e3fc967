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
import math
import statistics
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshensemble import calibration as calibration_lib
from meshensemble.calibration.run import check_alpha_for
from meshensemble.core.tasks import EvalSums, Reducer, Task, register
from meshensemble.numerics import gaussian
from meshensemble.runtime.distributed import fetch

MOMENT_KEYS = ("mean", "variance", "aleatoric", "epistemic")
"""The mixture's per-example moments, each ``[N, T]`` in the data's units."""
OUTPUT_KEYS = (*MOMENT_KEYS, "lower", "upper", "member_mean", "member_variance")
"""The arrays ``predict`` writes for a regression run, in order."""
PLOT_FILE = "regression.png"
"""The figure a run on one-feature data draws: mixture mean +/- 2 sd, members, data."""


@dataclasses.dataclass(frozen=True)
class IntervalCalibration:
    """What ``meshensemble evaluate --calibrate`` fitted for one checkpoint of a regression run.

    Attributes:
      variance_scale: ``s``: the calibrated variance is ``s * variance``.
      quantile: ``q``: the conformal interval is ``mean +/- q * sqrt(s * variance)``.
      alpha: the miscoverage ``q`` was fitted for.
      step: the checkpoint it belongs to.

    Example:
      >>> IntervalCalibration(1.5, 1.7, 0.1, 2).quantile
      1.7
    """

    variance_scale: float
    quantile: float
    alpha: float
    step: int


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
    auto_source: ClassVar[str | None] = "toy1d"
    uncalibrated_flag: ClassVar[str | None] = "no_variance_scale"
    conformal_name: ClassVar[str] = "conformal intervals"
    conformal_view: ClassVar[str] = "intervals"
    member_metric_names: ClassVar[tuple[str, ...]] = ("rmse",)
    ensemble_metric_names: ClassVar[tuple[str, ...]] = ("nll", "rmse")
    validation_metrics: ClassVar[dict[str, tuple[str, str]]] = {
        k: (k, "min") for k in ("val_nll", "val_crps", "val_rmse", "val_mae")
    }
    """The mixture's proper scores on the validation split (lower is better)."""
    cli_defaults: ClassVar[dict[str, Any]] = {
        "model": "mlp", "optimizer": "adam", "learning_rate": 0.01, "epochs": 100,
        "batch_size": None, "validation": 0.2,
    }  # fmt: skip
    """SGD 0.1 for 10 epochs (10 steps on the toy's 20 rows) did not fit the 1-D toy or
    diabetes; Adam 0.01 for 100 epochs does. Features are tabular: the zoo's MLP; small
    tables train on their whole training split per step, up to 128 rows. A fifth of the
    training rows is held out, so the run calibrates its intervals on them at the end
    (:attr:`run_calibration`); ``--validation 0`` trains on every row, uncalibrated."""
    run_calibration: ClassVar[dict[str, Any]] = {"alpha": 0.1}
    """A finished run with a validation split fits its variance scale and 90% conformal
    intervals on it (as ``evaluate --calibrate --alpha 0.1``): its uncalibrated intervals
    covered 0.75 (diabetes) and 0.82 (friedman1) at 90%."""

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

    # ------------------------------------------------------------ serving
    def finish(self, out: dict, calibration: Any, calibrated: bool, sets: bool) -> dict:
        """The moments (variances scaled when ``calibrated``) and, with ``sets``, the
        conformal ``lower``/``upper`` ``mean +/- q * sqrt(s * variance)``.

        On the host, after the blocked program (:meth:`finish_device` is the default): a
        product, a square root and a sum of float32 numpy arrays are rounded correctly
        element by element, so an example's interval does not depend on its batch."""
        out = {k: np.asarray(v) for k, v in out.items()}
        cal = calibration
        if cal is not None and sets:
            half = cal.quantile * np.sqrt(cal.variance_scale * out["variance"])
            out |= {"lower": out["mean"] - half, "upper": out["mean"] + half}
        if cal is not None and calibrated:
            s = np.float32(cal.variance_scale)
            out |= {k: out[k] * s for k in MOMENT_KEYS[1:]}
        return {k: out[k] for k in (*OUTPUT_KEYS, *out) if k in out}  # the program's are sorted

    def csv_keys(self, out: Mapping[str, Any]) -> list[str]:
        """The moments and, when there, ``lower`` and ``upper`` (a column per target)."""
        return [k for k in OUTPUT_KEYS if k in out and not k.startswith("member_")]

    def view(self, out: dict, which: str) -> Any:
        """The moments; each member's ``mean``/``variance``; the variances; the intervals."""
        if which == "predict":
            return {k: out[k] for k in MOMENT_KEYS}
        if which == "members":
            return {"mean": out["member_mean"], "variance": out["member_variance"]}
        if which == "uncertainty":
            return {k: out[k] for k in MOMENT_KEYS[1:]}
        if which == "intervals":
            return out["lower"], out["upper"]
        raise ValueError("a regression run has no prediction sets; use predictor.intervals(x)")

    def exported(self, per_example: dict, per_member: dict, calibration: Any) -> dict:
        """``mean``, ``variance`` (scaled when calibrated), ``member_mean``, ``member_variance``."""
        variance = per_example["variance"]
        if calibration is not None:
            variance = variance * jnp.float32(calibration.variance_scale)
        return {"mean": per_example["mean"], "variance": variance, **per_member}

    def export_metadata(self, calibration: Any, width: int) -> dict[str, Any]:
        """``outputs``, ``targets``, ``variance_scale`` and ``conformal`` (None uncalibrated)."""
        cal = calibration
        return {
            "outputs": {
                "mean": ["batch", "targets"],
                "variance": ["batch", "targets"],
                "member_mean": ["members", "batch", "targets"],
                "member_variance": ["members", "batch", "targets"],
            },  # fmt: skip
            "targets": self.targets,
            "variance_scale": None if cal is None else cal.variance_scale,
            "conformal": None if cal is None else {"quantile": cal.quantile, "alpha": cal.alpha},
        }

    # ------------------------------------------------------------ calibration
    def check_calibration(self, n: int, alpha: float, method: str, note: Callable) -> None:
        """Refuses ``--conformal`` other than the default, or an alpha outside ``(0, 1)`` or
        too small for the ``n * T`` validation scores."""
        if method != "thr":
            raise ValueError(
                f"--conformal {method} is for classification sets; a regression run's "
                "intervals are normalised split conformal: drop --conformal"
            )
        check_alpha_for(n * self.targets, alpha, f"the run's {n * self.targets} validation scores")

    def calibrate(self, ens: Any, state: Any, validation: Any, test: Any, **options) -> tuple:
        """A variance scale and a conformal interval quantile (:func:`calibrate_regression`)."""
        return calibrate_regression(ens, state, validation, test, options.get("alpha", 0.1)), {}

    def read_calibration(self, section: Mapping[str, Any]) -> IntervalCalibration:
        """The :class:`IntervalCalibration` of a saved section."""
        conformal = section["conformal"]
        cal = IntervalCalibration(
            float(section["variance_scale"]), float(conformal["quantile"]),
            float(conformal["alpha"]), int((section.get("fitted_for") or {}).get("step", -1)),
        )  # fmt: skip
        if not (cal.variance_scale > 0 and math.isfinite(cal.quantile) and 0 < cal.alpha < 1):
            raise ValueError(f"{cal}")
        return cal

    def calibration_summary(self, calibration: Any, applied: bool, out: Mapping) -> str:
        """``variance scale s applied`` (or not), and the intervals' alpha."""
        how = f"variance scale {calibration.variance_scale:.4g} "
        how += "applied" if applied else "not applied"
        if "lower" in out:
            how += f", intervals at alpha={calibration.alpha:g}"
        return how

    def calibration_flags(self, section: Mapping[str, Any]) -> list[str]:
        """``--alpha ALPHA``: the intervals' miscoverage."""
        return ["--alpha", f"{section['conformal']['alpha']:g}"]

    def calibration_line(self, section: Mapping[str, Any]) -> str:
        """The variance scale, the conformal quantile, coverage and width before and after."""
        t, conf = section["test"], section["conformal"]
        level = round(100 * (1 - conf["alpha"]), 2)
        return (
            f"calibrated on {conf['num_calibration']} validation scores: variance scale "
            f"{section['variance_scale']:.4g} (gaussian nll {t['nll_gaussian_before']:.4f} -> "
            f"{t['nll_gaussian_after']:.4f}), conformal q {conf['quantile']:.4g}\n  {level:g}% "
            f"coverage/width before {t['coverage_before']:.3f}/{t['width_before']:.4g}, scaled "
            f"{t['coverage_scaled']:.3f}/{t['width_scaled']:.4g}, conformal "
            f"{t['coverage_conformal']:.3f}/{t['width_conformal']:.4g}"
        )

    def uncalibrated_line(self, workdir: str, why: str) -> str:
        """``note: intervals and variances uncalibrated, <why and the fix>``."""
        return f"note: intervals and variances uncalibrated, {why}"

    # ------------------------------------------------------------ runs and their reports
    def check_dataset(self, dataset: Any) -> None:
        """Float targets of ``T`` columns with some spread, and two training rows or more.

        Raises:
          ValueError: class labels, another ``T``, a single training row, or a constant
            target column (one line naming it and the fix).
        """
        y = np.asarray(dataset.y_train)
        if not np.issubdtype(y.dtype, np.floating):
            raise ValueError(
                f"{dataset.name} has class labels {y.shape} ({y.dtype}), not float targets; "
                "drop --task regression (or give float targets)"
            )
        if len(y) < 2:
            raise ValueError(
                f"{dataset.name} has {len(y)} training row(s) after the validation split; a "
                "regression run needs 2 or more (give more data or a smaller --validation)"
            )
        flat = np.flatnonzero(np.ptp(y.reshape(len(y), -1), axis=0) == 0)
        if flat.size:
            raise ValueError(
                f"{dataset.name}'s y_train {y.shape} is constant in target column(s) "
                f"{flat.tolist()} (value {float(y.reshape(len(y), -1)[0, flat[0]]):g}): there "
                "is nothing to regress; give targets that vary"
            )

    def for_data(self, dataset: Any, options: Mapping[str, Any]) -> Regression:
        """The targets' count, mean and standard deviation on the training split (the model
        learns standardised targets; predictions are in the data's units)."""
        super().for_data(dataset, options)  # refuses label smoothing
        if dataset is None:  # no data: no statistics
            return self
        y = np.asarray(dataset.y_train).reshape(len(dataset.y_train), -1)  # its own dtype
        std = np.where(y.std(0) > 0, y.std(0), 1.0)
        return dataclasses.replace(self, targets=y.shape[1], target_shift=tuple(y.mean(0).tolist()),
                                   target_scale=tuple(std.tolist()))  # fmt: skip

    def record(self) -> dict[str, Any]:
        """``name``, ``targets``, ``min_variance``, ``target_shift``, ``target_scale``."""
        return {"name": self.name, "targets": self.targets, "min_variance": self.min_variance,
                "target_shift": self.target_shift, "target_scale": self.target_scale}  # fmt: skip

    @classmethod
    def from_record(cls, record: Mapping[str, Any], resolved: Mapping[str, Any]) -> Regression:
        """The recorded task; runs before the record have ``resolved.standardizer``."""
        if not record:
            stats = resolved.get("standardizer") or {}
            shift, scale = stats.get("y_mean"), stats.get("y_std")
            record = {"targets": len(shift or [0]), "target_shift": shift, "target_scale": scale}
        keys = ("targets", "min_variance", "target_shift", "target_scale")
        return cls(**{k: record[k] for k in keys if record.get(k) is not None})

    def record_scores(self, scores: Mapping[str, Any], split: str) -> dict[str, Any]:
        """``{split}_<score>`` for every score but ``count``."""
        return {f"{split}_{k}": v for k, v in scores.items() if k != "count"}

    def report(self, result: Mapping[str, Any]) -> str:
        """The proper scores, then the intervals' coverage and width."""
        r = result
        return "\n".join([
            f"test nll {r['test_nll']:.4f}, rmse {r['test_rmse']:.4f}, mae {r['test_mae']:.4f}, "
            f"crps {r['test_crps']:.4f}, quantile calibration error "
            f"{r['test_quantile_calibration_error']:.4f}",
            "intervals: " + ", ".join(
                f"{c}% coverage {r[f'test_coverage_{c}']:.3f} width {r[f'test_width_{c}']:.4g}"
                for c in (50, 90, 95)
            ),
        ])  # fmt: skip

    def epoch_line(self, record: Mapping[str, Any], epochs: int, seconds: float) -> str:
        """``epoch E/N step S: loss ..., test nll ..., rmse ..., crps ..., 90% coverage ...``."""
        r, loss = record, record.get("train_mean_member_loss", float("nan"))
        return (
            f"epoch {r['epoch']}/{epochs} step {r['step']}: loss {loss:.4f}, test nll "
            f"{r['test_nll']:.4f}, rmse {r['test_rmse']:.4f}, crps {r['test_crps']:.4f}, "
            f"90% coverage {r['test_coverage_90']:.3f} | {seconds:.1f}s"
        )

    def run_figures(self, history: list[dict[str, Any]], predict: Any, train: Any) -> dict:
        """``regression.png`` for one feature and one target: the mixture and members on a
        grid spanning the training inputs widened by half their range on each side."""
        x, y = train
        if np.shape(x)[1:] != (1,) or self.targets != 1:
            return {}
        from meshensemble import plots

        lo, hi = float(np.min(x)), float(np.max(x))
        grid = np.linspace(lo - (hi - lo) / 2, hi + (hi - lo) / 2, 200, dtype=np.float32)[:, None]
        out, each = predict(grid)  # every process takes part; process 0 draws
        sd = np.sqrt(out["variance"][:, 0])
        members = each["mean"][..., 0]
        draw = lambda path: plots.regression_figure(
            grid[:, 0], out["mean"][:, 0], sd, members, np.asarray(x), np.asarray(y), path
        )
        return {PLOT_FILE: draw}


def _intervals(mean: Any, sd: Any, y: Any, k: float) -> dict[str, float]:
    inside = np.abs(np.asarray(y) - mean) <= k * sd
    return {"coverage": float(np.mean(inside)), "width": float(np.mean(2 * k * sd))}


def _gaussian_nll(mean: Any, var: Any, y: Any) -> float:
    return float(np.mean(0.5 * (np.log(2 * np.pi * var) + (y - mean) ** 2 / var)))


def calibrate_regression(
    ens: Any, state: Any, val: tuple[Any, Any], test: tuple[Any, Any], alpha: float
) -> dict[str, Any]:
    """Fits the variance scale and the conformal quantile on ``val``; scores them on ``test``.

    The scale ``s`` is :func:`meshensemble.calibration.fit_variance_scale` of the mixture's
    mean and variance; ``q`` is :func:`meshensemble.calibration.conformal_interval_quantile`
    of the residuals normalised by the scaled standard deviation ``sqrt(s * variance)``, so
    the calibrated interval is ``mean +/- q * sqrt(s * variance)``.

    Args:
      ens: the regression ensemble; state: its state.
      val: ``(x_val, y_val)``; test: ``(x_test, y_test)`` (targets ``[N, T]``).
      alpha: the miscoverage.

    Returns:
      ``{"variance_scale": s, "conformal": {"quantile": q, "alpha", "num_calibration"},
      "test": {...}}``; ``test`` holds the Gaussian NLL (moment-matched) before/after the
      scale and ``coverage``/``width`` of ``mean +/- z sd`` (``z`` the normal
      ``1 - alpha/2`` quantile) before and after the scale, and of the conformal interval.

    Example:
      >>> x = np.linspace(-1, 1, 40, dtype=np.float32)[:, None]
      >>> net = me.models.MLP((8,), num_classes=2)
      >>> reg = me.Ensemble(net, optax.adam(1e-2), 2, mesh, task=Regression(1))
      >>> section = calibrate_regression(reg, reg.init(key, x[:1]), (x, x), (x, x), 0.1)
      >>> sorted(section)
      ['conformal', 'test', 'variance_scale']
    """
    moments = lambda x: fetch(ens.predict(state, x))
    v = moments(val[0])
    y_val = np.asarray(val[1], np.float32).reshape(v["mean"].shape)
    s = calibration_lib.fit_variance_scale(v["mean"], v["variance"], y_val)
    sd_val = np.sqrt(s * v["variance"])
    q = calibration_lib.conformal_interval_quantile(v["mean"], sd_val, y_val, alpha)
    t = moments(test[0])
    y = np.asarray(test[1], np.float32).reshape(t["mean"].shape)
    sd = np.sqrt(t["variance"])
    z = statistics.NormalDist().inv_cdf(1 - alpha / 2)
    scores = {
        "nll_gaussian_before": _gaussian_nll(t["mean"], t["variance"], y),
        "nll_gaussian_after": _gaussian_nll(t["mean"], s * t["variance"], y),
    }
    kinds = {
        "before": (sd, z),
        "scaled": (sd * math.sqrt(s), z),
        "conformal": (sd * math.sqrt(s), q),
    }
    for name, (spread, k) in kinds.items():
        for key, value in _intervals(t["mean"], spread, y, k).items():
            scores[f"{key}_{name}"] = value
    return {
        "variance_scale": s,
        "conformal": {"quantile": q, "alpha": float(alpha), "num_calibration": int(y_val.size)},
        "test": scores,
    }


def intervals_from(mean: Any, variance: Any, meta: Mapping[str, Any]) -> tuple[Any, Any]:
    """``(lower, upper)`` from an exported artifact's ``mean``/``variance`` and ``export.json``.

    Raises:
      ValueError: the export is of an uncalibrated run.

    Example:
      >>> meta = {"conformal": {"quantile": 2.0, "alpha": 0.1}}
      >>> intervals_from(np.zeros(1), np.ones(1), meta)
      (array([-2.]), array([2.]))
    """
    conformal = meta.get("conformal")
    if not conformal:
        raise ValueError("the exported run is not calibrated: no conformal quantile")
    half = conformal["quantile"] * np.sqrt(np.asarray(variance))
    return np.asarray(mean) - half, np.asarray(mean) + half
