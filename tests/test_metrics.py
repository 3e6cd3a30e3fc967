"""Tests of meshensemble.metrics against independent numpy references (loops) and sklearn."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import need_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sklearn.metrics import average_precision_score, roc_auc_score

import meshensemble as me
from meshensemble import metrics
from meshensemble.numerics import sums as core_stats

M, N, C, BINS = 5, 120, 6, 15
TOL = {"rtol": 2e-5, "atol": 2e-5}
LOG_EPS = -math.log(1e-12)


# --------------------------------------------------------------------------- references


def ref_entropy_row(p: np.ndarray) -> float:
    return -sum(float(q) * math.log(float(q)) for q in p if q > 0)


def ref_basic(p: np.ndarray, y: np.ndarray, w: np.ndarray) -> dict[str, float]:
    """accuracy / nll / brier of probs [N, C] with example weights [N], by loops."""
    tot = {"accuracy": 0.0, "nll": 0.0, "brier": 0.0}
    for i in range(p.shape[0]):
        if w[i] == 0:
            continue
        pred = int(np.argmax(p[i]))
        tot["accuracy"] += w[i] * (pred == y[i])
        tot["nll"] += w[i] * -math.log(max(float(p[i, y[i]]), 1e-12))
        tot["brier"] += w[i] * sum(
            (float(p[i, c]) - (1.0 if c == y[i] else 0.0)) ** 2 for c in range(p.shape[1])
        )
    return {k: v / w.sum() for k, v in tot.items()}


def ref_bins(p: np.ndarray, y: np.ndarray, num_bins: int, w: np.ndarray) -> dict:
    edges = np.linspace(0.0, 1.0, num_bins + 1)
    count, conf_sum, correct_sum = np.zeros(num_bins), np.zeros(num_bins), np.zeros(num_bins)
    for i in range(p.shape[0]):
        if w[i] == 0:
            continue
        conf = float(p[i].max())
        b = num_bins - 1  # conf == 1.0 lands here
        for k in range(num_bins):
            if edges[k] <= conf < edges[k + 1]:
                b = k
                break
        count[b] += w[i]
        conf_sum[b] += w[i] * conf
        correct_sum[b] += w[i] * (int(np.argmax(p[i])) == y[i])
    return {"count": count, "confidence_sum": conf_sum, "correct_sum": correct_sum}


def ref_ece(p: np.ndarray, y: np.ndarray, num_bins: int, w: np.ndarray) -> float:
    bins = ref_bins(p, y, num_bins, w)
    total = bins["count"].sum()
    ece = 0.0
    for b in range(num_bins):
        if bins["count"][b] > 0:
            acc = bins["correct_sum"][b] / bins["count"][b]
            conf = bins["confidence_sum"][b] / bins["count"][b]
            ece += bins["count"][b] / total * abs(acc - conf)
    return ece


def ref_kl(p: np.ndarray, q: np.ndarray) -> float:
    """KL(p || q) with 0 log 0 = 0 and q clipped at 1e-12 (the library's convention)."""
    return sum(
        float(a) * (math.log(a) - math.log(max(float(b), 1e-12))) for a, b in zip(p, q) if a > 0
    )


def ref_uncertainty(mp: np.ndarray) -> dict[str, np.ndarray]:
    """Per-example entropy of the mean, expected entropy, MI and diversity of [M, N, C]."""
    m, n, _ = mp.shape
    keys = ("entropy", "expected_entropy", "mi", "disagreement", "vs_ensemble", "pairwise_kl")
    out = {k: np.zeros(n) for k in keys}
    for i in range(n):
        mean = mp[:, i].mean(axis=0)
        out["entropy"][i] = ref_entropy_row(mean)
        out["expected_entropy"][i] = sum(ref_entropy_row(mp[k, i]) for k in range(m)) / m
        out["mi"][i] = max(out["entropy"][i] - out["expected_entropy"][i], 0.0)
        ens_pred = int(np.argmax(mean))
        out["vs_ensemble"][i] = sum(int(np.argmax(mp[k, i])) != ens_pred for k in range(m)) / m
        preds = [int(np.argmax(mp[k, i])) for k in range(m)]
        pairs = [(j, k) for j in range(m) for k in range(j + 1, m)]
        if pairs:  # unordered pairs whose argmax differ; ordered pairs for the KL
            out["disagreement"][i] = sum(preds[j] != preds[k] for j, k in pairs) / len(pairs)
            kls = [ref_kl(mp[j, i], mp[k, i]) for j in range(m) for k in range(m) if j != k]
            out["pairwise_kl"][i] = sum(kls) / len(kls)
    return out


def ref_adaptive_ece(p: np.ndarray, y: np.ndarray, num_bins: int, w: np.ndarray) -> float:
    """Equal-mass bins: sorted by confidence (ties by index), n // B each, +1 in the first n % B."""
    items = sorted((float(p[i].max()), i) for i in range(len(y)) if w[i] != 0)
    base, extra = divmod(len(items), num_bins)
    total_w = sum(w[i] for _, i in items)
    ace, start = 0.0, 0
    for b in range(num_bins):
        size = base + (1 if b < extra else 0)
        group, start = items[start : start + size], start + size
        if not group:
            continue
        cnt = sum(w[i] for _, i in group)
        acc = sum(w[i] * (int(np.argmax(p[i])) == y[i]) for _, i in group) / cnt
        conf = sum(w[i] * c for c, i in group) / cnt
        ace += cnt / total_w * abs(acc - conf)
    return ace


def ref_ensemble_metrics(mp: np.ndarray, y: np.ndarray, num_bins: int, w=None) -> dict:
    m, n, _ = mp.shape
    w = np.ones(n) if w is None else np.asarray(w, np.float64)
    mean = mp.mean(axis=0)
    out: dict = dict(ref_basic(mean, y, w))
    out["ece"] = ref_ece(mean, y, num_bins, w)
    out["adaptive_ece"] = ref_adaptive_ece(mean, y, num_bins, w)
    unc = ref_uncertainty(mp)
    for key, ref_key in [
        ("entropy", "entropy"),
        ("expected_entropy", "expected_entropy"),
        ("mutual_information", "mi"),
        ("disagreement", "disagreement"),
        ("pairwise_kl", "pairwise_kl"),
        ("disagreement_vs_ensemble", "vs_ensemble"),
    ]:
        out[key] = float((unc[ref_key] * w).sum() / w.sum())
    per = [ref_basic(mp[k], y, w) for k in range(m)]
    for key in ("accuracy", "nll", "brier"):
        out[f"member_{key}"] = [d[key] for d in per]
    out["member_ece"] = [ref_ece(mp[k], y, num_bins, w) for k in range(m)]
    out["member_disagreement_vs_ensemble"] = [
        float(
            sum(w[i] * (int(np.argmax(mp[k, i])) != int(np.argmax(mean[i]))) for i in range(n))
            / w.sum()
        )
        for k in range(m)
    ]
    for key in ("accuracy", "nll", "brier", "ece", "disagreement_vs_ensemble"):
        out[f"mean_member_{key}"] = float(np.mean(out[f"member_{key}"]))
    return out


def assert_metrics_close(got: dict, want: dict) -> None:
    assert set(want) <= set(got), set(want) - set(got)
    for key, value in want.items():
        if isinstance(value, list):
            assert isinstance(got[key], list) and len(got[key]) == len(value), key
            assert all(isinstance(v, float) for v in got[key]), key
        else:
            assert isinstance(got[key], float), key
        np.testing.assert_allclose(got[key], value, **TOL, err_msg=key)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    """Dirichlet member probabilities [M, N, C] (float32 values, held as float64) and labels."""
    rng = np.random.default_rng(0)
    mp = rng.dirichlet(np.full(C, 0.4), size=(M, N)).astype(np.float32)
    mp = (mp / mp.sum(-1, keepdims=True)).astype(np.float64)
    labels = rng.integers(0, C, size=N)
    return mp, labels


@pytest.fixture(scope="module")
def mask() -> np.ndarray:
    return np.random.default_rng(1).random(N) < 0.7


# --------------------------------------------------------------------------- basic metrics


@pytest.mark.parametrize("use_mask", [False, True])
def test_basic_metrics_match_reference(data, mask, use_mask):
    mp, y = data
    p = mp[0]
    m = mask if use_mask else None
    w = mask.astype(np.float64) if use_mask else np.ones(N)
    want = ref_basic(p, y, w)
    assert float(metrics.accuracy(p, y, m)) == pytest.approx(want["accuracy"], abs=1e-6)
    assert float(metrics.nll(p, y, m)) == pytest.approx(want["nll"], rel=1e-5)
    assert float(metrics.brier(p, y, m)) == pytest.approx(want["brier"], rel=1e-5)
    assert float(metrics.ece(p, y, BINS, m)) == pytest.approx(ref_ece(p, y, BINS, w), abs=2e-6)


def test_jax_input_and_jit(data):
    mp, y = data
    p, yj = jnp.asarray(mp[0], jnp.float32), jnp.asarray(y)
    for fn in (metrics.accuracy, metrics.nll, metrics.brier):
        eager = float(fn(mp[0], y))
        assert float(fn(p, yj)) == pytest.approx(eager, rel=1e-6)
        assert float(jax.jit(fn)(p, yj)) == pytest.approx(eager, rel=1e-5)
    ece_jit = jax.jit(metrics.ece, static_argnames="num_bins")
    assert float(ece_jit(p, yj, num_bins=BINS)) == pytest.approx(
        float(metrics.ece(p, yj, BINS)), abs=1e-6
    )


def test_masked_out_examples_do_not_count_even_if_nan(data, mask):
    mp, y = data
    p = mp[0].copy()
    p[~mask] = np.nan
    want = ref_basic(mp[0][mask], y[mask], np.ones(mask.sum()))
    want["ece"] = ref_ece(mp[0][mask], y[mask], BINS, np.ones(mask.sum()))
    assert float(metrics.accuracy(p, y, mask)) == pytest.approx(want["accuracy"], abs=1e-6)
    assert float(metrics.nll(p, y, mask)) == pytest.approx(want["nll"], rel=1e-5)
    assert float(metrics.brier(p, y, mask)) == pytest.approx(want["brier"], rel=1e-5)
    assert float(metrics.ece(p, y, BINS, mask)) == pytest.approx(want["ece"], abs=2e-6)


# --------------------------------------------------------------------------- calibration


def test_calibration_bins_match_reference(data, mask):
    mp, y = data
    got = metrics.calibration_bins(mp[1], y, num_bins=BINS, mask=mask)
    want = ref_bins(mp[1], y, BINS, mask.astype(np.float64))
    for key in ("count", "confidence_sum", "correct_sum"):
        assert got[key].shape == (BINS,)
        np.testing.assert_allclose(got[key], want[key], **TOL, err_msg=key)
    np.testing.assert_allclose(got["bin_edges"], np.linspace(0, 1, BINS + 1), atol=1e-7)
    assert float(metrics.ece_from_bins(got)) == pytest.approx(
        ref_ece(mp[1], y, BINS, mask.astype(np.float64)), abs=2e-6
    )


def test_bin_sums_from_shards_add_up(data):
    mp, y = data
    whole = metrics.calibration_bins(mp[2], y, num_bins=BINS)
    parts = [
        metrics.calibration_bins(mp[2][s], y[s], num_bins=BINS) for s in np.split(np.arange(N), 3)
    ]
    summed = {k: sum(part[k] for part in parts) for k in ("count", "confidence_sum", "correct_sum")}
    for key, value in summed.items():
        np.testing.assert_allclose(value, whole[key], **TOL)
    assert float(metrics.ece_from_bins(summed)) == pytest.approx(
        float(metrics.ece_from_bins(whole)), abs=1e-6
    )


def test_confidence_one_lands_in_last_bin_and_zero_in_first():
    probs = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.0]])
    bins = metrics.calibration_bins(probs, np.array([0, 1, 0]), num_bins=4)
    np.testing.assert_array_equal(bins["count"], [1.0, 0.0, 1.0, 1.0])
    np.testing.assert_allclose(bins["confidence_sum"], [0.0, 0.0, 0.5, 1.0])
    np.testing.assert_allclose(bins["correct_sum"], [0.0, 0.0, 1.0, 1.0])


