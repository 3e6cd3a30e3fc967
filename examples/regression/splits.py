"""Regression over seeded splits: the command line's ensemble beside BayesianRidge and a GP.

Run (from the repository root; every run of the ensemble is the ``meshensemble`` command
line, in a subprocess):

    python examples/regression/splits.py --source diabetes [--seeds 0 1 2 3 4]
    python examples/regression/splits.py --source friedman1
    python examples/regression/splits.py --source diabetes -- --epochs 30   # flags for train
    python examples/regression/splits.py --source diabetes -- --validation 0  # uncalibrated
    python examples/regression/splits.py --search [--seeds 0 1 2 3 4]

The default mode, for each seed ``S``: ``meshensemble train --task regression --source
SOURCE --seed S`` with the regression defaults (and the flags after ``--``), which hold
out 20% of the training rows and fit the run's calibration on them at the end (and write
the mixture's test scores to ``evaluation.json``); ``meshensemble predict --sets`` on the
test features (what a user is served: the calibrated mean and variance and the conformal
90% intervals). For friedman1, whose rows can be drawn afresh, the same ``predict`` also
scores :data:`FRESH_ROWS` new rows of the same problem: the served intervals' coverage
there is their coverage on the population, free of the test split's sampling noise
(200 rows: a standard deviation of about 0.02 at 90%). Beside it,
on the same split, scikit-learn's ``BayesianRidge`` and a ``GaussianProcessRegressor``
(an RBF kernel with one length scale per feature, times a constant, plus a white-noise
kernel; ``normalize_y``; standardised features), both fitted on every training row and
scored as the Gaussians they predict. Prints a row per seed and model, then the mean and
sample standard deviation over the seeds.

``--search`` compares the candidate recipes of :data:`RECIPES` on diabetes and friedman1
on **the validation split of the training rows** (20%, held out by the run itself: the
test split is never read for the choice). The score is what the run will serve: the
Gaussian NLL of the mixture's mean and variance once the variance scale is fitted
(:func:`cross_fitted_nll`: fitted on one half of the validation rows, scored on the
other). It names the recipe with the lowest such NLL summed over the two sources (their
means over the seeds). This is how the regression defaults of ``meshensemble train``
were chosen (docs/regression.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import warnings

import numpy as np
from scipy import stats
from sklearn.exceptions import ConvergenceWarning
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel
from sklearn.linear_model import BayesianRidge

import meshensemble as me

KEYS = ("nll", "crps", "rmse", "coverage_90", "width_90")
"""The scores of every model, on the test split, in the targets' units."""
SOURCES = {"diabetes": me.data.diabetes, "friedman1": me.data.friedman1}
"""The seeded regression sources (``--source NAME --seed S`` of the command line)."""
FRESH_ROWS = 20_000
"""New friedman1 rows the served intervals are also scored on (drawn with
``make_friedman1(random_state=FRESH_SEED + seed)``, a stream no split uses)."""
FRESH_SEED = 1_000_000
VALIDATION = 0.2
"""The share of the training rows a search run holds out (and scores the recipes on)."""
RECIPES = {
    "old": ["--optimizer", "adam", "--learning-rate", "0.01", "--epochs", "100",
            "--batch-size", "128"],
    "old-cosine": ["--optimizer", "adam", "--learning-rate", "0.01", "--epochs", "100",
                   "--batch-size", "128", "--schedule", "cosine"],
    "docs": ["--optimizer", "adam", "--learning-rate", "0.003", "--epochs", "30",
             "--batch-size", "32"],
    "adamw-32": ["--optimizer", "adamw", "--learning-rate", "0.003", "--weight-decay", "0.01",
                 "--epochs", "40", "--batch-size", "32"],
    "adam-1e-3-cos": ["--optimizer", "adam", "--learning-rate", "0.001", "--epochs", "100",
                      "--batch-size", "32", "--schedule", "cosine"],
    "adam-3e-3-cos-200": ["--optimizer", "adam", "--learning-rate", "0.003", "--epochs", "200",
                          "--batch-size", "32", "--schedule", "cosine"],
    "adamw-wd1-cos-200": ["--optimizer", "adamw", "--learning-rate", "0.01", "--weight-decay",
                          "1.0", "--epochs", "200", "--batch-size", "128", "--schedule", "cosine"],
}  # fmt: skip
"""The candidate recipes ``--search`` compares: every optimisation flag given (``old``:
the defaults before they were measured: batches of the whole split up to 128 rows;
``docs``: docs/regression.md's diabetes command), the model (8 members of the zoo's
``MLP((128,))``) and the variance floor left as they are."""


