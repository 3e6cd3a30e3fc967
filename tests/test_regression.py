"""Regression ensembles: the Gaussian mixture on the mesh, proper scores, parity, calibration."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import types
from operator import itemgetter

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import integrate, optimize, special, stats

import meshensemble as me
from meshensemble import testing

M = 8


class Net(nn.Module):
    """A small Gaussian regression head: ``[B, F] -> [B, 2T]``."""

    targets: int = 1

    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(2 * self.targets)(nn.tanh(nn.Dense(16)(x)))


def _data(n=32, targets=1, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2, 2, (n, 3)).astype(np.float32)
    y = np.sin(x[:, :targets] * 2) + 0.2 * rng.normal(size=(n, targets))
    return x, y.astype(np.float32)


X, Y = _data()
TX = optax.adam(1e-2)


def _ens(mesh, backend="shard_map", targets=1, **kw):
    task = me.tasks.Regression(targets=targets, **kw)
    return me.Ensemble(Net(targets), TX, M, mesh, backend=backend, task=task)


@functools.cache
def trained(mesh_shape=(4, 2), backend="shard_map", steps=3):
    mesh = me.make_mesh(*mesh_shape)
    ens = _ens(mesh, backend)
    state = ens.init(jax.random.key(0), X[:1])
    history = []
    for _ in range(steps):
        state, metrics = ens.train_step(state, X, Y)
        history.append(jax.tree.map(np.asarray, metrics))
    return ens, state, history


# ------------------------------------------------------------------ parity
@pytest.mark.parametrize(
    "mesh_shape, backend",
    [
        ((8, 1), "shard_map"),
        pytest.param((2, 4), "shard_map", marks=pytest.mark.slow),
        pytest.param((1, 1), "shard_map", marks=pytest.mark.slow),
        ((8, 1), "pmap"),
    ],
)
def test_regression_is_mesh_and_backend_invariant(mesh_shape, backend):
    _, ref, ref_hist = trained((4, 2))
    _, state, hist = trained(mesh_shape, backend)
    testing.assert_trees_close(state.params, ref.params, rtol=1e-5, atol=1e-5)
    testing.assert_trees_close(hist, ref_hist, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_members_equal_gaussian_models_trained_alone_in_flax_optax():
    ens, state, hist = trained((4, 2))
    task, net = ens.task, Net()

    def loss(params, x, y):  # the data axis's 2 shards: the mean of their mean NLLs
        out = net.apply({"params": params}, x)
        mean, var = out[:, :1], jax.nn.softplus(out[:, 1:]) + task.min_variance
        nll = 0.5 * (jnp.log(2 * jnp.pi * var) + (y - mean) ** 2 / var)
        return jnp.mean(jnp.stack([jnp.mean(h) for h in jnp.split(nll, 2)]))

    @jax.jit
    def step(params, opt_state):
        value, grads = jax.value_and_grad(loss)(params, X, Y)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    got = me.distributed.fetch(state.params)
    for i, k in enumerate(jax.random.split(jax.random.key(0), M)):
        params = net.init(k, X[:1])["params"]
        opt_state = TX.init(params)
        for s in range(3):
            params, opt_state, value = step(params, opt_state)
            np.testing.assert_allclose(hist[s]["loss"][i], value, rtol=1e-5, atol=1e-5)
        testing.assert_trees_close(jax.tree.map(itemgetter(i), got), params, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ the mixture
def _members(ens, state, x):
    pm = me.distributed.fetch(ens.predict_members(state, x))
    return pm["mean"].astype(np.float64), pm["variance"].astype(np.float64)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_predict_is_the_members_mixture():
    ens, state, _ = trained()
    x = X[:13]  # not a multiple of the data axis: padded and trimmed
    mu, var = _members(ens, state, x)
    assert mu.shape == var.shape == (M, 13, 1)
    out = me.distributed.fetch(ens.predict(state, x))
    mean = mu.mean(0)
    np.testing.assert_allclose(out["mean"], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["variance"], (var + mu**2).mean(0) - mean**2, rtol=1e-4)
    np.testing.assert_allclose(out["aleatoric"], var.mean(0), rtol=1e-5)
    np.testing.assert_allclose(out["epistemic"], mu.var(0), rtol=1e-4, atol=1e-7)


def _mixture_cdf(mu, sd, q):
    return stats.norm.cdf((q - mu) / sd).mean()


def reference_scores(mu, var, y):
    """The proper scores of the uniform Gaussian mixture by numpy/scipy, example by example."""
    sd = np.sqrt(var)
    log_p = special.logsumexp(stats.norm.logpdf(y, mu, sd), axis=0) - np.log(len(mu))
    mean = mu.mean(0)
    out = {"nll": -log_p.mean(), "rmse": np.sqrt(((mean - y) ** 2).mean())}
    out["mae"] = np.abs(mean - y).mean()
    crps, pit = [], []
    for j in range(y.shape[0]):
        m, s, t = mu[:, j, 0], sd[:, j, 0], y[j, 0]
        lo, hi = (m - 12 * s).min(), (m + 12 * s).max()
        below = integrate.quad(lambda z, m=m, s=s: _mixture_cdf(m, s, z) ** 2, lo, t, limit=200)
        above = integrate.quad(
            lambda z, m=m, s=s: (1 - _mixture_cdf(m, s, z)) ** 2, t, hi, limit=200
        )
        crps.append(below[0] + above[0])  # CRPS = integral of (F(z) - 1[z >= y])^2
        pit.append(_mixture_cdf(m, s, t))
    out["crps"] = np.mean(crps)
    for c in (0.5, 0.9, 0.95):
        inside, width = [], []
        for j in range(y.shape[0]):
            m, s = mu[:, j, 0], sd[:, j, 0]
            q = lambda p, m=m, s=s: optimize.brentq(
                lambda z: _mixture_cdf(m, s, z) - p, (m - 12 * s).min(), (m + 12 * s).max()
            )
            a, b = q((1 - c) / 2), q((1 + c) / 2)
            inside.append(a <= y[j, 0] <= b)
            width.append(b - a)
        out[f"coverage_{round(100 * c)}"] = np.mean(inside)
        out[f"width_{round(100 * c)}"] = np.mean(width)
    levels = np.arange(1, 20) / 20
    observed = (np.asarray(pit)[:, None] <= levels).mean(0)
    out["quantile_calibration_error"] = np.mean((levels - observed) ** 2)  # Kuleshov et al.
    return out


@pytest.mark.slow  # among the heaviest default tests, measured
def test_evaluate_streams_the_proper_scores_of_the_mixture():
    ens, state, _ = trained()
    x, y = _data(27, seed=1)  # 27 rows in batches of 10: padding and masking
    got = ens.evaluate(state, x, y[:, 0], batch_size=10)
    mu, var = _members(ens, state, x)
    want = reference_scores(mu, var, y.astype(np.float64))
    assert got["count"] == 27
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=2e-4, atol=2e-5, err_msg=k)


@pytest.mark.slow
def test_evaluate_is_the_same_on_every_mesh():
    scores = []
    for shape, backend in [((4, 2), "shard_map"), ((8, 1), "shard_map"), ((1, 8), "pmap")]:
        ens, state, _ = trained(shape, backend)
        scores.append(ens.evaluate(state, X, Y, batch_size=16))
    for s in scores[1:]:
        for k, v in scores[0].items():
            np.testing.assert_allclose(s[k], v, rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_two_targets_and_target_units():
    mesh = me.make_mesh(4, 2)
    x, y = _data(16, targets=2)
    shift, scale = (10.0, -3.0), (2.0, 0.5)
    ens = _ens(mesh, targets=2)
    units = _ens(mesh, targets=2, target_shift=shift, target_scale=scale)
    state = ens.init(jax.random.key(1), x[:1])
    a = me.distributed.fetch(ens.predict(state, x))
    b = me.distributed.fetch(units.predict(state, x))
    assert a["mean"].shape == (16, 2)
    np.testing.assert_allclose(b["mean"], np.asarray(shift) + np.asarray(scale) * a["mean"], 1e-5)
    np.testing.assert_allclose(b["variance"], np.asarray(scale) ** 2 * a["variance"], 1e-5)


# ------------------------------------------------------------------ bad input
def _with(y: np.ndarray, at: tuple[int, ...], value: float) -> np.ndarray:
    y = y.copy()
    y[at] = value
    return y


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda e, s: e.train_step(s, X, Y.astype(np.int32)), r"dtype int32; give float"),
        (lambda e, s: e.train_step(s, X, np.zeros((32, 3), np.float32)), r"do not end in 1 "),
        (lambda e, s: e.train_step(s, X[:31], Y[:31]), r"multiple of the mesh's data axis"),
        (lambda e, s: e.train_step(s, X[:8], Y), r"differ in length"),
        (
            lambda e, s: e.evaluate(s, X[:4], Y),
            r"inputs of shape \(4, 3\) and targets of shape \(32, 1\): give one target per",
        ),
        (lambda e, s: e.predict(s, X, temperature=1.5), r"temperature and logits are for cl"),
        (lambda e, s: e.predict_members(s, X, logits=True), r"fit_variance_scale instead"),
        (lambda e, s: e.train_step(s, X, _with(Y, (3, 0), np.nan)), r"hold nan at index \(3, 0\)"),
        (lambda e, s: e.evaluate(s, X, _with(Y, (5, 0), np.inf)), r"hold inf at index \(5, 0\);"),
    ],
)
def test_bad_targets_raise_one_line(call, match):
    ens = _ens(me.make_mesh(4, 2))
    state = ens.init(jax.random.key(0), X[:1])
    with pytest.raises(ValueError, match=match):
        call(ens, state)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"targets": 0}, r"targets=0 must be a positive integer"),
        ({"targets": 1, "min_variance": 0.0}, r"min_variance=0.0 must be a positive"),
        ({"targets": 2, "target_scale": (1.0, -1.0)}, r"target_scale=.* 2 finite values > 0"),
    ],
)
def test_bad_task_raises(kw, match):
    with pytest.raises(ValueError, match=match):
        me.tasks.Regression(**kw)


# ------------------------------------------------------------------ the 1-D toy
TOY_ENSEMBLES = 5


def toy_ensembles(shared_init: bool = False, steps: int = 300) -> dict[str, np.ndarray]:
    """Five 8-member ensembles of ``MLP((128,))`` (the CLI's) on the paper's toy (data seed 0).

    They train as one ``5 * M``-member Ensemble: the members see the same full batch and
    never interact, so each block of ``M`` members is an ensemble of its own, with its own
    initialisations. ``shared_init`` starts every member of a block from the block's first
    member. Returns each ensemble's mixture sd and members' spread (the sd of their means)
    at ``x = -6, 0, 6``: ``{"sd": [5, 3], "spread": [5, 3]}``.
    """
    data = me.data.toy1d(seed=0)
    st = me.data.standardizer(data)
    task = me.tasks.Regression(1, target_shift=st["y_mean"], target_scale=st["y_std"])
    xm, xs = np.float32(st["x_mean"]), np.float32(st["x_std"])
    ens = me.Ensemble(
        me.models.MLP((128,), num_classes=2), optax.adam(0.02), TOY_ENSEMBLES * M,
        me.make_mesh(8, 1), task=task, input_transform=lambda x: (x - xm[None]) / xs[None],
    )  # fmt: skip
    state = ens.init(jax.random.key(0), data.x_train[:1])
    if shared_init:
        first = lambda v, o: jax.device_put(np.repeat(np.asarray(v)[::M], M, 0), o.sharding)
        state = state.replace(params=jax.tree.map(first, state.params, state.params))
    for _ in range(steps):
        state, _ = ens.train_step(state, data.x_train, data.y_train)
    x = np.array([[-6.0], [0.0], [6.0]], np.float32)
    out = me.distributed.fetch(ens.predict_members(state, x))
    mu, var = (out[k][..., 0].reshape(TOY_ENSEMBLES, M, 3) for k in ("mean", "variance"))
    mean = mu.mean(1)  # each block's uniform mixture of its members' Gaussians
    sd = np.sqrt((var + mu**2).mean(1) - mean**2)
    return {"sd": sd, "spread": mu.std(1)}


def _spread_grows_away_from_the_data(out):
    """The figure's point, as medians over the five ensembles (one ensemble's ratio
    depends on its initialisations: 7.8x-10x for these five at XLA's default flags):
    the mixture's sd at x = +/-6 is at least 3x its value at x = 0, and the members'
    spread there, which shared initialisations remove, exceeds that whole sd at 0 (a
    median of 2.0x-8.6x over 32 such sets of five, at two compile settings)."""
    sd, spread = out["sd"], out["spread"]
    wide = np.minimum(spread[:, 0], spread[:, 2]) / sd[:, 1]
    assert np.median(wide) > 1, f"members' spread at |x| = 6 over the sd at x = 0: {wide}"
    ratio = np.minimum(sd[:, 0], sd[:, 2]) / sd[:, 1]
    assert np.median(ratio) >= 3, f"mixture sd at |x| = 6 over x = 0, per ensemble: {ratio}"


TOY_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
from meshensemble.testing import set_fake_cpu_devices
set_fake_cpu_devices(8)
import numpy as np
import test_regression as t
for shared in (False, True):
    np.savez(f"{sys.argv[2]}/toy_{shared}.npz", **t.toy_ensembles(shared_init=shared))
"""


@pytest.fixture(scope="module")
def toy_outputs(tmp_path_factory) -> dict[bool, dict[str, np.ndarray]]:
    """``toy_ensembles()`` with and without shared initialisations, computed in a fresh
    process compiled as a user's run is (the user's ``XLA_FLAGS``, not the default set's
    fast-compile flags): 300 Adam steps amplify float rounding."""
    import subprocess
    import sys

    from conftest import user_xla_env

    out = tmp_path_factory.mktemp("toy")
    here = str(pathlib.Path(__file__).parent)
    cmd = [sys.executable, "-c", TOY_SCRIPT, here, str(out)]
    done = subprocess.run(cmd, env=user_xla_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {shared: dict(np.load(out / f"toy_{shared}.npz")) for shared in (False, True)}


@pytest.mark.slow  # among the heaviest default tests, measured
def test_toy_mixture_sd_at_6_is_3x_its_value_at_0(toy_outputs):
    _spread_grows_away_from_the_data(toy_outputs[False])


@pytest.mark.slow  # among the heaviest default tests, measured
def test_toy_target_fails_when_members_share_their_initialisation(toy_outputs):
    with pytest.raises(AssertionError, match="members' spread"):
        _spread_grows_away_from_the_data(toy_outputs[True])
    # Each block's members then agree everywhere up to float rounding.
    assert toy_outputs[True]["spread"].max() < 1e-3 * toy_outputs[False]["spread"].min()


# ------------------------------------------------------------------ calibration
def test_fit_variance_scale_minimises_the_nll():
    rng = np.random.default_rng(0)
    mean, var = rng.normal(size=200), rng.uniform(0.5, 2.0, 200)
    y = mean + 1.7 * np.sqrt(var) * rng.normal(size=200)
    s = me.calibration.fit_variance_scale(mean, var, y)
    nll = lambda c: -stats.norm.logpdf(y, mean, np.sqrt(c * var)).sum()
    best = optimize.minimize_scalar(nll, bounds=(0.1, 20), method="bounded").x
    np.testing.assert_allclose(s, best, rtol=1e-4)
    assert 2.2 < s < 3.6  # about 1.7^2


def test_conformal_rank_is_exact_where_float_rounds_up():
    """(n + 1)(1 - alpha) = 10 * 0.3 is 3.0000000000000004 in floats: the 3rd smallest score,
    not the 4th; a numpy float alpha is a number like any other."""
    from meshensemble.calibration._checks import conformal_rank, smallest_alpha

    scores = np.arange(1.0, 10.0)  # |y - 0| / 1 for 9 calibration targets
    q = me.calibration.conformal_interval_quantile(np.zeros(9), np.ones(9), scores, 0.7)
    assert q == 3.0
    assert me.calibration.conformal_interval_quantile(
        np.zeros(9), np.ones(9), scores, np.float32(0.5)
    ) == 5.0  # fmt: skip
    for n in range(1, 3000):  # the hint an error gives is accepted, and close to 1/(n + 1)
        alpha = float(smallest_alpha(n))
        assert conformal_rank(n, alpha) <= n < conformal_rank(n, alpha * (1 - 1e-2)), n


def test_conformal_intervals_cover_over_20_random_splits():
    rng = np.random.default_rng(0)
    n, alpha = 1500, 0.1
    x = rng.uniform(-3, 3, n)
    y = np.sin(x) + (0.2 + 0.3 * np.abs(x)) * rng.standard_t(4, n)
    mean, std = np.sin(x) + 0.1, 0.3 * np.ones(n)  # biased, misspecified scale
    covered = []
    for split in range(20):
        order = np.random.default_rng(split).permutation(n)
        cal, test = order[:300], order[300:]
        q = me.calibration.conformal_interval_quantile(mean[cal], std[cal], y[cal], alpha)
        covered.append(np.mean(np.abs(y[test] - mean[test]) <= q * std[test]))
    # The guarantee is on average over splits: the mean over 20, within two standard errors
    se = np.std(covered) / np.sqrt(len(covered))
    assert np.mean(covered) >= 1 - alpha - 2 * se, (np.mean(covered), se)
    assert np.mean(covered) < 1 - alpha + 0.03  # and not trivially wide
    k = int(np.ceil(301 * 0.9))  # the finite-sample rank
    scores = np.sort(np.abs(y[cal] - mean[cal]) / std[cal])
    assert q == scores[k - 1]
    assert me.calibration.conformal_interval_quantile(mean[:5], std[:5], y[:5], 0.1) == np.inf


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda c: c.fit_variance_scale([0.0, 1.0], [1.0], [0.0, 1.0]), r"variance has shape"),
        (lambda c: c.fit_variance_scale([0.0], [-1.0], [0.0]), r"variance has values <= 0"),
        (lambda c: c.fit_variance_scale([], [], []), r"mean is empty"),
        (lambda c: c.conformal_interval_quantile([0.0], [1.0], [0.0], 1.5), r"alpha=1.5 must"),
        (lambda c: c.conformal_interval_quantile([0.0], [1.0], [np.nan], 0.1), r"y holds non-"),
    ],
)
def test_regression_calibration_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call(me.calibration)