def test_all_correct_predictions(data):
    mp, _ = data
    p = mp[0]
    y = p.argmax(-1)
    assert float(metrics.accuracy(p, y)) == 1.0
    want = float(np.mean(np.abs(1.0 - p.max(-1))))
    assert float(metrics.ece(p, y, BINS)) == pytest.approx(want, abs=2e-6)


def test_reliability_diagram_data(data):
    mp, y = data
    d = metrics.reliability_diagram_data(mp[0], y, num_bins=BINS)
    want = ref_bins(mp[0], y, BINS, np.ones(N))
    assert all(isinstance(d[k], np.ndarray) for k in ("accuracy", "confidence", "count"))
    np.testing.assert_allclose(d["count"], want["count"])
    np.testing.assert_allclose(d["bin_edges"], np.linspace(0, 1, BINS + 1))
    for b in range(BINS):
        if want["count"][b] == 0:
            assert np.isnan(d["accuracy"][b]) and np.isnan(d["confidence"][b])
        else:
            assert d["accuracy"][b] == pytest.approx(want["correct_sum"][b] / want["count"][b])
            assert d["confidence"][b] == pytest.approx(
                want["confidence_sum"][b] / want["count"][b], rel=1e-5
            )
    assert np.isnan(d["accuracy"]).any()  # the first bins are empty: max prob >= 1 / C