def gaussian_scores(mean, sd, y) -> dict[str, float]:
    """NLL, CRPS (closed form), RMSE, 90% coverage and width of Gaussians ``N(mean, sd^2)``."""
    mean, sd, y = (np.asarray(a, np.float64).reshape(-1) for a in (mean, sd, y))
    z = (y - mean) / sd
    crps = sd * (z * (2 * stats.norm.cdf(z) - 1) + 2 * stats.norm.pdf(z) - 1 / math.sqrt(math.pi))
    q = stats.norm.ppf(0.95)
    return {
        "nll": float(-stats.norm.logpdf(y, mean, sd).mean()),
        "crps": float(crps.mean()),
        "rmse": float(np.sqrt(((mean - y) ** 2).mean())),
        "coverage_90": float((np.abs(y - mean) <= q * sd).mean()),
        "width_90": float(2 * q * sd.mean()),
    }


def meshensemble(*argv: str) -> None:
    """Runs ``meshensemble ARGV`` in a subprocess (its output dropped; a failure raises)."""
    run = [sys.executable, "-m", "meshensemble.cli", *argv]
    subprocess.run(run, check=True, stdout=subprocess.DEVNULL)


def fresh_rows(source: str, seed: int) -> tuple[np.ndarray, np.ndarray] | None:
    """:data:`FRESH_ROWS` new rows of friedman1 for split ``seed`` (None for diabetes)."""
    if source != "friedman1":
        return None
    from sklearn.datasets import make_friedman1

    x, y = make_friedman1(n_samples=FRESH_ROWS, noise=1.0, random_state=FRESH_SEED + seed)
    return x.astype(np.float32), y.astype(np.float32)[:, None]


def cli_scores(source: str, seed: int, workdir: str, flags: list[str]) -> dict[str, dict]:
    """Trains and predicts with the command line on split ``seed``.

    Returns:
      ``{"calibrated": scores of what predict serves (the calibrated Gaussian, the
      conformal 90% interval; for friedman1 also ``fresh_coverage_90``, on
      :func:`fresh_rows`), "mixture": the uncalibrated mixture's test scores, from the
      ``evaluation.json`` the run wrote when it calibrated itself (evaluate's numbers)}``.
    """
    meshensemble("train", "--task", "regression", "--source", source, "--seed", str(seed),
                 "--workdir", workdir, "--quiet", "--overwrite", *flags)  # fmt: skip
    with open(os.path.join(workdir, "evaluation.json")) as f:
        result = json.load(f)
    data = SOURCES[source](seed=seed)
    x_path, out = os.path.join(workdir, "x_test.npy"), os.path.join(workdir, "test.npz")
    fresh, n = fresh_rows(source, seed), data.num_test
    np.save(x_path, data.x_test if fresh is None else np.concatenate([data.x_test, fresh[0]]))
    meshensemble("predict", "--workdir", workdir, "--input", x_path, "--out", out, "--sets",
                 "--quiet")  # fmt: skip
    with np.load(out) as p:
        served = gaussian_scores(p["mean"][:n], np.sqrt(p["variance"][:n]), data.y_test)
        inside = (p["lower"][:n] <= data.y_test) & (data.y_test <= p["upper"][:n])
        served["coverage_90"] = float(inside.mean())
        served["width_90"] = float((p["upper"][:n] - p["lower"][:n]).mean())
        if fresh is not None:
            inside = (p["lower"][n:] <= fresh[1]) & (fresh[1] <= p["upper"][n:])
            served["fresh_coverage_90"] = float(inside.mean())
    return {"calibrated": served, "mixture": {k: float(result[f"test_{k}"]) for k in KEYS}}