# ------------------------------------------------------------------ the run and the CLI
def _cfg(workdir, **kw):
    base = dict(task="regression", source="toy1d", members=4, mesh="ensemble=4,data=2",
                optimizer="adam", learning_rate=0.01, epochs=4, batch_size=8,
                compile_cache=False, quiet=True, workdir=str(workdir))  # fmt: skip
    return me.TrainConfig(**(base | kw))


@pytest.mark.slow
@pytest.mark.plots  # the rendered PNGs
def test_regression_run_writes_standardised_outputs_and_resumes_exactly(tmp_path, monkeypatch):
    whole = me.training.train(_cfg(tmp_path / "a"))
    cut = me.training.train(_cfg(tmp_path / "b", max_steps=3))
    assert cut.history[-1]["step"] == 3
    resumed = me.training.train(_cfg(tmp_path / "b"))
    testing.assert_trees_close(resumed.state.params, whole.state.params, rtol=0, atol=0)
    with monkeypatch.context() as m:  # a SIGTERM after step 2: save, stop, resume exactly
        m.setattr(me.training.guards.StopSignal, "requested", lambda self, step: step >= 2)
        stopped = me.training.train(_cfg(tmp_path / "c"))
    assert (
        stopped.preempted and me.training.checkpoint.list_checkpoints(str(tmp_path / "c"))[-1] == 2
    )
    resumed = me.training.train(_cfg(tmp_path / "c"))
    testing.assert_trees_close(resumed.state.params, whole.state.params, rtol=0, atol=0)

    saved = json.loads((tmp_path / "a" / "config.json").read_text())
    shift = saved["resolved"]["task"]["target_shift"]
    np.testing.assert_allclose(shift, whole.dataset.y_train.mean(0), rtol=1e-5)
    assert saved["task"] == "regression" and saved["resolved"]["model"] == "mlp"
    assert (tmp_path / "a" / "regression.png").stat().st_size > 10_000
    last = whole.history[-1]
    assert {"test_nll", "test_crps", "test_coverage_90", "test_width_90"} <= set(last)
    # predictions are in the data's units: the mixture mean is near the targets' scale
    out = me.distributed.fetch(whole.ensemble.predict(whole.state, whole.dataset.x_test))
    assert abs(out["mean"].mean() - whole.dataset.y_test.mean()) < whole.dataset.y_test.std()