@pytest.mark.parametrize("use_mask", [False, True])
@pytest.mark.parametrize("num_bins", [1, 7, BINS, 200])  # 200 > N: some bins stay empty
def test_adaptive_ece_matches_reference(data, mask, use_mask, num_bins):
    mp, y = data
    p = mp.mean(0)
    w = mask.astype(np.float64) if use_mask else np.ones(N)
    got = metrics.adaptive_ece(p, y, num_bins, mask if use_mask else None)
    assert isinstance(got, float)
    assert got == pytest.approx(ref_adaptive_ece(p, y, num_bins, w), abs=1e-6)
    if num_bins == 1:  # one bin: |accuracy - mean confidence|
        want = abs(ref_basic(p, y, w)["accuracy"] - float((p.max(-1) * w).sum() / w.sum()))
        assert got == pytest.approx(want, abs=1e-6)


def test_adaptive_ece_bins_have_equal_counts_unlike_ece():
    # 10 examples: 8 confident and right, 2 unsure and wrong. Equal-width bins put the 2 in
    # one bin; 2 equal-mass bins of 5 mix three confident examples into the unsure bin.
    conf = np.array([0.4, 0.45] + [0.95] * 8)
    correct = np.array([0, 0] + [1] * 8)
    want = (abs(3 - (0.4 + 0.45 + 3 * 0.95)) + abs(5 - 5 * 0.95)) / 10
    assert metrics.adaptive_ece_from_examples(conf, correct, 2) == pytest.approx(want)
    rest = (1 - conf) / 2
    p = np.stack([conf, rest, rest], axis=1)  # 3 classes: the max is conf
    y = np.where(correct == 1, 0, 1)
    assert metrics.adaptive_ece(p, y, 2) == pytest.approx(want, abs=1e-6)
    assert float(metrics.ece(p, y, 2)) == pytest.approx((0.85 + 8 * 0.05) / 10, abs=1e-6)
    # weight 0 drops an example even when it is NaN; no example left: NaN
    assert metrics.adaptive_ece_from_examples(
        np.r_[conf, np.nan], np.r_[correct, 1], 2, np.r_[np.ones(10), 0]
    ) == pytest.approx(want)
    assert math.isnan(metrics.adaptive_ece_from_examples(conf, correct, 2, np.zeros(10)))
    with pytest.raises(ValueError, match="one value per example"):
        metrics.adaptive_ece_from_examples(conf, correct[:-1], 2)
    with pytest.raises(ValueError, match="num_bins"):
        metrics.adaptive_ece(p, y, 0)


