"""meshensemble.calibration against independent references (loops, scipy) and coverage statistics.

The coverage tests sample labels from known probabilities, so calibration and test examples
are exchangeable and split conformal guarantees ``1 - alpha <= E[coverage] <= 1 - alpha +
1 / (n + 1)`` (continuous scores). Each tolerance is 4 standard deviations of the mean
coverage over the trials: a trial's coverage varies by the calibration draw (the coverage
given the threshold is Beta(k, n + 1 - k) distributed, variance ``a (1 - a) / (n + 2)``
for ``a = k / (n + 1)``) and by the ``n_test`` test draws (binomial, ``a (1 - a) / n_test``).
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import need_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from scipy.optimize import minimize_scalar
from scipy.special import logsumexp

from meshensemble import calibration as cal

C = 10


# --------------------------------------------------------------------------- references


def ref_nll(logits: np.ndarray, labels: np.ndarray, t: float) -> float:
    z = logits.astype(np.float64) / t
    return float(np.mean(logsumexp(z, axis=1) - z[np.arange(len(labels)), labels]))


def ref_temperature(logits: np.ndarray, labels: np.ndarray) -> float:
    """argmin_T NLL(softmax(z / T)) by scipy's bounded Brent search on log T, in float64."""
    res = minimize_scalar(
        lambda s: ref_nll(logits, labels, math.exp(s)),
        bounds=(math.log(1e-3), math.log(1e3)),
        method="bounded",
        options={"xatol": 1e-10},
    )
    return math.exp(res.x)


def ref_softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def ref_scores(p: np.ndarray, method: str, k_reg: int = 5, lam: float = 0.01) -> np.ndarray:
    """s(x, c) for every example and class, by loops."""
    n, c = p.shape
    out = np.zeros((n, c))
    for i in range(n):
        if method == "thr":
            out[i] = [1.0 - float(p[i, j]) for j in range(c)]
            continue
        order = sorted(range(c), key=lambda j: (-float(p[i, j]), j))
        cum = 0.0
        for rank, j in enumerate(order, start=1):
            cum += float(p[i, j])
            out[i, j] = cum + (lam * max(0, rank - k_reg) if method == "raps" else 0.0)
    return out


def ref_quantile(p: np.ndarray, y: np.ndarray, alpha: float, method: str, **kw) -> float:
    n = len(y)
    s = sorted(ref_scores(p, method, **kw)[np.arange(n), y])
    k = math.ceil(round((n + 1) * (1 - alpha), 9))
    return s[k - 1]


def sample(rng: np.random.Generator, n: int, sharpness: float = 1.0):
    """Known probabilities softmax(sharpness * z) and labels drawn from them."""
    p = ref_softmax(sharpness * rng.normal(0, 1.5, size=(n, C)))
    cum = p.cumsum(axis=1)
    y = (rng.random((n, 1)) > cum).sum(axis=1)
    return p, np.minimum(y, C - 1)


@pytest.fixture(scope="module")
def logit_data():
    """Labels drawn from softmax(z); the model reports 3 z (overconfident) and z / 2."""
    rng = np.random.default_rng(0)
    z = rng.normal(0, 2, size=(4000, C))
    p = ref_softmax(z)
    y = np.minimum((rng.random((4000, 1)) > p.cumsum(1)).sum(1), C - 1)
    return z, y


# --------------------------------------------------------------------------- temperature


@pytest.mark.parametrize("scale", [3.0, 0.5, 1.0])
def test_fit_temperature_matches_scipy(logit_data, scale):
    z, y = logit_data
    logits = (scale * z).astype(np.float32)
    t = cal.fit_temperature(logits, y)
    assert isinstance(t, float)
    assert t == pytest.approx(ref_temperature(logits, y), rel=1e-4)
    # the labels were drawn from softmax(z): the fitted temperature undoes the scale
    assert t == pytest.approx(scale, rel=0.05)
    assert ref_nll(logits, y, t) <= min(ref_nll(logits, y, t * f) for f in (0.99, 1.01))


