"""On-device augmentation (data/augment.py), bagging (training/order.py), label smoothing."""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import need_devices, small_config

import meshensemble as me
from meshensemble.core.mesh import parse_mesh
from meshensemble.data import augment as aug
from meshensemble.testing import single_model_train_step
from meshensemble.training import Feeder, TrainConfig, build_ensemble, train
from meshensemble.training.identity import run_fields
from meshensemble.training.order import bags, epoch_order

DATA = me.data.synthetic(num_train=192, num_test=40, seed=0)
SHIFT = aug.make_augment("shift", 2)


def tiny(tmp_path, name="run", **kw) -> TrainConfig:
    base = dict(mesh="ensemble=2,data=4", checkpoint=False, eval_batch_size=16, augment="shift")
    return small_config(tmp_path / name, **(base | kw))


def params_of(result):
    return jax.device_get(result.state.params)


@functools.partial(jax.jit, static_argnums=(0, 5))
def augment_batch(fn, key, step, images, start=0, total=None):
    """``aug.augment_batch`` compiled as one program, as a step runs it (op by op, each of
    its primitives compiles apart: ~1 s of this module's reference computations)."""
    return aug.augment_batch(fn, key, step, images, start, total)


# ------------------------------------------------------------------ the functions
def test_shift_translates_with_zero_fill_within_the_bound():
    x = jnp.arange(1, 1 + 8 * 8, dtype=jnp.float32).reshape(8, 8, 1)
    seen = set()
    for i in range(40):
        y = np.asarray(aug.random_shift(jax.random.key(i), x, 2))
        # y is x moved by (dy, dx) in [-2, 2]^2: find the shift from the first nonzero
        found = [
            (dy, dx)
            for dy in range(-2, 3)
            for dx in range(-2, 3)
            if np.array_equal(y, np.asarray(_moved(x, dy, dx)))
        ]
        assert len(found) == 1, i
        seen.add(found[0])
    assert len(seen) > 10  # many of the 25 shifts are drawn
    assert aug.random_shift(jax.random.key(0), x, 0) is x


def _moved(x, dy, dx):
    h, w = x.shape[:2]
    p = jnp.pad(x, ((2, 2), (2, 2), (0, 0)))
    return p[2 + dy : 2 + dy + h, 2 + dx : 2 + dx + w]