# --------------------------------------------------------------------------- uncertainty


def test_uncertainty_match_reference(data):
    mp, _ = data
    want = ref_uncertainty(mp)
    np.testing.assert_allclose(metrics.entropy(mp.mean(0)), want["entropy"], **TOL)
    np.testing.assert_allclose(metrics.expected_entropy(mp), want["expected_entropy"], **TOL)
    np.testing.assert_allclose(metrics.mutual_information(mp), want["mi"], **TOL)
    np.testing.assert_allclose(metrics.disagreement(mp), want["disagreement"], atol=1e-6)
    np.testing.assert_allclose(metrics.disagreement_vs_ensemble(mp), want["vs_ensemble"], atol=1e-6)
    np.testing.assert_allclose(metrics.pairwise_kl(mp), want["pairwise_kl"], **TOL)
    assert (np.asarray(metrics.pairwise_kl(mp)) > 0).all()
    assert metrics.entropy(mp[0]).shape == (N,)
    assert float(jnp.min(metrics.mutual_information(mp))) >= 0.0


@pytest.mark.slow  # among the heaviest default tests, measured
def test_one_hot_probabilities_are_finite():
    onehot = np.eye(3)[[0, 1, 2, 0]]  # exact 0s and 1s
    y_wrong = np.array([1, 2, 0, 0])
    ent = np.asarray(metrics.entropy(onehot))
    np.testing.assert_array_equal(ent, np.zeros(4))
    assert not np.signbit(ent).any()  # +0.0, not -0.0
    assert float(metrics.nll(onehot, y_wrong)) == pytest.approx(0.75 * LOG_EPS, rel=1e-5)
    mp = np.stack([onehot, np.eye(3)[[1, 1, 2, 0]]])
    fns = (metrics.expected_entropy, metrics.mutual_information, metrics.disagreement)
    for fn in (*fns, metrics.pairwise_kl, metrics.disagreement_vs_ensemble):
        assert np.isfinite(np.asarray(fn(mp))).all()
    # member 0 puts 0 on the class member 1 predicts: KL = -log(eps) there, finite
    np.testing.assert_allclose(metrics.pairwise_kl(mp), [LOG_EPS, 0, 0, 0], rtol=1e-5)
    got = metrics.ensemble_metrics(mp, y_wrong, num_bins=BINS)
    assert all(np.isfinite(v).all() for v in got.values())
    want = ref_ensemble_metrics(mp, y_wrong, BINS)
    want["member_nll"] = [0.75 * LOG_EPS, 0.5 * LOG_EPS]
    assert_metrics_close(got, want)
    # gradients of the NLL (clip) and the entropy (0 log 0 = 0) stay finite at exact 0s and 1s
    grads = jax.grad(lambda p: metrics.nll(p, y_wrong) + metrics.entropy(p).sum())(
        jnp.asarray(onehot, jnp.float32)
    )
    assert np.isfinite(np.asarray(grads)).all()


def test_ood_score_kinds(data):
    mp, _ = data
    mean = mp.mean(0)
    want = ref_uncertainty(mp)
    np.testing.assert_allclose(metrics.ood_score(mp, "max_prob"), 1.0 - mean.max(-1), **TOL)
    np.testing.assert_allclose(metrics.ood_score(mp, "entropy"), want["entropy"], **TOL)
    np.testing.assert_allclose(metrics.ood_score(mp, "mutual_information"), want["mi"], **TOL)
    with pytest.raises(ValueError, match="unknown OOD score kind"):
        metrics.ood_score(mp, "energy")
    with pytest.raises(ValueError, match="3-D"):
        metrics.ood_score(mean, "entropy")


def ref_logsumexp(z: np.ndarray) -> float:
    top = max(float(v) for v in z)
    return top + math.log(sum(math.exp(float(v) - top) for v in z))


