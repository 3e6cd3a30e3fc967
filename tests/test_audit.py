"""What a mutation audit found: a one-line bug each that the other tests let through.

Each test here fails when its bug is put back (the audit's mutant, applied and reverted by
hand): the 90% widths of a regression mixture whose members are narrow, the variance floor
of a regression member, the data identity over all three splits, and the file manifest's
fingerprint over the files' SHA-256. They use the public API (``me.Ensemble`` with
``me.tasks.Regression``, ``me.data``, ``me.training.identity``), not the modules' insides.
(The fifth, the predictor's conformal method, is in ``test_serving.py``.)
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import need_devices
from scipy import optimize, stats

import meshensemble as me
from meshensemble.data import manifest
from meshensemble.training import identity

MIN_VARIANCE = 1e-6


class Narrow(nn.Module):
    """Member ``m`` predicts ``N(x_0 + mu_m, sd^2)`` for every row, ``mu_m`` drawn at init."""

    sd: float
    spread: float

    @nn.compact
    def __call__(self, x, train: bool = False):
        mu = self.param("mu", nn.initializers.normal(self.spread), (1, 1))
        s = math.log(math.expm1(self.sd**2 - MIN_VARIANCE))  # softplus(s) + floor = sd^2
        mean = x[:, :1] + mu
        return jnp.concatenate([mean, jnp.full_like(mean, s)], axis=-1)


def _mixture_quantile(mu: np.ndarray, sd: np.ndarray, p: float) -> float:
    cdf = lambda z: stats.norm.cdf((z - mu) / sd).mean() - p
    return optimize.brentq(cdf, (mu - 20 * sd).min(), (mu + 20 * sd).max(), xtol=1e-12)


@pytest.mark.parametrize("sd", [0.01, 3.0])
def test_interval_widths_of_narrow_and_wide_members_are_the_mixtures(sd):
    """``evaluate``'s 50/90/95% widths and coverage are the mixture's (scipy), also when
    each member's sd is far below 1 (a bisection bracket of ``mu +/- 10 variance`` gave
    widths of a tenth of an sd there)."""
    need_devices(8)
    ens = me.Ensemble(
        Narrow(sd, spread=2 * sd),
        optax.sgd(0.0),
        4,
        me.make_mesh(4, 2),
        task=me.tasks.Regression(targets=1, min_variance=MIN_VARIANCE),
    )
    x = np.linspace(-1, 1, 12, dtype=np.float32)[:, None]
    state = ens.init(jax.random.key(0), x[:1])
    members = me.distributed.fetch(ens.predict_members(state, x))
    mu = np.asarray(members["mean"], np.float64)[:, :, 0]  # [members, N]
    var = np.asarray(members["variance"], np.float64)[:, :, 0]
    np.testing.assert_allclose(var, sd**2, rtol=1e-4)
    assert np.ptp(mu[:, 0]) > sd  # a mixture, not one Gaussian
    y = x[:, 0] + np.where(np.arange(12) % 2, 0.5, 3.0) * sd  # inside 90% or not
    got = ens.evaluate(state, x, y)
    for c in (0.5, 0.9, 0.95):
        widths, inside = [], []
        for j in range(len(x)):
            lo = _mixture_quantile(mu[:, j], np.sqrt(var[:, j]), (1 - c) / 2)
            hi = _mixture_quantile(mu[:, j], np.sqrt(var[:, j]), (1 + c) / 2)
            widths.append(hi - lo)
            inside.append(lo <= y[j] <= hi)
        np.testing.assert_allclose(got[f"width_{round(100 * c)}"], np.mean(widths), rtol=1e-3)
        assert got[f"coverage_{round(100 * c)}"] == pytest.approx(np.mean(inside))


def test_the_variance_floor_is_added_after_the_softplus():
    """variance = softplus(s) + min_variance: for a very negative s, the floor itself (the
    floor inside the softplus gave softplus(s + floor), ~1e-13)."""
    floor = 1e-3
    task = me.tasks.Regression(targets=1, min_variance=floor)
    s = np.float32(-30.0)
    _, variance = task.moments(jnp.array([[0.0, s]], jnp.float32))
    want = np.float32(jax.nn.softplus(s)) + np.float32(floor)
    np.testing.assert_allclose(np.asarray(variance), [[want]], rtol=1e-6)
    need_devices(8)

    class Const(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            bias = self.param("bias", nn.initializers.zeros, (1, 1))
            return jnp.concatenate([x[:, :1] + bias, jnp.full_like(x[:, :1], s)], axis=-1)

    ens = me.Ensemble(Const(), optax.sgd(0.0), 4, me.make_mesh(4, 2), task=task)
    x = np.zeros((4, 1), np.float32)
    state = ens.init(jax.random.key(0), x[:1])
    got = me.distributed.fetch(ens.predict_members(state, x))["variance"]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def _npz(path, arrays) -> me.data.Dataset:
    np.savez(path, **arrays)
    return me.data.load_npz(path)


def test_the_data_identity_changes_with_each_split_alone(tmp_path):
    """``content`` covers the train, validation and test splits: a pixel changed in one
    split alone changes it (and only that split's fingerprint)."""
    ds = me.data.synthetic(64, 16, seed=0)
    arrays = dict(np.load(me.data.save_npz(ds, tmp_path / "base.npz")))
    base = identity.data_identity(me.data.load_npz(tmp_path / "base.npz"), None, 16, seed=0)
    held = me.data.split_validation(me.data.load_npz(tmp_path / "base.npz"), 16, seed=0).indices
    kept = np.setdiff1d(np.arange(64), held)
    for split, key, row in (
        ("test", "x_test", 3),
        ("validation", "x_train", int(held[2])),
        ("train", "x_train", int(kept[5])),
    ):
        changed = {k: v.copy() for k, v in arrays.items()}
        changed[key][row, 10, 10] ^= 1
        new = identity.data_identity(_npz(tmp_path / f"{split}.npz", changed), None, 16, seed=0)
        differ = [k for k in base["splits"] if new["splits"][k] != base["splits"][k]]
        assert differ == [split], (split, differ)
        assert new["content"] != base["content"], split


def test_the_manifest_fingerprint_follows_the_files_sha256(tmp_path, monkeypatch):
    """A file written again with other bytes of the same size (a conversion of other data)
    changes the manifest's fingerprint, and so the identity of a run's data."""
    monkeypatch.setenv(manifest.VERIFY_CACHE_ENV, str(tmp_path / "verified.json"))
    entry = {"bytes": 100, "sha256": "a" * 64, "records": 4}
    one = {"format": 1, "files": {"test.array_record": entry}}
    other = {"format": 1, "files": {"test.array_record": entry | {"sha256": "b" * 64}}}
    names = ["test.array_record"]
    assert manifest.manifest_fingerprint(one, names) != manifest.manifest_fingerprint(other, names)

    ds = me.data.synthetic(64, 16, seed=0)
    arrays = dict(np.load(me.data.save_npz(ds, tmp_path / "base.npz")))
    arrays["x_train"][5, 10, 10] ^= 1  # one pixel: a conversion of other data
    other = _npz(tmp_path / "other.npz", arrays)
    folder = tmp_path / "ar"
    me.data.write_array_record_dataset(folder, ds)
    before = identity.data_identity(me.data.load_array_record_dataset(folder), None)
    saved = manifest.read_manifest(folder)["files"]
    me.data.write_array_record_dataset(folder, other, overwrite=True)
    now = manifest.read_manifest(folder)["files"]
    assert now["train.array_record"]["bytes"] == saved["train.array_record"]["bytes"]
    assert now["train.array_record"]["sha256"] != saved["train.array_record"]["sha256"]
    after = identity.data_identity(me.data.load_array_record_dataset(folder), None)
    assert after["splits"]["train"] != before["splits"]["train"]
    assert after["content"] != before["content"]