def baseline_scores(source: str, seed: int) -> dict[str, dict[str, float]]:
    """BayesianRidge and the GP on split ``seed`` (every training row), as Gaussians."""
    data = SOURCES[source](seed=seed)
    mu, sd = data.x_train.mean(0), data.x_train.std(0)
    x, xt = (data.x_train - mu) / sd, (data.x_test - mu) / sd
    y, yt = data.y_train[:, 0].astype(np.float64), data.y_test[:, 0].astype(np.float64)
    br = BayesianRidge().fit(x, y).predict(xt, return_std=True)
    kernel = ConstantKernel() * RBF(np.ones(x.shape[1])) + WhiteKernel()
    gp = GaussianProcessRegressor(kernel, normalize_y=True, n_restarts_optimizer=2,
                                  random_state=seed)  # fmt: skip
    with warnings.catch_warnings():  # a length scale at its upper bound: a feature the GP
        warnings.simplefilter("ignore", ConvergenceWarning)  # ignores (friedman1's last 5)
        gp.fit(x, y)
    return {"BayesianRidge": gaussian_scores(*br, yt),
            "GP": gaussian_scores(*gp.predict(xt, return_std=True), yt)}  # fmt: skip


def summarise(models: dict[str, list[dict[str, float]]], seeds: list[int]) -> None:
    """Prints each model's mean (sample sd) of every score over the seeds."""
    print(f"\nmean (sd) over seeds {seeds}:")
    print("| model | " + " | ".join(KEYS) + " |\n|---|" + "---|" * len(KEYS))
    for name, rs in models.items():
        cells = [f"{np.mean([r[k] for r in rs]):.3f} ({np.std([r[k] for r in rs], ddof=1):.3f})"
                 for k in KEYS]  # fmt: skip
        print(f"| {name} | " + " | ".join(cells) + " |")


def report(args: argparse.Namespace, flags: list[str]) -> dict[str, list[dict[str, float]]]:
    """The default mode: the ensemble (calibrated and not) and the baselines, every seed."""
    models: dict[str, list[dict[str, float]]] = {}
    print(f"{args.source}: | seed | model | " + " | ".join(KEYS) + " |")
    for seed in args.seeds:
        workdir = os.path.join(args.workdir, f"{args.source}{seed}")
        ens = cli_scores(args.source, seed, workdir, flags)
        rows = {"ensemble, calibrated": ens["calibrated"], "ensemble, mixture": ens["mixture"]}
        rows |= baseline_scores(args.source, seed)
        for name, r in rows.items():
            models.setdefault(name, []).append(r)
            print(f"| {seed} | {name} | " + " | ".join(f"{r[k]:.3f}" for k in KEYS) + " |")
        if "fresh_coverage_90" in ens["calibrated"]:
            print(f"  seed {seed}: calibrated 90% intervals cover "
                  f"{ens['calibrated']['fresh_coverage_90']:.4f} of {FRESH_ROWS} fresh rows",
                  flush=True)  # fmt: skip
    summarise(models, args.seeds)
    ens = models["ensemble, calibrated"]
    print("calibrated 90% coverage per split: " + ", ".join(f"{e['coverage_90']:.3f}" for e in ens))
    if "fresh_coverage_90" in ens[0]:
        fresh = [e["fresh_coverage_90"] for e in ens]
        cells = ", ".join(f"{c:.4f}" for c in fresh)
        spread = f"mean {np.mean(fresh):.4f}, sd {np.std(fresh, ddof=1):.4f}"
        print(f"  on {FRESH_ROWS} fresh rows: {cells} ({spread})")
    for other in ("BayesianRidge", "GP"):
        for k in ("nll", "crps"):
            wins = sum(e[k] < b[k] for e, b in zip(ens, models[other]))
            print(f"  calibrated ensemble's {k} below {other}'s on {wins} of {len(ens)} splits")
    return models