def test_ood_score_from_logits_matches_reference():
    rng = np.random.default_rng(5)
    z = rng.normal(0, 3, size=(M, N, C))
    zf = z.astype(np.float32)
    got = {k: np.asarray(metrics.ood_score_from_logits(zf, k)) for k in metrics.LOGIT_OOD_KINDS}
    energy = [sum(-ref_logsumexp(z[m, i]) for m in range(M)) / M for i in range(N)]
    max_logit = [sum(-float(z[m, i].max()) for m in range(M)) / M for i in range(N)]
    np.testing.assert_allclose(got["energy"], energy, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["max_logit"], max_logit, rtol=1e-5, atol=1e-5)
    probs = np.exp(z - z.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    for kind in metrics.OOD_KINDS:  # the probability kinds, from the softmax
        np.testing.assert_allclose(got[kind], metrics.ood_score(probs, kind), **TOL, err_msg=kind)
    # a constant added to each example's logits: softmax scores stay, the logit scores move
    shifted = {k: np.asarray(metrics.ood_score_from_logits(zf + 5.0, k)) for k in got}
    np.testing.assert_allclose(shifted["energy"], got["energy"] - 5.0, atol=1e-4)
    np.testing.assert_allclose(shifted["max_logit"], got["max_logit"] - 5.0, atol=1e-4)
    np.testing.assert_allclose(shifted["entropy"], got["entropy"], atol=1e-5)
    with pytest.raises(ValueError, match="unknown OOD score kind"):
        metrics.ood_score_from_logits(zf, "logit")
    with pytest.raises(ValueError, match="member_logits.*3-D"):
        metrics.ood_score_from_logits(zf[0], "energy")


# --------------------------------------------------------------------------- AUROC / AUPR


@pytest.mark.parametrize(
    "make",
    [
        lambda r: (r.normal(0, 1, 300), r.normal(1, 1, 200)),
        lambda r: (r.integers(0, 4, 150).astype(float), r.integers(1, 5, 90).astype(float)),
        lambda r: (r.normal(0, 1, 1), r.normal(0, 1, 7)),
        lambda r: (np.array([0.1, 0.2, 0.3]), np.array([0.25, 0.9])),
    ],
    ids=["gaussian", "ties", "one_in", "doc"],
)
def test_auroc_aupr_match_sklearn(make):
    s_in, s_out = make(np.random.default_rng(3))
    y = np.r_[np.zeros(len(s_in)), np.ones(len(s_out))]
    s = np.r_[s_in, s_out]
    got_roc, got_pr = metrics.auroc(s_in, s_out), metrics.aupr(s_in, s_out)
    assert isinstance(got_roc, float) and isinstance(got_pr, float)
    assert got_roc == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    assert got_pr == pytest.approx(average_precision_score(y, s), abs=1e-12)


def test_auroc_identical_scores_and_perfect_separation():
    assert metrics.auroc(np.ones(5), np.ones(3)) == 0.5
    assert metrics.aupr(np.ones(5), np.ones(3)) == pytest.approx(3 / 8)
    assert metrics.auroc([0.0, 0.1], [0.5, 0.7]) == 1.0
    assert metrics.aupr([0.0, 0.1], [0.5, 0.7]) == 1.0
    assert metrics.auroc([0.5, 0.7], [0.0, 0.1]) == 0.0
    assert metrics.auroc(jnp.array([0.1, 0.2]), jnp.array([0.3])) == 1.0  # jax input


@pytest.mark.parametrize("fn", [metrics.auroc, metrics.aupr])
def test_auroc_aupr_reject_bad_scores(fn):
    with pytest.raises(ValueError, match="scores_in.*empty"):
        fn([], [0.1])
    with pytest.raises(ValueError, match="scores_out.*empty"):
        fn([0.1], np.array([]))
    with pytest.raises(ValueError, match="NaN"):
        fn([0.1, np.nan], [0.2])
    with pytest.raises(ValueError, match="1-D"):
        fn(np.zeros((2, 2)), [0.2])


# --------------------------------------------------------------------------- ensemble metrics


@pytest.mark.parametrize("use_mask", [False, True])
def test_ensemble_metrics_match_reference(data, mask, use_mask):
    mp, y = data
    got = metrics.ensemble_metrics(mp, y, num_bins=BINS, mask=mask if use_mask else None)
    want = ref_ensemble_metrics(mp, y, BINS, mask if use_mask else None)
    assert_metrics_close(got, want)
    assert len(got["member_accuracy"]) == M


def test_ensemble_metrics_mask_equals_subset(data, mask):
    mp, y = data
    padded = mp.copy()
    padded[:, ~mask] = np.nan  # padding garbage must not leak
    got = metrics.ensemble_metrics(padded, y, num_bins=BINS, mask=mask.astype(np.float32))
    assert_metrics_close(got, ref_ensemble_metrics(mp[:, mask], y[mask], BINS))


def test_ensemble_metrics_one_class_labels(data):
    mp, _ = data
    y = np.full(N, 2)
    got = metrics.ensemble_metrics(mp, y, num_bins=BINS)
    assert_metrics_close(got, ref_ensemble_metrics(mp, y, BINS))


def test_ensemble_metrics_default_bins_and_jax_input(data):
    mp, y = data
    got = metrics.ensemble_metrics(jnp.asarray(mp, jnp.float32), jnp.asarray(y))
    assert_metrics_close(got, ref_ensemble_metrics(mp, y, 15))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (lambda mp, y: (mp[0], y), "3-D"),
        (lambda mp, y: (mp[None], y), "3-D"),
        (lambda mp, y: (mp, y[:-1]), "length N"),
        (lambda mp, y: (mp, y[None]), "length N"),
        (lambda mp, y: (mp, y.astype(float)), "integer"),
        (lambda mp, y: (mp, np.r_[y[:-1], C]), r"\[0, 6\)"),
        (lambda mp, y: (mp, np.r_[-1, y[1:]]), r"\[0, 6\)"),
    ],
    ids=["2d", "4d", "short_labels", "2d_labels", "float_labels", "label_too_big", "negative"],
)
def test_ensemble_metrics_rejects_bad_input(data, args, match):
    with pytest.raises(ValueError, match=match) as info:
        metrics.ensemble_metrics(*args(*data))
    assert "\n" not in str(info.value)


