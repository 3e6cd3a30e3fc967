"""Preprocessing, OOD inputs and augmentation that follow the data (issue 39), on any input.

Per-channel normalisation statistics from the training split (a record a run can store and
apply later, jit-able), tabular standardisation on scikit-learn's wine data, the synthetic
OOD shifts for images and tables (MNIST's noise and inverted sets unchanged), OOD data of
another dataset refused unless it has the same input shape, and crop_flip on images of any
height, width and channels: per member and the same on every mesh.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import need_devices

import meshensemble as me
from meshensemble.data import DataError, ood, preprocess
from meshensemble.data import augment as aug


def _images(n=40, shape=(6, 5, 3), seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, *shape), dtype=np.uint8)


# ------------------------------------------------------------------ normalisation
def test_per_channel_statistics_come_from_the_training_split_and_round_trip(monkeypatch):
    x = _images()
    x[..., 2] = 255  # a constant channel: only centred
    monkeypatch.setattr(preprocess, "CHUNK", 7)  # the chunked sums equal numpy's whole ones
    norm = preprocess.fit_normalization(x)
    want = (x / 255.0).reshape(-1, 3)
    np.testing.assert_allclose(norm.mean, want.mean(0), rtol=1e-12)
    np.testing.assert_allclose(norm.std[:2], want.std(0)[:2], rtol=1e-9)
    assert norm.std[2] == 1.0 and norm.scale == 1 / 255
    record = json.loads(json.dumps(norm.record()))  # what config.json holds
    again = preprocess.Normalization.from_record(record)
    assert again == norm
    y = np.asarray(jax.jit(again.apply)(x))  # inside a compiled program, as in an artifact
    assert y.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_allclose(y[..., :2].reshape(-1, 2).mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(y[..., :2].reshape(-1, 2).std(0), 1, atol=1e-4)
    with pytest.raises(DataError, match="kind 'zscore'"):
        preprocess.Normalization.from_record(record | {"kind": "zscore"})
    with pytest.raises(ValueError, match="normalization of 3 channels got inputs of shape"):
        again.apply(np.zeros((2, 4, 4, 1), np.uint8))


def test_tabular_standardisation_of_real_wine_features():
    datasets = pytest.importorskip("sklearn.datasets")
    x, _ = datasets.load_wine(return_X_y=True)
    x = x.astype(np.float32)
    a, b, norm = preprocess.standardize_features(x[:150], x[150:])
    assert norm.scale == 1.0 and len(norm.mean) == 13
    np.testing.assert_allclose(a.mean(0), 0, atol=1e-4)
    np.testing.assert_allclose(a.std(0), 1, atol=1e-3)
    want = (x[150:] - x[:150].mean(0, dtype=np.float64)) / x[:150].std(0, dtype=np.float64)
    np.testing.assert_allclose(b, want, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ OOD
def test_ood_shifts_keep_shape_and_dtype_for_images_and_tables():
    from meshensemble.tasks.ood import NOISE_SEED, ood_images

    mnist = me.data.synthetic(20, 8)
    for name in ("noise", "inverted"):  # MNIST's OOD sets, the same arrays
        got, _ = ood.ood_inputs(name, mnist, seed=NOISE_SEED)
        np.testing.assert_array_equal(got, ood_images(name, mnist.x_test))
    x = _images(4, (6, 5, 3))
    assert np.array_equal(ood.shift_inputs(x, "hflip"), x[:, :, ::-1])
    assert np.array_equal(ood.shift_inputs(x, "vflip"), x[:, ::-1])
    low = ood.shift_inputs(x, "contrast")
    assert low.dtype == np.uint8 and low.std() < 0.5 * x.std()
    table = np.random.default_rng(1).normal(size=(10, 4)).astype(np.float32)
    for name in ("noise", "inverted", "contrast"):
        out = ood.shift_inputs(table, name)
        assert (
            out.shape == table.shape and out.dtype == np.float32 and not np.array_equal(out, table)
        )
    with pytest.raises(DataError) as err:
        ood.shift_inputs(table, "hflip")
    assert "mirrors images [N, H, W, C]; these inputs have shape (10, 4)" in str(err.value)


def test_ood_data_of_another_shape_is_refused_naming_both(tmp_path):
    mnist = me.data.synthetic(20, 8)
    other = me.data.save_npz(me.data.synthetic(20, 5, seed=2), tmp_path / "other.npz")
    x, note = ood.load_ood(other, mnist)
    assert x.shape == (5, 28, 28, 1) and "other.npz" in note
    rgb = _images(12, (28, 28, 3))
    np.savez(tmp_path / "rgb.npz", x_train=rgb[:8], y_train=np.arange(8) % 2, x_test=rgb[8:],
             y_test=np.arange(4) % 2)  # fmt: skip
    with pytest.raises(DataError) as err:
        ood.ood_inputs(str(tmp_path / "rgb.npz"), mnist)
    text = str(err.value)
    assert "inputs of shape (28, 28, 3) uint8; expected (28, 28, 1) uint8" in text
    assert "\n" not in text


def test_an_ood_npz_may_hold_its_inputs_alone(tmp_path):
    mnist = me.data.synthetic(20, 8)
    inputs = _images(6, (28, 28, 1))
    for key, saved in (("x_test", inputs), ("images", inputs[..., 0]), ("x", inputs)):
        np.savez(tmp_path / f"{key}.npz", **{key: saved})
        x, note = ood.load_ood(tmp_path / f"{key}.npz", mnist)
        assert np.array_equal(x, inputs) and note.endswith(f"{key}.npz: {key} [6, 28, 28, 1] uint8")
    np.savez(tmp_path / "none.npz", y=np.arange(3))
    want = r"none\.npz: no inputs \(found keys y; expected one of x_test, images, x, e\.g\. "
    with pytest.raises(DataError, match=want + r"np\.savez\(path, x_test=inputs\)\)$"):
        ood.load_ood(tmp_path / "none.npz", mnist)
    for path, what in ((tmp_path / "gone.npz", "no such file"), (tmp_path, "is a directory")):
        with pytest.raises(DataError, match=f"^{re.escape(str(path))}: {what} \\(pass an .npz"):
            me.data.load_npz_inputs(path)


# ------------------------------------------------------------------ crop_flip on any image
@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("shape", [(10, 12, 3), (7, 5, 1), (8, 8, 4)])
def test_crop_flip_takes_any_height_width_and_channels_and_ignores_the_split(shape):
    fn = aug.make_augment("crop_flip", 2)
    x = jnp.asarray(_images(8, shape), jnp.float32)
    key = jax.random.key(1)
    whole = jax.jit(lambda x: aug.augment_batch(fn, key, 3, x))(x)
    assert whole.shape == x.shape and not np.array_equal(whole, x)
    parts = [aug.augment_batch(fn, key, 3, x[i : i + 4], i, 8) for i in (0, 4)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_crop_flip_members_differ_and_train_the_same_on_every_mesh():
    need_devices(4)
    x = _images(16, (6, 10, 3))
    y = np.arange(16) % 3

    def init(key, x):
        return {"w": jnp.zeros((x[0].size, 3))}

    model = me.FunctionModel(init, lambda p, x: x.reshape(x.shape[0], -1) @ p["w"])
    fn = aug.make_augment("crop_flip", 2)

    def train(mesh):
        ens = me.Ensemble(model, optax.sgd(0.1), 2, mesh, input_transform=me.data.normalize,
                          augment=fn)  # fmt: skip
        state = ens.init(jax.random.key(0), x[:1])
        for _ in range(2):
            state, _ = ens.train_step(state, x, y)
        return {"params": state.params}

    me.testing.assert_mesh_invariant(train, [(2, 1), (2, 2)], rtol=1e-5, atol=1e-6)
    w = np.asarray(train(me.make_mesh(2, 1))["params"]["w"])
    assert not np.allclose(w[0], w[1])  # each member drew its own crops and flips
