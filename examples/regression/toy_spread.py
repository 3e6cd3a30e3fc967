"""The 1-D toy's figure over seeds: how much wider the ensemble is away from the data.

Run (from the repository root; each seed trains with the command line in a subprocess):

    python examples/regression/toy_spread.py [--seeds 0 1 2 3 4 5 6 7] [-- TRAIN FLAGS]

For each seed ``S``: ``meshensemble train --task regression --source toy1d --seed S``
(the regression defaults, or the flags after ``--``, e.g. ``--learning-rate 0.02 --epochs
300``; docs/regression.md's numbers add ``--validation 0``: the defaults hold 4 of the
toy's 20 rows out), then the restored run's mixture at ``x = -6, 0, 6`` (``me.load_predictor``):
the ratio ``min(sd(-6), sd(6)) / sd(0)`` (the figure's point: the sd grows away from the
data, which lie in ``[-4, 4]``) and the members' spread (the sd of their means) at
``+/-6`` over ``sd(0)``. Prints a row per seed, then the median, minimum and the count
of seeds whose ratio reaches 3.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import numpy as np

import meshensemble as me


def spread(workdir: str) -> tuple[float, float]:
    """``(min sd at +/-6 over sd at 0, min members' spread at +/-6 over sd at 0)``."""
    p = me.load_predictor(workdir)
    x = np.array([[-6.0], [0.0], [6.0]], np.float32)
    sd = np.sqrt(p.predict(x)["variance"][:, 0])
    members = p.predict_members(x)["mean"][:, :, 0]  # [members, 3]
    width = members.std(axis=0)
    return float(min(sd[0], sd[2]) / sd[1]), float(min(width[0], width[2]) / sd[1])


def main(argv: list[str] | None = None) -> list[tuple[float, float]]:
    """Trains every seed and prints the ratios; returns ``(ratio, spread)`` per seed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    parser.add_argument("--workdir", default=os.path.join("runs", "toy_spread"))
    args = parser.parse_args(argv)
    out = []
    print(f"train flags: {' '.join(flags) or '(the regression defaults)'}")
    print("| seed | sd(+/-6) / sd(0) | members' spread(+/-6) / sd(0) |\n|---|---|---|")
    for seed in args.seeds:
        workdir = os.path.join(args.workdir, f"seed{seed}")
        train = ["train", "--task", "regression", "--source", "toy1d", "--seed", str(seed),
                 "--workdir", workdir, "--quiet", *flags]  # fmt: skip
        subprocess.run([sys.executable, "-m", "meshensemble.cli", *train], check=True)
        ratio, members = spread(workdir)
        out.append((ratio, members))
        print(f"| {seed} | {ratio:.2f}x | {members:.2f}x |", flush=True)
    ratios = np.array([r for r, _ in out])
    print(
        f"\nratio over {len(ratios)} seeds: median {np.median(ratios):.2f}x, min "
        f"{ratios.min():.2f}x, max {ratios.max():.2f}x; >= 3x in {(ratios >= 3).sum()}"
    )
    return out


if __name__ == "__main__":
    main()