def test_bad_mask_and_bins_raise(data):
    mp, y = data
    with pytest.raises(ValueError, match="mask"):
        metrics.ensemble_metrics(mp, y, mask=np.ones(N - 1))
    with pytest.raises(ValueError, match="mask"):
        metrics.accuracy(mp[0], y, mask=np.ones((N, 1)))
    with pytest.raises(ValueError, match="num_bins"):
        metrics.ece(mp[0], y, num_bins=0)
    with pytest.raises(ValueError, match="num_bins"):
        metrics.calibration_bins(mp[0], y, num_bins=7.5)
    with pytest.raises(ValueError, match="at least one example"):
        metrics.ensemble_metrics(mp, y, mask=np.zeros(N))
    with pytest.raises(ValueError, match="labels"):
        metrics.nll(mp[0], y[:3])


# --------------------------------------------------------------------------- streaming form


def _pad(x: np.ndarray, size: int, axis: int) -> np.ndarray:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return np.pad(x, widths)


def _sum_stats(parts: list[dict]) -> dict:
    return {k: sum(np.asarray(p[k], np.float64) for p in parts) for k in parts[0]}


def test_streaming_uneven_chunks_with_padding_match(data):
    mp, y = data
    every = metrics.member_summaries(mp)  # all members here: no reduction over devices
    stats_fn = jax.jit(metrics.streaming_stats, static_argnames="num_bins")
    chunk = 50
    parts, examples = [], []
    for idx in np.split(np.arange(N), [37, 87]):  # 37, 50, 33 examples; pad each to 50
        n = len(idx)
        mean, votes, logp = (
            _pad(np.asarray(every[k])[idx], chunk, 0) for k in ("probs", "votes", "log_probs")
        )
        labels, mask = _pad(y[idx], chunk, 0), _pad(np.ones(n, np.float32), chunk, 0)
        parts.append(
            stats_fn(
                _pad(mp[:, idx], chunk, 1),
                mean,
                labels,
                mask,
                num_bins=BINS,
                ensemble_votes=votes,
                ensemble_log_probs=logp,
            )
        )
        examples.append(metrics.example_stats(mean, labels, mask))
    total = _sum_stats(parts)
    assert total["count"] == N
    joined = {k: np.concatenate([e[k] for e in examples]) for k in metrics.EXAMPLE_STAT_KEYS}
    assert joined["weight"].shape == (150,)  # padding included, dropped by its weight 0
    got = metrics.finalize_stats(total, num_bins=BINS, examples=joined)
    assert_metrics_close(got, metrics.ensemble_metrics(mp, y, num_bins=BINS))
    assert_metrics_close(got, ref_ensemble_metrics(mp, y, BINS))


def test_streaming_member_groups_concatenate(data, mask):
    mp, y = data
    every = metrics.member_summaries(mp)
    w = mask.astype(np.float32)
    kw = dict(num_bins=BINS, ensemble_votes=every["votes"], ensemble_log_probs=every["log_probs"])
    groups = [
        metrics.streaming_stats(mp[:2], every["probs"], y, w, **kw),
        metrics.streaming_stats(mp[2:], every["probs"], y, w, **kw),
    ]
    assert groups[0]["member_bin_count"].shape == (2, BINS)
    assert groups[1]["member_correct"].shape == (3,)
    for key, value in groups[0].items():
        if not key.startswith("member_"):  # ensemble sums do not depend on the member group
            np.testing.assert_allclose(value, groups[1][key], rtol=1e-6)
    joined = {
        k: np.concatenate([g[k] for g in groups]) if k.startswith("member_") else groups[0][k]
        for k in groups[0]
    }
    examples = metrics.example_stats(every["probs"], y, w)
    got = metrics.finalize_stats(joined, num_bins=BINS, examples=examples)
    assert_metrics_close(got, ref_ensemble_metrics(mp, y, BINS, mask))


def test_member_summaries_reduce_over_member_groups(data):
    mp, _ = data
    whole = metrics.member_summaries(mp[:4])
    halves = [metrics.member_summaries(mp[:2]), metrics.member_summaries(mp[2:4])]
    np.testing.assert_allclose(whole["votes"], halves[0]["votes"] + halves[1]["votes"])
    for key in ("probs", "log_probs"):  # pmean over two equal groups
        np.testing.assert_allclose(whole[key], (halves[0][key] + halves[1][key]) / 2, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(whole["votes"]).sum(-1), np.full(N, 4.0))
    np.testing.assert_allclose(
        whole["log_probs"], np.log(np.maximum(mp[:4], 1e-12)).mean(0), rtol=1e-5
    )