def cross_fitted_nll(mean, variance, y) -> float:
    """The Gaussian NLL of ``N(mean, s * variance)`` with the variance scale ``s`` of the run's
    calibration fitted on one half of the rows and scored on the other (both ways, averaged):
    what the calibrated ensemble would score, without fitting and scoring on the same rows."""
    mean, variance, y = (np.asarray(a, np.float64).reshape(-1) for a in (mean, variance, y))
    half = len(y) // 2
    out = []
    for fit, score in ((slice(0, half), slice(half, None)), (slice(half, None), slice(0, half))):
        s = np.mean((y[fit] - mean[fit]) ** 2 / variance[fit])  # fit_variance_scale's form
        sd = np.sqrt(s * variance[score])
        out.append(-stats.norm.logpdf(y[score], mean[score], sd))
    return float(np.concatenate(out).mean())


def validation_scores(source: str, seed: int, workdir: str, recipe: list[str]) -> dict:
    """Trains ``recipe`` on split ``seed`` holding out :data:`VALIDATION` of the training rows;
    scores it on those rows only (the test split is not read)."""
    data = SOURCES[source](seed=seed)
    n = round(VALIDATION * data.num_train)
    epochs = recipe[recipe.index("--epochs") + 1]
    meshensemble("train", "--task", "regression", "--source", source, "--seed", str(seed),
                 "--validation", str(n), "--eval-every", epochs, "--overwrite", "--workdir",
                 workdir, "--quiet", *recipe)  # fmt: skip
    split = me.data.split_validation(data, n, seed)  # the run's own validation rows
    x_path, out = os.path.join(workdir, "x_val.npy"), os.path.join(workdir, "val.npz")
    np.save(x_path, split.x)
    meshensemble("predict", "--workdir", workdir, "--input", x_path, "--out", out,
                 "--no-variance-scale", "--quiet")  # fmt: skip
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        last = json.loads(f.read().splitlines()[-1])
    with np.load(out) as p:
        calibrated = cross_fitted_nll(p["mean"], p["variance"], split.y)
    return {"calibrated_nll": calibrated, "nll": last["val_nll"], "rmse": last["val_rmse"]}


def search(args: argparse.Namespace) -> dict[str, dict[str, list[dict]]]:
    """Every recipe on every source and seed, scored on validation rows; prints the pick."""
    found: dict[str, dict[str, list[dict]]] = {}
    for name in args.recipes:
        recipe = RECIPES[name]
        for source in SOURCES:
            rows = found.setdefault(name, {}).setdefault(source, [])
            for seed in args.seeds:
                workdir = os.path.join(args.workdir, f"search-{name}-{source}{seed}")
                rows.append(validation_scores(source, seed, workdir, recipe))
            cells = [f"{k} {np.mean([r[k] for r in rows]):.3f} ({np.std([r[k] for r in rows]):.3f})"
                     for k in rows[0]]  # fmt: skip
            print(f"{name} on {source}: " + ", ".join(cells), flush=True)
    total = {k: sum(np.mean([r["calibrated_nll"] for r in v]) for v in by.values())
             for k, by in found.items()}  # fmt: skip
    pick = min(total, key=total.get)
    print(f"lowest calibrated validation nll, summed over {list(SOURCES)}: {pick}")
    print("  " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(total.items(), key=lambda kv: kv[1])))
    return found


def main(argv: list[str] | None = None) -> dict:
    """Parses the arguments and runs the chosen mode; returns its numbers."""
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=tuple(SOURCES), default="diabetes")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--workdir", default=os.path.join("runs", "splits"))
    parser.add_argument("--search", action="store_true", help="compare RECIPES on validation")
    parser.add_argument("--recipes", nargs="+", choices=tuple(RECIPES), default=list(RECIPES),
                        help="the recipes --search compares (default: all)")
    args = parser.parse_args(argv)
    return search(args) if args.search else report(args, flags)


if __name__ == "__main__":
    main()