@pytest.mark.slow  # among the heaviest default tests, measured
def test_fit_temperature_per_member_jax_and_sharded_inputs(logit_data):
    need_devices(8)
    z, y = logit_data
    members = np.stack([3.0 * z, 0.5 * z, z + 1.0]).astype(np.float32)
    want = [ref_temperature(m, y) for m in members]
    ts = cal.fit_temperature(members, y, per_member=True)
    assert isinstance(ts, np.ndarray) and ts.shape == (3,)
    np.testing.assert_allclose(ts, want, rtol=1e-4)
    assert cal.fit_temperature(jnp.asarray(members[0]), jnp.asarray(y)) == pytest.approx(
        want[0], rel=1e-4
    )
    # global arrays sharded over 8 devices along N: the same temperatures
    mesh = jax.make_mesh((8,), ("x",))
    sharded = jax.device_put(members, NamedSharding(mesh, P(None, "x")))
    labels = jax.device_put(y, NamedSharding(mesh, P("x")))
    assert len(sharded.sharding.device_set) == 8
    np.testing.assert_allclose(
        cal.fit_temperature(sharded, labels, per_member=True), want, rtol=1e-4
    )
    one = jax.device_put(members[1], NamedSharding(mesh, P("x")))
    assert cal.fit_temperature(one, labels) == pytest.approx(want[1], rel=1e-4)


def test_fit_temperature_on_pooled_ensemble_logits():
    """Pool, then calibrate: T of log(mean member probability), as defined, by scipy."""
    rng = np.random.default_rng(1)
    member_probs = ref_softmax(rng.normal(0, 3, size=(4, 500, C)))
    pooled = np.log(np.maximum(member_probs.mean(0), 1e-12))
    truth = ref_softmax(pooled / 1.5)  # the labels' own probabilities: T near 1.5
    y = np.minimum((rng.random((500, 1)) > truth.cumsum(1)).sum(1), C - 1)
    np.testing.assert_allclose(cal.ensemble_logits(member_probs), pooled, rtol=1e-5, atol=1e-5)
    t = cal.fit_temperature(cal.ensemble_logits(member_probs), y)
    assert t == pytest.approx(ref_temperature(pooled, y), rel=1e-4)
    np.testing.assert_allclose(
        cal.apply_temperature_to_probs(member_probs.mean(0), t),
        ref_softmax(pooled / t),
        rtol=1e-4,
        atol=1e-6,
    )


def test_fit_temperature_refuses_a_bound_or_returns_it_with_a_warning():
    y = np.arange(40) % C
    separable = 5.0 * np.eye(C)[y]  # always right with a margin: sharper is always better
    with pytest.raises(ValueError, match="lower temperature bound 0.001.*hold out more") as e:
        cal.fit_temperature(separable, y)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="upper temperature bound 100.*chance"):
        cal.fit_temperature(-separable, y, bounds=(0.1, 100.0))
    with pytest.warns(UserWarning, match="lower temperature bound"):
        assert cal.fit_temperature(separable, y, at_bound="warn") == 1e-3
    with pytest.warns(UserWarning, match="upper temperature bound 100"):
        assert cal.fit_temperature(-separable, y, bounds=(0.1, 100.0), at_bound="warn") == 100.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cal.fit_temperature(np.random.default_rng(0).normal(size=(40, C)), y)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (lambda z, y: (z[None], y), "2-D"),
        (lambda z, y: (z, y[:-1]), "length N"),
        (lambda z, y: (z, y.astype(float)), "integer"),
        (lambda z, y: (z, np.r_[y[:-1], C]), r"\[0, 10\)"),
        (lambda z, y: (np.where(z > 2, np.nan, z), y), "NaN or inf"),
        (lambda z, y: (z[:0], y[:0]), "no example"),
    ],
)
def test_fit_temperature_rejects_bad_input(logit_data, args, match):
    z, y = logit_data
    with pytest.raises(ValueError, match=match) as info:
        cal.fit_temperature(*args(z[:50], y[:50]))
    assert "\n" not in str(info.value)


def test_fit_temperature_rejects_bad_bounds(logit_data):
    z, y = logit_data
    for bounds in [(0.0, 1.0), (2.0, 1.0), (1.0, math.inf)]:
        with pytest.raises(ValueError, match="bounds"):
            cal.fit_temperature(z[:50], y[:50], bounds=bounds)
    with pytest.raises(ValueError, match="3-D"):
        cal.fit_temperature(z[:50], y[:50], per_member=True)


