"""A Poisson ensemble (``poisson.py``): the Ensemble API, then a run trained, resumed,
evaluated, predicted with and exported by the library, nothing inside it changed.

  python examples/custom_task/main.py --fake-devices 8 --workdir runs/counts
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # poisson.py, as Flax's examples


def counts(n_train: int = 512, n_test: int = 128, seed: int = 0):
    """Counts of a Poisson log-linear model in 3 features: ``rate = exp(0.5 + x w)``."""
    import meshensemble as me

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n_train + n_test, 3)).astype(np.float32)
    y = rng.poisson(np.exp(0.5 + x @ np.array([0.6, -0.4, 0.2]))).astype(np.float32)[:, None]
    return me.data.Dataset("counts", x[:n_train], y[:n_train], x[n_train:], y[n_train:],
                           source="arrays", note="Poisson counts in 3 features")  # fmt: skip


def ensemble_steps(data, steps: int = 20):
    """``me.Ensemble(..., task=Poisson())``: steps, the ensemble's rate, its scores."""
    import jax
    import optax
    from poisson import Poisson

    import meshensemble as me

    net = me.models.MLP((32,), num_classes=1)  # one output: the log-rate
    ens = me.Ensemble(net, optax.adam(0.01), 4, me.make_mesh(ensemble=4, data=2), task=Poisson())
    state = ens.init(jax.random.key(0), data.x_train[:1])
    for i in range(steps):
        rows = slice(64 * (i % 8), 64 * (i % 8 + 1))
        state, metrics = ens.train_step(state, data.x_train[rows], data.y_train[rows])
    return ens.predict(state, data.x_test), ens.evaluate(state, data.x_test, data.y_test)


def main(argv: list[str] | None = None) -> dict:
    """Runs every step; returns what it made (for the test)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--fake-devices", type=int, default=None)
    p.add_argument("--workdir", default="runs/counts")
    p.add_argument("--epochs", type=int, default=4)
    args = p.parse_args(argv)
    import meshensemble as me

    if args.fake_devices:
        me.use_fake_cpu_devices(args.fake_devices)
    from poisson import Poisson

    data = counts()
    rates, scores = ensemble_steps(data)
    print(f"Ensemble API: rates {rates.shape}, test nll {scores['nll']:.4f}")
    cfg = me.TrainConfig(model="mlp", members=4, mesh="ensemble=4,data=2", epochs=args.epochs,
                         batch_size=64, optimizer="adam", learning_rate=0.01, chunk_steps=4,
                         workdir=args.workdir, quiet=True)  # fmt: skip
    run = me.training.train(cfg, dataset=data, task=Poisson())  # chunks of 4 steps
    cut = dataclasses.replace(cfg, workdir=args.workdir + "_cut")
    stopped = me.training.train(dataclasses.replace(cut, max_steps=6), data, task=Poisson())
    resumed = me.training.train(cut, dataset=data, task=Poisson())  # from checkpoint 6
    print(
        f"trained: step {run.history[-1]['step']}, test nll {run.history[-1]['test_nll']:.4f}"
        f"; resumed from step {stopped.history[-1]['step']} to {resumed.history[-1]['step']}"
    )
    result = me.evaluation.evaluate_run(args.workdir, dataset=data, echo=lambda line: None)
    print(f"evaluated: test nll {result['test_nll']:.4f}, rmse {result['test_rmse']:.4f}")
    predictor = me.load_predictor(args.workdir)
    predicted = predictor.predict(data.x_test[:5])
    print(f"predicted rates {[round(float(r), 3) for r in predicted[:, 0]]}")
    meta = me.serving.export_ensemble(predictor, args.workdir + "_export", platforms=("cpu",))
    print(f"exported for {meta['platforms']}: task {meta['task']}")
    return {"run": run, "resumed": resumed, "result": result, "predicted": predicted,
            "meta": meta, "ensemble_rates": rates}  # fmt: skip


if __name__ == "__main__":
    main()