def test_crop_flip_crops_the_padded_image_and_mirrors_about_half():
    x = jnp.arange(1, 1 + 6 * 6 * 3, dtype=jnp.float32).reshape(6, 6, 3)
    flips = 0
    for i in range(60):
        y = np.asarray(aug.random_crop_flip(jax.random.key(i), x, 1))
        plain = [_moved1(x, dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
        if any(np.array_equal(y, p) for p in plain):
            continue
        assert any(np.array_equal(y[:, ::-1], p) for p in plain), i
        flips += 1
    assert 15 < flips < 45


def _moved1(x, dy, dx):
    p = np.pad(np.asarray(x), ((1, 1), (1, 1), (0, 0)))
    return p[1 + dy : 1 + dy + x.shape[0], 1 + dx : 1 + dx + x.shape[1]]


def test_make_augment_names_and_errors():
    assert aug.make_augment("none") is None
    assert aug.make_augment("shift", 3) == aug.make_augment("shift", 3)
    assert aug.make_augment("shift", 3) != aug.make_augment("crop_flip", 3)
    with pytest.raises(ValueError, match="augment='rotate' is unknown; choose one of none"):
        aug.make_augment("rotate")
    with pytest.raises(ValueError, match="augment_shift=-1 must be an integer >= 0"):
        aug.make_augment("shift", -1)
    with pytest.raises(ValueError, match="augment_shift=-1"):
        TrainConfig(augment="shift", augment_shift=-1).validate()
    with pytest.raises(ValueError, match="label_smoothing=1.0 must be in \\[0, 1\\)"):
        TrainConfig(label_smoothing=1.0).validate()


def test_augment_batch_rows_do_not_depend_on_the_split():
    x = jnp.asarray(DATA.train_images[:8], jnp.float32)
    key = jax.random.key(3)
    whole = augment_batch(SHIFT, key, 5, x)
    assert not np.array_equal(whole, x)  # it changes the batch
    parts = [augment_batch(SHIFT, key, 5, x[i : i + 2], i, 8) for i in range(0, 8, 2)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    assert not np.array_equal(augment_batch(SHIFT, key, 6, x), whole)  # a new step
    assert not np.array_equal(augment_batch(SHIFT, jax.random.key(4), 5, x), whole)


# ------------------------------------------------------------------ in the step
def _probe_ensemble(mesh, augment=SHIFT, members=4):
    """A zero-initialised linear model: its first SGD step reveals the (augmented) inputs."""

    def init(key, x):
        return {"w": jnp.zeros((x[0].size, 10))}

    def apply(params, x):
        return x.reshape(x.shape[0], -1) @ params["w"]

    model = me.FunctionModel(init, apply)
    return me.Ensemble(
        model, optax.sgd(0.1), members, mesh, input_transform=me.data.normalize, augment=augment
    )


@pytest.mark.slow  # among the heaviest default tests, measured
def test_each_member_and_step_sees_its_own_augmentation():
    need_devices(8)
    x, y = DATA.train_images[:16], DATA.train_labels[:16]
    ens = _probe_ensemble(me.make_mesh(ensemble=4, data=2))
    state = ens.init(jax.random.key(0), x[:1])
    rngs = np.asarray(state.rng)
    # what member i's step trains on, reproduced from its key and step
    xs = me.data.normalize(x)
    seen = [augment_batch(SHIFT, jnp.asarray(rngs[i]), 0, xs) for i in range(4)]
    assert all(not np.array_equal(s, xs) for s in seen)
    assert len({np.asarray(s).tobytes() for s in seen}) == 4
    step1 = augment_batch(SHIFT, jnp.asarray(rngs[0]), 1, xs)
    assert not np.array_equal(step1, seen[0])
    # the gradient of the linear model is x^T (softmax - onehot): it reveals the inputs
    state, _ = ens.train_step(state, x, y)
    w = np.asarray(state.params["w"])
    for i in range(4):
        want = _linear_sgd_step(np.asarray(seen[i]), y)
        np.testing.assert_allclose(w[i], want, atol=1e-6)


def test_prediction_never_augments():
    """predict, predict_members (what --calibrate and OOD scoring read) and evaluate of an
    ensemble built with augment equal those of the same state without it."""
    need_devices(4)
    x, y = DATA.test_images[:16], DATA.test_labels[:16]
    mesh = me.make_mesh(ensemble=2, data=2)
    plain, augmented = _probe_ensemble(mesh, None, 2), _probe_ensemble(mesh, SHIFT, 2)
    state = plain.init(jax.random.key(0), x[:1])
    state, _ = plain.train_step(state, DATA.train_images[:16], DATA.train_labels[:16])
    for call in (
        lambda e: e.predict(state, x),
        lambda e: e.predict_members(state, x, logits=True),
        lambda e: e.evaluate(state, x, y, batch_size=16)["nll"],
    ):
        np.testing.assert_array_equal(np.asarray(call(augmented)), np.asarray(call(plain)))


def _linear_sgd_step(x, y):
    flat = x.reshape(x.shape[0], -1)
    p = np.full((x.shape[0], 10), 0.1)
    p[np.arange(len(y)), y] -= 1
    return -0.1 * flat.T @ p / len(y)


@pytest.mark.slow
def test_members_are_the_same_on_data_1_2_4_and_streamed(tmp_path):
    need_devices(8)
    runs = {
        f"data={d}": train(tiny(tmp_path, f"d{d}", mesh=f"ensemble=2,data={d}", max_steps=4), DATA)
        for d in (1, 2, 4)
    }
    runs["streamed"] = train(tiny(tmp_path, "s", max_steps=4, streaming=True), DATA)
    plain = train(tiny(tmp_path, "p", max_steps=4, augment="none"), DATA)
    ref = params_of(runs["data=1"])
    for name, result in runs.items():
        chex.assert_trees_all_close(params_of(result), ref, atol=1e-5, custom_message=name)
    assert not np.allclose(params_of(plain)["Dense_0"]["kernel"], ref["Dense_0"]["kernel"])


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_resumed_run_equals_the_uninterrupted_one_bitwise(tmp_path):
    need_devices(8)
    whole = train(tiny(tmp_path, "whole", checkpoint=True, max_steps=9), DATA)
    split = tiny(tmp_path, "split", checkpoint=True, max_steps=4)
    train(split, DATA)
    resumed = train(dataclasses.replace(split, max_steps=9), DATA)
    assert resumed.history[-1]["step"] == 9
    chex.assert_trees_all_equal(params_of(resumed), params_of(whole))


@pytest.mark.slow  # among the heaviest default tests, measured
def test_members_match_single_models_trained_on_their_augmented_batches():
    need_devices(8)
    mesh = me.make_mesh(ensemble=2, data=2)
    ens = me.Ensemble(
        me.models.MLP(),
        optax.sgd(0.05, 0.9),
        4,
        mesh,
        input_transform=me.data.normalize,
        augment=SHIFT,
    )
    x, y = DATA.train_images[:32], DATA.train_labels[:32]
    key = jax.random.key(7)
    state = ens.init(key, x[:1])
    rngs = np.asarray(state.rng)
    for _ in range(3):
        state, _ = ens.train_step(state, x, y)
    got = jax.device_get(state.params)
    step = single_model_train_step(ens.model, ens.optimizer, data_shards=2)
    xs = me.data.normalize(x)
    for i, k in enumerate(jax.random.split(key, 4)):
        params, model_state = jax.jit(ens.model.init)(k, xs[:1])
        opt_state = ens.optimizer.init(params)
        rng = jnp.asarray(rngs[i])
        for s in range(3):
            xa = augment_batch(SHIFT, rng, s, xs)  # the global batch, then the shards
            params, model_state, opt_state, _ = step(params, model_state, opt_state, xa, y, rng, s)
        chex.assert_trees_all_close(
            jax.tree.map(lambda v, i=i: v[i], got), params, atol=1e-5, custom_message=f"m{i}"
        )


# ------------------------------------------------------------------ bagging
@pytest.mark.slow  # among the heaviest default tests, measured
def test_bootstrap_bags_are_with_replacement_per_member_and_mesh_free(tmp_path):
    need_devices(8)
    n, m = 6000, 4
    key = jax.random.key(1)
    order = np.asarray(epoch_order(key, 1, n, m, bootstrap=True))
    bag = np.asarray(bags(key, n, m))
    assert order.shape == (m, n)
    for i in range(m):
        unique = len(np.unique(order[i])) / n
        assert 0.60 < unique < 0.66, unique  # 1 - 1/e
        np.testing.assert_array_equal(np.sort(order[i]), np.sort(bag[i]))  # a reorder of the bag
    assert len({r.tobytes() for r in bag}) == m
    later = np.asarray(epoch_order(key, 2, n, m, bootstrap=True))
    assert not np.array_equal(later, order)  # a new order each epoch ...
    np.testing.assert_array_equal(np.sort(later, 1), np.sort(order, 1))  # ... of the same bags
    # the feeder draws the same orders on any mesh; bootstrap makes batches per member
    cfgs = [
        tiny(tmp_path, f"b{d}", augment="none", bootstrap=True, mesh=f"ensemble={e},data={d}")
        for e, d in ((4, 2), (1, 8), (2, 1))
    ]
    orders = []
    for cfg in cfgs:
        mesh = me.make_mesh(**parse_mesh(cfg.mesh))
        feeder = Feeder(build_ensemble(cfg, mesh, 192), DATA, cfg, key, 1, 6)
        assert feeder.per_member
        orders.append(np.asarray(feeder.order(3)))
    for o in orders[1:]:
        np.testing.assert_array_equal(o, orders[0])
    np.testing.assert_array_equal(orders[0], np.asarray(epoch_order(key, 3, 192, 4, True)))


def test_orders_without_bootstrap_are_unchanged():
    key = jax.random.key(5)
    fold = jax.random.fold_in(key, 3)
    np.testing.assert_array_equal(epoch_order(key, 3, 100, 0), jax.random.permutation(fold, 100))
    want = jax.vmap(lambda k: jax.random.permutation(k, 100))(jax.random.split(fold, 4))
    np.testing.assert_array_equal(epoch_order(key, 3, 100, 4), want)
    with pytest.raises(ValueError, match="bootstrap=True needs per-member orders"):
        epoch_order(key, 1, 100, 0, bootstrap=True)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_bootstrap_run_trains_and_a_resume_with_other_values_is_refused(tmp_path):
    need_devices(8)
    cfg = tiny(tmp_path, "bag", bootstrap=True, checkpoint=True, max_steps=2)
    assert train(cfg, DATA).history[-1]["step"] == 2
    fields = run_fields(cfg)
    assert fields["bootstrap"] is True and fields["augment"] == "shift"
    assert fields["augment_shift"] == 2 and fields["label_smoothing"] == 0.0
    assert "augment_shift" not in run_fields(dataclasses.replace(cfg, augment="none"))
    for change, text in [
        (dict(bootstrap=False), "bootstrap=True, this run has bootstrap=False"),
        (dict(augment="crop_flip"), "augment='shift', this run has augment='crop_flip'"),
        (dict(augment_shift=3), "augment_shift=2, this run has augment_shift=3"),
        (dict(label_smoothing=0.1), "label_smoothing=0.0, this run has label_smoothing=0.1"),
    ]:
        with pytest.raises(ValueError, match=text):
            train(dataclasses.replace(cfg, **change), DATA)


# ------------------------------------------------------------------ label smoothing
def test_label_smoothing_is_the_smoothed_cross_entropy_and_off_by_default():
    logits = jnp.asarray([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]])
    labels = jnp.asarray([0, 2])
    got = me.tasks.Classification(label_smoothing=0.3).loss(logits, labels)
    logp = jax.nn.log_softmax(logits)
    target = 0.7 * jax.nn.one_hot(labels, 3) + 0.1
    np.testing.assert_allclose(got, -(target * logp).sum(-1), rtol=1e-6)
    mesh = me.make_mesh(ensemble=1, data=1)
    plain = build_ensemble(TrainConfig(model="mlp"), mesh, 100).loss_fn
    np.testing.assert_array_equal(plain(logits, labels), me.softmax_cross_entropy(logits, labels))
    ens = build_ensemble(TrainConfig(model="mlp", label_smoothing=0.3), mesh, 100)
    assert ens.task.label_smoothing == 0.3
    np.testing.assert_allclose(ens.loss_fn(logits, labels), got)