def test_apply_temperature_matches_reference():
    rng = np.random.default_rng(2)
    z = rng.normal(0, 2, size=(3, 20, C))
    np.testing.assert_allclose(cal.apply_temperature(z[0], 2.5), ref_softmax(z[0] / 2.5), 1e-5)
    ts = np.array([0.5, 1.0, 4.0])
    want = np.stack([ref_softmax(z[m] / ts[m]) for m in range(3)])
    np.testing.assert_allclose(cal.apply_temperature(z, ts), want, rtol=1e-5, atol=1e-7)
    p = ref_softmax(z[0])
    np.testing.assert_allclose(cal.apply_temperature_to_probs(p, 1.0), p, rtol=1e-5)
    sharp = p**2 / (p**2).sum(-1, keepdims=True)  # T = 1/2: p^(1/T) renormalised
    np.testing.assert_allclose(cal.apply_temperature_to_probs(p, 0.5), sharp, rtol=1e-4)
    with pytest.raises(ValueError, match="temperature"):
        cal.apply_temperature(z, np.ones(2))
    with pytest.raises(ValueError, match="> 0"):
        cal.apply_temperature(z[0], -1.0)


# --------------------------------------------------------------------------- conformal


@pytest.mark.parametrize("method", ["thr", "aps", "raps"])
def test_scores_quantile_and_sets_match_reference(method):
    rng = np.random.default_rng(3)
    p, y = sample(rng, 300)
    kw = {"k_reg": 2, "lam": 0.05} if method == "raps" else {}
    np.testing.assert_allclose(
        cal.conformal_scores(p, method, **kw), ref_scores(p, method, **kw), atol=1e-5
    )
    for alpha in (0.05, 0.1, 0.3):
        q = cal.conformal_quantile(p, y, alpha, method, **kw)
        assert isinstance(q, float)
        assert q == pytest.approx(ref_quantile(p, y, alpha, method, **kw), abs=1e-5)
        # the set of a calibration example holds its label iff its score <= q: at least k
        k = math.ceil(round(301 * (1 - alpha), 9))
        hits = cal.coverage(cal.prediction_sets(p, q, method, **kw), y) * 300
        assert k <= round(hits) <= k + 2  # = k unless scores tie at q
    test_p, _ = sample(rng, 200)
    for q in (0.3, 0.8, 0.97):  # fixed thresholds: no example sits on one
        got = np.asarray(cal.prediction_sets(test_p, q, method, **kw))
        assert got.dtype == bool and got.shape == (200, C)
        np.testing.assert_array_equal(got, ref_scores(test_p, method, **kw) <= q)


def test_randomized_aps_lies_between_the_mass_above_and_the_mass_down_to_the_class():
    p, _ = sample(np.random.default_rng(4), 100)
    inclusive = ref_scores(p, "aps")
    exclusive = inclusive - p
    got = np.asarray(cal.conformal_scores(p, "aps", randomized=True, seed=3))
    assert (got >= exclusive - 1e-6).all() and (got <= inclusive + 1e-6).all()
    u = (inclusive - got) / p  # one uniform per example, shared by its classes
    np.testing.assert_allclose(u, u[:, :1].repeat(C, axis=1), atol=1e-3)
    assert 0.3 < u[:, 0].mean() < 0.7 and u[:, 0].std() > 0.2
    again = cal.conformal_scores(p, "aps", randomized=True, seed=3)
    np.testing.assert_array_equal(got, again)  # seeded
    assert not np.array_equal(got, cal.conformal_scores(p, "aps", randomized=True, seed=4))


def test_aps_ties_rank_the_lower_class_first():
    p = np.array([[0.4, 0.2, 0.4]])
    np.testing.assert_allclose(cal.conformal_scores(p, "aps"), [[0.4, 1.0, 0.8]], atol=1e-6)


def _coverages(method: str, n_cal: int, n_test: int, trials: int, alpha: float, **kw):
    rng = np.random.default_rng(11)
    covs, sizes = [], []
    for trial in range(trials):
        p, y = sample(rng, n_cal + n_test)
        q = cal.conformal_quantile(p[:n_cal], y[:n_cal], alpha, method, seed=trial, **kw)
        sets = cal.prediction_sets(p[n_cal:], q, method, seed=10_000 + trial, **kw)
        covs.append(cal.coverage(sets, y[n_cal:]))
        sizes.append(cal.set_size(sets))
    return np.array(covs), np.array(sizes)


def _sd_of_mean(a: float, n_cal: int, n_test: int, trials: int) -> float:
    return math.sqrt(a * (1 - a) / (n_cal + 2) + a * (1 - a) / n_test) / math.sqrt(trials)