def test_pairwise_sums_are_nan_without_the_summaries_of_every_member(data):
    """A device that sees only its own members cannot know the pairs: NaN, never a wrong
    number; the other metrics are unaffected, and one member has no pairs (0)."""
    mp, y = data
    w = np.ones(N, np.float32)
    stats = metrics.streaming_stats(mp, mp.mean(0), y, w, num_bins=BINS)
    got = metrics.finalize_stats(stats, num_bins=BINS)
    for key in ("disagreement", "pairwise_kl", "adaptive_ece"):
        assert math.isnan(got[key]), key
    want = ref_ensemble_metrics(mp, y, BINS)
    for key in ("disagreement", "pairwise_kl", "adaptive_ece"):
        del want[key]
    assert_metrics_close(got, want)
    one = metrics.ensemble_metrics(mp[:1], y, num_bins=BINS)
    assert one["disagreement"] == 0.0 and one["pairwise_kl"] == 0.0
    assert one["disagreement_vs_ensemble"] == 0.0


def test_streaming_stats_keys_and_shapes(data):
    mp, y = data
    stats = metrics.streaming_stats(mp[:2], mp.mean(0), y, np.ones(N, np.float32), num_bins=BINS)
    for key, value in stats.items():
        assert isinstance(value, jax.Array), key
        lead = (2,) if key.startswith("member_") else ()
        assert value.shape == lead + ((BINS,) if "_bin_" in key else ()), key
    assert {k for k in stats if not k.startswith(("member_", "ensemble_"))} == {"count"}
    assert float(stats["count"]) == N
    want = ref_basic(mp.mean(0), y, np.ones(N))
    assert float(stats["ensemble_nll"]) == pytest.approx(N * want["nll"], rel=1e-5)


def test_streaming_in_shard_map(data):
    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()}")
    mp, y = data
    n = 96  # divisible by the data axis
    mp4 = mp[:4, :n].astype(np.float32)
    yy, w = y[:n], np.ones(n, np.float32)
    mesh = jax.make_mesh((2, 4), ("ensemble", "data"))

    def step(member_probs, labels, mask):
        local = metrics.member_summaries(member_probs)  # this device's 2 of the 4 members
        ens = jax.lax.pmean(local["probs"], "ensemble")
        stats = metrics.streaming_stats(
            member_probs,
            ens,
            labels,
            mask,
            num_bins=BINS,
            ensemble_votes=jax.lax.psum(local["votes"], "ensemble"),
            ensemble_log_probs=jax.lax.pmean(local["log_probs"], "ensemble"),
        )
        sums = jax.tree.map(lambda x: jax.lax.psum(x, "data"), stats)
        return sums, metrics.example_stats(ens, labels, mask)

    template = metrics.streaming_stats(mp4[:2, :8], mp4[0, :8], yy[:8], w[:8], num_bins=BINS)
    out_specs = {k: P("ensemble") if k.startswith("member_") else P() for k in template}
    example_specs = {k: P("data") for k in metrics.EXAMPLE_STAT_KEYS}
    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P("ensemble", "data"), P("data"), P("data")),
            out_specs=(out_specs, example_specs),
        )
    )
    args = [
        jax.device_put(x, NamedSharding(mesh, spec))
        for x, spec in [(mp4, P("ensemble", "data")), (yy, P("data")), (w, P("data"))]
    ]
    sums, examples = fn(*args)
    got = metrics.finalize_stats(sums, num_bins=BINS, examples=examples)
    assert_metrics_close(got, ref_ensemble_metrics(mp4.astype(np.float64), yy, BINS))


def test_streaming_and_finalize_reject_bad_input(data):
    mp, y = data
    mean, w = mp.mean(0), np.ones(N, np.float32)
    with pytest.raises(ValueError, match="ensemble_probs"):
        metrics.streaming_stats(mp, mean[:-1], y, w)
    with pytest.raises(ValueError, match="member_probs"):
        metrics.streaming_stats(mp[0], mean, y, w)
    with pytest.raises(ValueError, match="labels"):
        metrics.streaming_stats(mp, mean, y[:-1], w)
    with pytest.raises(ValueError, match="mask"):
        metrics.streaming_stats(mp, mean, y, w[:-1])
    stats = metrics.streaming_stats(mp[:2], mean, y, w, num_bins=BINS)
    with pytest.raises(ValueError, match="num_bins"):
        metrics.finalize_stats(stats, num_bins=10)  # made with BINS=15 bins
    with pytest.raises(ValueError, match="lacks keys"):
        metrics.finalize_stats({k: v for k, v in stats.items() if k != "member_nll"}, BINS)
    with pytest.raises(ValueError, match="count"):
        metrics.finalize_stats({**stats, "count": 0.0}, num_bins=BINS)
    with pytest.raises(ValueError, match="mask"):
        metrics.streaming_stats(mp, mean, y, None)
    with pytest.raises(ValueError, match="ensemble_votes"):
        metrics.streaming_stats(mp, mean, y, w, ensemble_votes=mean[:-1])
    with pytest.raises(ValueError, match="ensemble_log_probs"):
        metrics.streaming_stats(mp, mean, y, w, ensemble_log_probs=mean[:, :-1])
    with pytest.raises(ValueError, match="examples.*lacks keys"):
        metrics.finalize_stats(stats, BINS, examples={"confidence": w, "correct": w})


