"""Diabetes: an 8-member Gaussian MLP ensemble beside one member, BayesianRidge and GBR.

Run (from the repository root; 8 fake CPU devices are set up here):

    python examples/regression/compare.py [--seed 0] [--steps 300]

Prints one Markdown table of test NLL, RMSE, CRPS, 90% coverage and width (the data's
units) on a seeded 80/20 split of scikit-learn's ``load_diabetes``, and the mean coverage
of split-conformal 90% intervals over 20 random calibration/test splits of the test part.
"""

from __future__ import annotations

import argparse
import math

import jax
import numpy as np
import optax
from scipy import stats
from sklearn.ensemble import GradientBoostingRegressor
from sklearn.linear_model import BayesianRidge

import meshensemble as me

ENSEMBLE = "ensemble (8 MLP members, mixture)"
"""The ensemble's row in the table (and in what :func:`main` returns)."""


def gaussian_scores(mean, sd, y):
    """NLL, RMSE, CRPS (closed form), 90% coverage and width of Gaussians ``N(mean, sd^2)``."""
    z = (y - mean) / sd
    crps = sd * (z * (2 * stats.norm.cdf(z) - 1) + 2 * stats.norm.pdf(z) - 1 / math.sqrt(math.pi))
    q = stats.norm.ppf(0.95)
    return {
        "nll": float(-stats.norm.logpdf(y, mean, sd).mean()),
        "rmse": float(np.sqrt(((mean - y) ** 2).mean())),
        "crps": float(crps.mean()),
        "coverage_90": float((np.abs(y - mean) <= q * sd).mean()),
        "width_90": float(2 * q * sd.mean()),
    }


def train_ensemble(data, members, steps, seed):
    st = me.data.standardizer(data)
    task = me.tasks.Regression(1, target_shift=st["y_mean"], target_scale=st["y_std"])
    xm, xs = np.float32(st["x_mean"]), np.float32(st["x_std"])
    ens = me.Ensemble(
        me.models.MLP((50,), num_classes=2), optax.adamw(3e-3, weight_decay=1e-2), members,
        me.make_mesh(min(members, 8), 1), task=task,
        input_transform=lambda x: (x - xm[None]) / xs[None],
    )  # fmt: skip
    state = ens.init(jax.random.key(seed), data.x_train[:1])
    n = len(data.x_train) // 32 * 32
    order_rng = np.random.default_rng(seed)
    for step in range(steps):
        if step % (n // 32) == 0:
            order = order_rng.permutation(len(data.x_train))[:n].reshape(-1, 32)
        idx = order[step % (n // 32)]
        state, _ = ens.train_step(state, data.x_train[idx], data.y_train[idx])
    return ens, state


def main(argv: list[str] | None = None, quiet: bool = False) -> dict[str, dict[str, float]]:
    """Trains, scores and prints the table (unless ``quiet``); returns its rows (and
    ``"conformal"``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--fake-devices", type=int, default=8, help="0: the real devices")
    args = parser.parse_args(argv)
    if args.fake_devices:  # before JAX's first computation
        me.use_fake_cpu_devices(args.fake_devices)
    data = me.data.diabetes(seed=args.seed)
    y = data.y_test[:, 0].astype(np.float64)
    rows = {}
    ens, state = train_ensemble(data, 8, args.steps, args.seed)
    rows[ENSEMBLE] = ens.evaluate(state, data.x_test, data.y_test)
    one = ens.predict_members(state, data.x_test)
    m0 = np.asarray(one["mean"])[0, :, 0]
    sd0 = np.sqrt(np.asarray(one["variance"])[0, :, 0])
    rows["single Gaussian MLP (member 0)"] = gaussian_scores(m0, sd0, y)
    br = BayesianRidge().fit(data.x_train, data.y_train[:, 0])
    mean, sd = br.predict(data.x_test, return_std=True)
    rows["BayesianRidge"] = gaussian_scores(mean, sd, y)
    fit = lambda **kw: GradientBoostingRegressor(random_state=args.seed, **kw).fit(
        data.x_train, data.y_train[:, 0]
    )
    mean = fit().predict(data.x_test)
    lo, hi = (fit(loss="quantile", alpha=a).predict(data.x_test) for a in (0.05, 0.95))
    rows["GradientBoosting (quantile 5/95%)"] = {
        "nll": float("nan"),
        "rmse": float(np.sqrt(((mean - y) ** 2).mean())),
        "crps": float("nan"),
        "coverage_90": float(((lo <= y) & (y <= hi)).mean()),
        "width_90": float((hi - lo).mean()),
    }
    say = (lambda *a: None) if quiet else print
    say("| model | NLL | RMSE | CRPS | 90% coverage | 90% width |")
    say("|---|---|---|---|---|---|")
    for name, r in rows.items():
        cells = [r["nll"], r["rmse"], r["crps"], r["coverage_90"], r["width_90"]]
        text = ["n/a" if math.isnan(c) else f"{c:.3f}" for c in cells]
        say(f"| {name} | " + " | ".join(text) + " |")
    out = ens.predict(state, data.x_test)
    mu, sd = np.asarray(out["mean"])[:, 0], np.sqrt(np.asarray(out["variance"]))[:, 0]
    covered = []
    for split in range(20):
        order = np.random.default_rng(split).permutation(len(y))
        cal, test = order[: len(y) // 2], order[len(y) // 2 :]
        q = me.calibration.conformal_interval_quantile(mu[cal], sd[cal], y[cal], 0.1)
        covered.append(np.mean(np.abs(y[test] - mu[test]) <= q * sd[test]))
    say(f"\nconformal 90% (ensemble mean +/- q sd): mean coverage over 20 splits "
        f"{np.mean(covered):.3f} (min {np.min(covered):.3f})")  # fmt: skip
    return rows | {"conformal": {"coverage_90": float(np.mean(covered))}}


if __name__ == "__main__":
    main()