@pytest.mark.parametrize(
    ("method", "kw"),
    [("thr", {}), ("aps", {}), ("aps", {"randomized": True}), ("raps", {"k_reg": 1, "lam": 0.1})],
    ids=["thr", "aps", "aps_randomized", "raps"],
)
def test_coverage_is_at_least_one_minus_alpha(method, kw):
    n_cal, n_test, trials, alpha = 500, 500, 60, 0.1
    covs, sizes = _coverages(method, n_cal, n_test, trials, alpha, **kw)
    tol = 4 * _sd_of_mean(1 - alpha, n_cal, n_test, trials)
    assert covs.mean() >= 1 - alpha - tol, covs.mean()
    assert covs.mean() <= 1 - alpha + 1 / (n_cal + 1) + tol, covs.mean()
    assert 1 < sizes.mean() < C


@pytest.mark.parametrize("method", ["thr", "aps"])
def test_finite_sample_correction_with_ten_calibration_examples(method):
    """n = 10, alpha = 0.1: k = ceil(11 * 0.9) = 10, so E[coverage] = 10 / 11 exactly for
    continuous scores; without the (n + 1) correction k = 9 would give 9 / 11."""
    n_cal, n_test, trials, alpha = 10, 200, 300, 0.1
    covs, _ = _coverages(method, n_cal, n_test, trials, alpha)
    a = 10 / 11
    assert covs.mean() == pytest.approx(a, abs=4 * _sd_of_mean(a, n_cal, n_test, trials))


@pytest.mark.parametrize("method", ["thr", "aps", "raps"])
def test_sets_shrink_as_probabilities_sharpen(method):
    rng = np.random.default_rng(5)
    sizes = []
    for sharpness in (0.5, 1.0, 2.0, 4.0):
        p, y = sample(rng, 4000, sharpness)
        q = cal.conformal_quantile(p[:2000], y[:2000], 0.1, method)
        sets = cal.prediction_sets(p[2000:], q, method)
        sizes.append(cal.set_size(sets))
    assert all(a > b for a, b in zip(sizes, sizes[1:])), sizes
    assert sizes[-1] < sizes[0] / 2


def test_alpha_and_method_errors_are_one_line():
    rng = np.random.default_rng(6)
    p, y = sample(rng, 9)
    for alpha in (0.0, 1.0, 1.5, -0.1, True, "0.1"):
        with pytest.raises(ValueError, match="alpha") as info:
            cal.conformal_quantile(p, y, alpha)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"n=9 .*n >= 1/alpha - 1 = 19"):
        cal.conformal_quantile(p, y, 0.05)
    # n = 9 is just enough for alpha = 0.1: k = ceil(10 * 0.9) = 9 = n, the largest score
    assert cal.conformal_quantile(p, y, 0.1) == pytest.approx(max(1 - p[np.arange(9), y]), abs=1e-6)
    with pytest.raises(ValueError, match="unknown conformal method"):
        cal.conformal_quantile(p, y, 0.1, method="lac")
    with pytest.raises(ValueError, match="unknown conformal method"):
        cal.prediction_sets(p, 0.5, method="APS")
    with pytest.raises(ValueError, match="k_reg"):
        cal.conformal_scores(p, "raps", k_reg=-1)
    with pytest.raises(ValueError, match="labels"):
        cal.conformal_quantile(p, y[:-1], 0.1)


def test_set_size_and_coverage_match_numpy():
    rng = np.random.default_rng(7)
    sets = rng.random((50, C)) < 0.3
    y = rng.integers(0, C, size=50)
    assert cal.set_size(sets) == pytest.approx(sets.sum(1).mean())
    assert cal.coverage(sets, y) == pytest.approx(sets[np.arange(50), y].mean())
    assert cal.coverage(jnp.asarray(sets), jnp.asarray(y)) == pytest.approx(
        sets[np.arange(50), y].mean()
    )


def test_conformal_on_sharded_arrays_equals_numpy():
    need_devices(8)
    rng = np.random.default_rng(8)
    p, y = sample(rng, 800)
    mesh = jax.make_mesh((8,), ("x",))
    ps = jax.device_put(p.astype(np.float32), NamedSharding(mesh, P("x")))
    ys = jax.device_put(y, NamedSharding(mesh, P("x")))
    for method in ("thr", "aps"):
        q = cal.conformal_quantile(ps, ys, 0.1, method)
        assert q == cal.conformal_quantile(p.astype(np.float32), y, 0.1, method)
        sets = cal.prediction_sets(ps, q, method)
        np.testing.assert_array_equal(sets, cal.prediction_sets(p, q, method))
        assert cal.coverage(sets, ys) == pytest.approx(cal.coverage(np.asarray(sets), y))