class _TinyNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(C)(nn.relu(nn.Dense(16)(x)))


NEW_KEYS = ("disagreement", "disagreement_vs_ensemble", "pairwise_kl", "adaptive_ece")


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize(
    ("members", "ensemble", "data_axis", "backend"),
    [(8, 8, 1, "shard_map"), (4, 2, 4, "shard_map"), (16, 8, 1, "pmap")],
    ids=["1_per_device", "2_per_device_2d", "2_per_device_pmap"],
)
def test_ensemble_evaluate_equals_ensemble_metrics_of_gathered_probs(
    members, ensemble, data_axis, backend
):
    """Ensemble.evaluate (sums and votes reduced on the mesh, per-example confidences for
    the adaptive ECE) = ensemble_metrics of the gathered [members, N, C] = the reference;
    N = 90 is divisible neither by the batch (32) nor by data=4 (padding and masks)."""
    need_devices(8)
    rng = np.random.default_rng(7)
    x = rng.normal(size=(90, 4, 3)).astype(np.float32)
    y = rng.integers(0, C, size=90)
    mesh = me.make_mesh(ensemble=ensemble, data=data_axis)
    ens = me.Ensemble(_TinyNet(), optax.sgd(0.1), members, mesh, backend=backend)
    state = ens.init(jax.random.key(0), x[:1])
    got = ens.evaluate(state, x, y, batch_size=32, num_bins=BINS)
    mp = np.asarray(ens.predict_members(state, x))
    host = metrics.ensemble_metrics(mp, y, num_bins=BINS)
    assert set(got) == set(host) and set(NEW_KEYS) <= set(got)
    assert len(got["member_disagreement_vs_ensemble"]) == members
    assert_metrics_close(got, host)
    assert_metrics_close(got, ref_ensemble_metrics(mp.astype(np.float64), y, BINS))
    assert 0 < got["disagreement"] < 1 and got["pairwise_kl"] > 0  # diverse random members


# --------------------------------------------------------------------------- the public face

PUBLIC = [
    "EPS",
    "OOD_KINDS",
    "LOGIT_OOD_KINDS",
    "accuracy",
    "adaptive_ece",
    "adaptive_ece_from_examples",
    "aupr",
    "auroc",
    "brier",
    "calibration_bins",
    "disagreement",
    "disagreement_vs_ensemble",
    "ece",
    "ece_from_bins",
    "ensemble_metrics",
    "entropy",
    "ENSEMBLE_STAT_KEYS",
    "EXAMPLE_STAT_KEYS",
    "MEMBER_STAT_KEYS",
    "example_stats",
    "expected_entropy",
    "finalize_stats",
    "member_summaries",
    "mutual_information",
    "nll",
    "ood_score",
    "ood_score_from_logits",
    "pairwise_kl",
    "prefix_metrics",
    "reliability_diagram_data",
    "reliability_from_bins",
    "streaming_stats",
]


def test_public_face_keeps_its_names_and_shares_the_core_sums():
    assert sorted(metrics.__all__) == sorted(PUBLIC)
    assert all(hasattr(metrics, name) for name in PUBLIC)
    # One implementation: the core's evaluation and the metrics use the same objects.
    assert metrics.streaming_stats is core_stats.streaming_stats
    assert metrics.finalize_stats is core_stats.finalize_stats
    assert metrics.MEMBER_STAT_KEYS is core_stats.MEMBER_STAT_KEYS
    assert metrics.ENSEMBLE_STAT_KEYS is core_stats.ENSEMBLE_STAT_KEYS
    assert metrics.EPS == core_stats.EPS == 1e-12
    assert metrics.OOD_KINDS is metrics.ood.OOD_KINDS
    assert metrics.member_summaries is core_stats.member_summaries
    assert metrics.example_stats is core_stats.example_stats
    assert metrics.EXAMPLE_STAT_KEYS is core_stats.EXAMPLE_STAT_KEYS


def test_entropy_of_nan_probabilities_is_nan_not_zero():
    """NaN probabilities (a diverged member) were reported with entropy 0.0: certain."""
    nan = float("nan")
    assert np.isnan(np.asarray(metrics.entropy([[nan, 0.5, 0.5]]))).all()
    member_probs = np.array([[[nan, nan]], [[0.5, 0.5]]], np.float32)
    assert np.isnan(np.asarray(metrics.expected_entropy(member_probs))).all()
    assert np.isnan(np.asarray(metrics.mutual_information(member_probs))).all()
    got = metrics.ensemble_metrics(member_probs, np.array([0]))
    assert np.isnan(got["entropy"]) and np.isnan(got["expected_entropy"])
    # exact zeros still contribute 0 (a one-hot row is certain)
    assert float(np.asarray(metrics.entropy([[1.0, 0.0]]))[0]) == 0.0