@pytest.mark.slow  # among the heaviest default tests, measured
def test_regression_cli_on_an_npz_with_a_validation_split(tmp_path, capsys):
    from meshensemble import cli

    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5]) + 100).astype(np.float32)  # targets [N]
    path = tmp_path / "d.npz"
    np.savez(path, x_train=x[:32], y_train=y[:32], x_test=x[32:], y_test=y[32:])
    argv = ["train", "--task", "regression", "--source", "npz", "--data-file", str(path),
            "--members", "2", "--mesh", "ensemble=2,data=1", "--epochs", "2", "--batch-size",
            "8", "--validation", "8", "--no-compile-cache", "--shuffle", "per-member",
            "--workdir"]  # fmt: skip
    argv.append(str(tmp_path / "w"))
    capsys.readouterr()
    assert cli.main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]  # 8 rows: too few for 90% intervals
    assert last.startswith("note: intervals and variances uncalibrated, ") and last.endswith(
        f"then: meshensemble evaluate --workdir {tmp_path / 'w'} --calibrate --alpha A"
    ), last
    assert "too small for the run's 8 validation scores" in last, last
    assert not (tmp_path / "w" / "evaluation.json").exists()
    record = json.loads((tmp_path / "w" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 6 and "val_nll" in record and "test_rmse" in record
    assert not (tmp_path / "w" / "regression.png").exists()  # 3 features: no 1-D figure
    bad = ["train", "--source", "toy1d", "--workdir", str(tmp_path / "c")]
    assert cli.main(bad) == 2
    assert "not class labels; add --task regression" in capsys.readouterr().err
    np.savez(tmp_path / "e.npz", x_train=x, y_train=y)
    assert cli.main([*argv[:6], str(tmp_path / "e.npz"), "--workdir", str(tmp_path / "e")]) == 2
    assert "has no x_test, y_test" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def test_per_member_batches_of_the_same_rows_equal_a_shared_batch():
    ens, ref, _ = trained((4, 2))
    other = _ens(me.make_mesh(4, 2))
    state = other.init(jax.random.key(0), X[:1])
    for _ in range(3):
        state, metrics = other.train_step(state, np.stack([X] * M), np.stack([Y] * M))
    testing.assert_trees_close(state.params, ref.params, rtol=1e-5, atol=1e-5)
    assert np.isnan(metrics["ensemble_nll"])  # members saw different batches: no mixture


@pytest.mark.slow
def test_fsdp_regression_equals_whole_members():
    _, ref, _ = trained((4, 2))
    ens = me.Ensemble(
        Net(), TX, M, me.make_mesh(4, 2), task=me.tasks.Regression(1), shard_members=True
    )
    state = ens.init(jax.random.key(0), X[:1])
    for _ in range(3):
        state, _ = ens.train_step(state, X, Y)
    testing.assert_trees_close(state.params, ref.params, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_two_processes_train_the_same_regression_ensemble_as_one(tmp_path):
    from meshensemble.runtime.distributed import launch_local

    argv = ["train", "--task", "regression", "--source", "toy1d", "--members", "8",
            "--mesh", "ensemble=4,data=2", "--optimizer", "adam", "--learning-rate", "0.01",
            "--batch-size", "8", "--max-steps", "3", "--quiet", "--no-compile-cache",
            "--validation", "0",  # every row, as _cfg's TrainConfig
            "--workdir", str(tmp_path / "multi")]  # fmt: skip
    assert launch_local(argv, 2, 4, timeout=400, prefix_output=False) == 0
    one = me.training.train(
        _cfg(tmp_path / "one", members=8, batch_size=8, max_steps=3, mesh="ensemble=4,data=2")
    )
    state, _, step = me.restore_checkpoint(str(tmp_path / "multi"), one.ensemble, X[:1, :1])
    assert step == 3
    testing.assert_trees_close(state.params, one.state.params, rtol=1e-5, atol=1e-5)
    multi = (tmp_path / "multi" / "metrics.jsonl").read_text().splitlines()[-1]
    for key, value in json.loads(multi).items():  # train_curve: a dict of lists
        pairs = zip(jax.tree.leaves(value), jax.tree.leaves(one.history[-1][key]), strict=True)
        for a, b in pairs:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=key)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_predict_members_drops_the_padding_when_members_equal_examples():
    ens = me.Ensemble(Net(), TX, 3, me.make_mesh(1, 2), task=me.tasks.Regression(1))
    state = ens.init(jax.random.key(0), X[:1])
    out = ens.predict_members(state, X[:3])  # 3 rows padded to 4 over data=2
    assert out["mean"].shape == out["variance"].shape == (3, 3, 1)
    assert ens.predict(state, X[:3])["epistemic"].shape == (3, 1)


@pytest.mark.slow
def test_the_diabetes_comparison_runs(capsys):
    pytest.importorskip("sklearn")
    import importlib.util

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "regression" / "compare.py"
    spec = importlib.util.spec_from_file_location("regression_compare", path)
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    rows = compare.main(["--steps", "20"])
    assert "| BayesianRidge |" in capsys.readouterr().out
    assert set(rows["ensemble (8 MLP members, mixture)"]) >= {"nll", "crps", "coverage_90"}


def test_the_run_plan_of_a_small_table_is_pure():
    """Regression's default batch (None): the whole training split up to 128 rows; the
    generic plan (the same for every task) refuses a batch the data axis does not divide."""
    from meshensemble.training.plan import plan_training

    cfg = me.TrainConfig(task="regression", batch_size=None, epochs=40, mesh="ensemble=2,data=4")
    plan = plan_training(cfg, 16, 8, "cpu")
    assert (plan.batch, plan.steps_per_epoch, plan.total_steps, plan.eval_every) == (16, 1, 40, 2)
    assert plan_training(dataclasses.replace(cfg, mesh=""), 300, 8, "cpu").batch == 128
    with pytest.raises(
        ValueError,
        match=r"the batch of all 3 training examples \(batch_size=None\) "
        r"is not divisible by the mesh's data axis \(4\)",
    ):
        plan_training(cfg, 3, 8, "cpu")
    with pytest.raises(ValueError, match=r"batch_size=30 .* axis \(4\); use a --batch-size"):
        plan_training(dataclasses.replace(cfg, batch_size=30), 300, 8, "cpu")


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"source": "sample"}, r"mnist has class labels \(4000,\) .*drop --task regression"),
        ({"task": "classification", "source": "diabetes"}, r"not class labels; add --task regr"),
        ({"model": "resnet"}, r"model 'resnet' takes images \[H, W, C\]; .*: use --model mlp"),
        ({"augment": "shift"}, r"augment='shift' shifts or crops images .* at none"),
        ({"label_smoothing": 0.1}, r"label_smoothing=0.1 is for class labels"),
        ({"validation": 19}, r"1 training row\(s\) after the validation split"),
    ],
)
def test_regression_run_refusals(kw, match, tmp_path):
    """Options and data a regression run cannot take: one line, nothing written."""
    cfg = me.TrainConfig(**({"task": "regression", "source": "toy1d", "batch_size": None,
                             "workdir": str(tmp_path / "w")} | kw))  # fmt: skip
    with pytest.raises((ValueError, me.DataError), match=match) as err:
        me.training.train(cfg)
    assert "\n" not in str(err.value) and not (tmp_path / "w").exists()