def test_public_names():
    assert set(cal.__all__) == {
        "METHODS",
        "apply_temperature",
        "apply_temperature_to_probs",
        "conformal_interval_quantile",
        "conformal_quantile",
        "conformal_scores",
        "coverage",
        "ensemble_logits",
        "fit_temperature",
        "fit_variance_scale",
        "prediction_sets",
        "run",
        "set_size",
    }
    assert cal.METHODS == ("thr", "aps", "raps")
    for name in cal.__all__:
        obj = getattr(cal, name)
        if callable(obj):
            doc = obj.__doc__ or ""
            assert "Args:" in doc and "Returns:" in doc and "Example:" in doc, name


# --------------------------------------------------------------------------- issue 25


def _one_at_a_time(p: np.ndarray, q: float, method: str, **kw) -> np.ndarray:
    """Each row's set from its own call, as a server predicting one example at a time."""
    return np.concatenate(
        [np.asarray(cal.prediction_sets(p[i : i + 1], q, method, **kw)) for i in range(len(p))]
    )


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize(
    ("method", "kw"),
    [("aps", {}), ("raps", {"k_reg": 1, "lam": 0.1})],
    ids=["aps", "raps"],
)
def test_randomized_sets_cover_when_predicted_one_at_a_time(method, kw):
    """Labels drawn from known probabilities; 20 random calibration/test splits; each test
    example predicted in its own call, one seed for all (as a user would). With an offset
    drawn by row position every one-row call reused one ``u`` and covered ~0.73 at alpha
    0.2."""
    rng = np.random.default_rng(25)
    alpha, n_cal, n_test, covered = 0.2, 300, 100, []
    p, y = sample(rng, 2000)
    for split in range(20):
        idx = rng.permutation(len(y))
        cal_i, test_i = idx[:n_cal], idx[n_cal : n_cal + n_test]
        q = cal.conformal_quantile(
            p[cal_i], y[cal_i], alpha, method, randomized=True, seed=10, **kw
        )
        sets = _one_at_a_time(p[test_i], q, method, randomized=True, seed=10, **kw)
        covered.append(sets[np.arange(n_test), y[test_i]])
        if split == 0:  # the same sets in one batch
            batch = cal.prediction_sets(p[test_i], q, method, randomized=True, seed=10, **kw)
            np.testing.assert_array_equal(sets, batch)
    assert np.mean(covered) >= 1 - alpha - 0.02, np.mean(covered)


def test_an_example_gets_the_same_randomized_set_alone_and_in_any_batch():
    rng = np.random.default_rng(26)
    p, _ = sample(rng, 64)
    p32 = p.astype(np.float32)
    for method in ("aps", "raps"):
        kw = {"randomized": True, "seed": 7}
        alone = cal.conformal_scores(p32[5:6], method, **kw)
        for batch in (p32, p32[::-1], np.roll(p32, 3, axis=0), p32[:6]):
            row = int(np.flatnonzero((batch == p32[5]).all(1))[0])
            np.testing.assert_array_equal(cal.conformal_scores(batch, method, **kw)[row], alone[0])
            q = 0.6
            np.testing.assert_array_equal(
                cal.prediction_sets(batch, q, method, **kw)[row],
                cal.prediction_sets(p32[5:6], q, method, **kw)[0],
            )
    # one-row calls vmapped (values are checked outside jit, shapes inside): the same sets
    one_row = lambda row: cal.prediction_sets(row[None], 0.6, "raps", randomized=True, seed=7)
    np.testing.assert_array_equal(
        jax.vmap(one_row)(p32)[:, 0],
        cal.prediction_sets(p32, 0.6, "raps", randomized=True, seed=7),
    )
    # u: one per example, spread over [0, 1), changed by the seed
    inclusive = ref_scores(p32, "aps")
    u = (inclusive - np.asarray(cal.conformal_scores(p32, "aps", randomized=True, seed=7))) / p32
    assert np.ptp(u, axis=1).max() < 1e-3 and u[:, 0].std() > 0.2
    other = cal.conformal_scores(p32, "aps", randomized=True, seed=8)
    assert not np.array_equal(other, cal.conformal_scores(p32, "aps", randomized=True, seed=7))


