"""Diabetes over seeded splits: the CLI's regression ensemble, compare.py's, and BayesianRidge.

Run (from the repository root; each seed trains with the command line in a subprocess):

    python examples/regression/splits.py [--seeds 0 1 2 3 4] [--workdir runs/splits]

For each seed ``S``: ``meshensemble train --task regression --source diabetes --seed S``
with the regression defaults (or the flags after ``--``), ``meshensemble evaluate``, its
test NLL, CRPS, RMSE and 90% coverage from ``evaluation.json``; ``compare.py``'s ensemble
(AdamW 3e-3, 300 steps of batch 32) on the same split; and scikit-learn's
``BayesianRidge`` (its predictive Gaussian). Prints a row per seed and split and the mean
and sample standard deviation over the seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
from sklearn.linear_model import BayesianRidge

import meshensemble as me

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare  # noqa: E402  (the sibling script: gaussian_scores, its ensemble)

KEYS = ("nll", "crps", "rmse", "coverage_90")


def cli_scores(seed: int, workdir: str, flags: list[str]) -> dict[str, float]:
    """Trains and evaluates the CLI's ensemble on split ``seed``; its test scores."""
    run = [sys.executable, "-m", "meshensemble.cli"]
    train = ["train", "--task", "regression", "--source", "diabetes", "--seed", str(seed),
             "--workdir", workdir, "--quiet", *flags]  # fmt: skip
    subprocess.run(run + train, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(run + ["evaluate", "--workdir", workdir], check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(workdir, "evaluation.json")) as f:
        result = json.load(f)
    return {k: float(result[f"test_{k}"]) for k in KEYS}


def bayesian_ridge_scores(seed: int) -> dict[str, float]:
    """BayesianRidge on split ``seed``: its predictive mean and sd as a Gaussian."""
    data = me.data.diabetes(seed=seed)
    mean, sd = (
        BayesianRidge().fit(data.x_train, data.y_train[:, 0]).predict(data.x_test, return_std=True)
    )
    scores = compare.gaussian_scores(mean, sd, data.y_test[:, 0].astype(np.float64))
    return {k: scores[k] for k in KEYS}


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, float]]]:
    """Runs every seed; prints the rows and the summary; returns the scores by model."""
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--workdir", default=os.path.join("runs", "splits"))
    parser.add_argument("--no-compare", action="store_true", help="skip compare.py's ensemble")
    args = parser.parse_args(argv)
    me.use_fake_cpu_devices(8)  # compare.py's mesh; the CLI runs in its own processes
    models: dict[str, list[dict[str, float]]] = {"cli ensemble": [], "BayesianRidge": []}
    if not args.no_compare:
        models["compare.py ensemble"] = []
    print("| seed | model | " + " | ".join(KEYS) + " |\n|---|---|" + "---|" * len(KEYS))
    for seed in args.seeds:
        rows = {
            "cli ensemble": cli_scores(seed, os.path.join(args.workdir, f"seed{seed}"), flags),
            "BayesianRidge": bayesian_ridge_scores(seed),
        }
        if not args.no_compare:
            ens = compare.main(["--seed", str(seed), "--fake-devices", "8"], quiet=True)
            rows["compare.py ensemble"] = {k: ens[compare.ENSEMBLE][k] for k in KEYS}
        for name, r in rows.items():
            models[name].append(r)
            print(f"| {seed} | {name} | " + " | ".join(f"{r[k]:.3f}" for k in KEYS) + " |")
    print(f"\nmean (sd) over seeds {args.seeds}:")
    for name, rs in models.items():
        cells = [f"{k} {np.mean([r[k] for r in rs]):.3f} ({np.std([r[k] for r in rs], ddof=1):.3f})"
                 for k in KEYS]  # fmt: skip
        print(f"  {name}: " + ", ".join(cells))
    pairs = list(zip(models["cli ensemble"], models["BayesianRidge"]))
    for k in ("nll", "crps"):
        wins = sum(c[k] < b[k] for c, b in pairs)
        print(f"  the CLI ensemble's {k} is below BayesianRidge's on {wins} of {len(pairs)} splits")
    return models


if __name__ == "__main__":
    main()