def test_constant_targets_are_refused_in_one_line(tmp_path):
    """A table whose targets never vary trained with exit 0 and no word (issue 37)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 2)).astype(np.float32)
    path = tmp_path / "flat.npz"
    np.savez(path, x_train=x[:32], y_train=np.full(32, 3.0, np.float32), x_test=x[32:],
             y_test=np.full(8, 3.0, np.float32))  # fmt: skip
    cfg = me.TrainConfig(task="regression", source="npz", data_file=str(path), batch_size=None,
                         workdir=str(tmp_path / "w"))  # fmt: skip
    with pytest.raises(
        ValueError, match=r"y_train \(32, 1\) is constant in target column\(s\) \[0\]"
    ):
        me.training.train(cfg)
    assert not (tmp_path / "w").exists()


@pytest.mark.slow  # among the heaviest default tests, measured
def test_metrics_from_member_arrays_equal_the_streamed_evaluation():
    ens, state, _ = trained()
    x, y = _data(27, seed=1)
    mu, var = _members(ens, state, x)
    got = me.metrics.regression.scores(mu, var, y[:, 0])
    want = ens.evaluate(state, x, y, batch_size=10)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=2e-4, atol=2e-5, err_msg=k)
    with pytest.raises(ValueError, match=r"must be \[members, N, T\]"):
        me.metrics.regression.mixture_nll(mu[0], var[0], y)


def test_regression_defaults_apply_to_flags_not_given_and_given_flags_win(monkeypatch, tmp_path):
    # In a fresh folder: in the repository, after the README's main job, the default
    # workdir (runs/mnist) holds a run whose saved settings a new run there inherits.
    monkeypatch.chdir(tmp_path)
    from meshensemble.cli import build_parser
    from meshensemble.cli.train import config_from_args

    def cfg(*flags):
        return config_from_args(build_parser().parse_args(["train", *flags]))

    regression = cfg("--task", "regression", "--source", "toy1d")
    assert (regression.optimizer, regression.learning_rate, regression.epochs) == (
        "adam",
        0.01,
        100,
    )
    assert regression.validation == 0.2  # a fifth held out: the run calibrates itself
    given = cfg("--task", "regression", "--learning-rate", "0.003", "--optimizer", "sgd")
    assert (given.optimizer, given.learning_rate, given.epochs) == ("sgd", 0.003, 100)
    assert cfg("--task", "regression", "--epochs", "7").epochs == 7
    assert cfg("--task", "regression", "--validation", "0").validation == 0  # a given 0 wins
    plain = cfg()  # classification keeps its defaults
    assert (plain.optimizer, plain.learning_rate, plain.epochs) == ("sgd", 0.1, 10)
    assert plain.validation == 0


@pytest.mark.parametrize("source", ["toy1d", pytest.param("diabetes", marks=pytest.mark.slow)])
def test_regression_with_no_optimizer_flags_beats_predicting_the_mean(tmp_path, source, capsys):
    """SGD 0.1 for 10 epochs (the classification defaults) gave the toy a test RMSE of
    ~54,000; the regression defaults must fit both datasets clearly better than the mean.
    The defaults hold out a fifth of the training rows: diabetes calibrates itself on its
    71, the toy's 4 are too few for 90% intervals and its last line says so and how to fix
    it. (The toy with ``--no-checkpoint``: the 100 epochs' saves were a third of the
    test's time, and the split's size is said first.)"""
    from meshensemble import cli

    if source == "diabetes":
        pytest.importorskip("sklearn")
    workdir = tmp_path / source
    argv = ["train", "--task", "regression", "--source", source, "--members", "4"]
    capsys.readouterr()
    quick = ["--no-checkpoint"] if source == "toy1d" else []
    assert cli.main([*argv, "--workdir", str(workdir), "--quiet", *quick]) == 0
    out = capsys.readouterr().out.strip()  # the run's last line(s), even with --quiet
    if source == "toy1d":
        assert out.splitlines()[-1] == (
            "note: intervals and variances uncalibrated, alpha=0.1 is too small for the run's "
            "4 validation scores: split conformal needs n >= 1/alpha - 1 = 9; use --alpha >= "
            "0.2 or train with --validation 9 or more; then: meshensemble evaluate --workdir "
            f"{workdir} --calibrate --alpha A"
        )
    else:
        assert "calibrated on 71 validation scores" in out, out
        assert (workdir / "evaluation.json").exists()
    saved = json.loads((workdir / "config.json").read_text())
    assert (saved["optimizer"], saved["learning_rate"], saved["epochs"]) == ("adam", 0.01, 100)
    assert saved["validation"] == 0.2
    data = me.data.toy1d(0) if source == "toy1d" else me.data.diabetes(0)
    mean_rmse = float(np.sqrt(np.mean((data.y_test - data.y_train.mean()) ** 2)))
    record = json.loads((workdir / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] > 0 and record["test_rmse"] < 0.8 * mean_rmse, (record, mean_rmse)


def test_a_regression_run_failing_before_its_first_checkpoint_leaves_nothing(tmp_path, monkeypatch):
    from meshensemble import cli

    def boom(self, *args, **kwargs):
        raise RuntimeError("boom in the first step")

    monkeypatch.setattr(me.training.Feeder, "run", boom)
    workdir = tmp_path / "r"
    argv = ["train", "--task", "regression", "--source", "toy1d", "--members", "2"]
    assert cli.main([*argv, "--mesh", "ensemble=2,data=1", "--workdir", str(workdir)]) == 1
    assert not workdir.exists()


@pytest.mark.parametrize("width", [1, 10])
def test_a_model_of_the_wrong_output_width_is_refused_in_one_line(width):
    """Regression(targets=1) needs 2 outputs (mean, scale); 10 once gave [N, 5] silently."""
    mesh = me.make_mesh(ensemble=2, data=1)
    ens = me.Ensemble(
        me.models.MLP((8,), num_classes=width), optax.adam(1e-2), 2, mesh,
        task=me.tasks.Regression(targets=1),
    )  # fmt: skip
    x = np.zeros((4, 3), np.float32)
    state = ens.init(jax.random.key(0), x[:1])
    with pytest.raises(ValueError, match=r"needs 2 \* targets = 2") as err:
        ens.predict(state, x)
    assert "\n" not in str(err.value).strip()
    with pytest.raises(ValueError, match=r"outputs 10 values|outputs 1 values"):
        ens.train_step(state, x, np.zeros(4, np.float32))


def test_a_run_without_a_checkpoint_says_it_has_no_calibration():
    """The reason a finished run with a validation split is left uncalibrated, and the fix."""
    from meshensemble.training.calibrate import calibrate_finished_run

    cfg = me.TrainConfig(task="regression", validation=20, workdir="w")
    ens = types.SimpleNamespace(task=me.tasks.Regression())
    data = types.SimpleNamespace(validation=(np.zeros((20, 1)), np.zeros((20, 1))))
    line = calibrate_finished_run(cfg, ens, None, None, data, {}, print)
    assert line == (
        "note: intervals and variances uncalibrated, no checkpoint to apply a calibration to: "
        "train without --no-checkpoint"
    )
    ens.task = me.tasks.Classification()  # a task that fits nothing at the end says nothing
    assert calibrate_finished_run(cfg, ens, None, None, data, {}, print) == ""