BAD_PROBS = [
    (lambda p: np.where(p > 0.3, np.nan, p), "NaN or inf"),
    (lambda p: np.where(p > 0.3, np.inf, p), "NaN or inf"),
    (lambda p: np.log(p), "negative"),  # logits
    (lambda p: 3.0 * p, "sum to 1"),  # unnormalised
    (lambda p: p[:0], "no example"),
    (lambda p: p[:, :0], "no example"),
    (lambda p: p[None], "2-D"),
]


@pytest.mark.parametrize(("bad", "match"), BAD_PROBS)
def test_conformal_inputs_are_checked_at_the_boundary(bad, match):
    p, y = sample(np.random.default_rng(27), 40)
    calls = [
        lambda x: cal.conformal_quantile(x, y[: len(x)] if x.ndim == 2 else y, 0.1, "aps"),
        lambda x: cal.prediction_sets(x, 0.5, "raps"),
        lambda x: cal.conformal_scores(x, "thr"),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=match) as info:
            call(bad(p))
        assert "\n" not in str(info.value)
    if match in ("NaN or inf", "negative", "sum to 1"):
        for call in (cal.ensemble_logits, lambda x: cal.apply_temperature_to_probs(x, 2.0)):
            with pytest.raises(ValueError, match=match):
                call(bad(p)[None] if call is cal.ensemble_logits else bad(p))


def test_logits_get_a_hint_and_bad_q_is_one_line():
    p, y = sample(np.random.default_rng(28), 40)
    with pytest.raises(ValueError, match="not logits"):
        cal.conformal_quantile(np.log(p) + 5.0, y, 0.1)  # positive logits: rows sum to ~60
    for q in (np.array([0.5, 0.6]), np.full((40, 1), 0.5), np.nan, "0.5"):
        with pytest.raises(ValueError, match="`q`") as info:
            cal.prediction_sets(p, q)
        assert "\n" not in str(info.value)
    for call in (
        cal.conformal_quantile,
        lambda p, y, a, m, **kw: cal.prediction_sets(p, 0.5, m, **kw),
    ):
        with pytest.raises(ValueError, match="unknown score arguments"):
            call(p, y, 0.1, "aps", randomised=True)
    with pytest.raises(ValueError, match="seed"):
        cal.conformal_quantile(p, y, 0.1, "aps", randomized=True, seed=0.5)
    with pytest.warns(UserWarning, match="look like probabilities"):
        cal.fit_temperature(p, y)
    for call in (cal.fit_temperature, lambda z, _: cal.apply_temperature(z, 1.0)):
        with pytest.raises(ValueError, match="NaN or inf"):
            call(np.where(p > 0.3, np.inf, np.log(p)), y)
    with pytest.raises(ValueError, match="no example"):
        cal.apply_temperature(np.zeros((0, C)), 1.0)
    with pytest.raises(ValueError, match="no example"):
        cal.set_size(np.zeros((0, C), bool))
    with pytest.raises(ValueError, match="no example"):
        cal.coverage(np.zeros((0, C), bool), np.zeros(0, int))
    with pytest.raises(ValueError, match="finite"):
        cal.apply_temperature(np.log(p), np.inf)
    with pytest.raises(ValueError, match="a number > 0"):
        cal.apply_temperature(np.log(p), "hot")


def test_float64_quantile_is_exact_under_x64():
    """Under x64 float64 scores were compared with q rounded to float32: a calibration
    example at the k-th score fell outside its own set in 161 of 400 draws."""
    rng = np.random.default_rng(29)
    with jax.enable_x64(True):
        for draw in range(10):
            p, y = sample(rng, 200)
            for method, kw in (("thr", {}), ("aps", {"randomized": True, "seed": draw})):
                s = np.asarray(cal.conformal_scores(p, method, **kw))
                assert s.dtype == np.float64
                q = cal.conformal_quantile(p, y, 0.1, method, **kw)
                true = s[np.arange(200), y]
                assert q in true  # exactly one of the float64 scores
                sets = np.asarray(cal.prediction_sets(p, q, method, **kw))
                inside = sets[np.arange(200), y]
                np.testing.assert_array_equal(inside, true <= q)
                assert inside.sum() >= math.ceil(201 * 0.9)
        z = rng.normal(size=(5, C))
        assert cal.apply_temperature(z, 2.0).dtype == np.float64
        assert cal.apply_temperature_to_probs(ref_softmax(z), 2.0).dtype == np.float64
