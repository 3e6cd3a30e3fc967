"""Any model: Linen, NNX and plain functions train alike; per-member hyperparameters; the zoo."""

from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
    PROBE_EXAMPLES,
    PROBE_FEATURES,
    Tiny,
    assert_masks_are_independent,
    dropout_masks,
    need_devices,
    probe_logits,
)
from flax import nnx
from jax import lax

import meshensemble as me
from meshensemble import models, testing

M = 8
STEPS = 3
TX = optax.sgd(0.1, 0.9)


X, Y = testing.learnable_dataset(16)  # 8x8 images, the class in one row and one column


def init(ens: me.Ensemble, key: jax.Array, sample: np.ndarray) -> me.EnsembleState:
    """``ens.init`` (kept as a function: the tests below compare members with members)."""
    return ens.init(key, sample)


# ------------------------------------------------------------------ one net, three forms
TinyLinen = Tiny  # Conv(4) -> Dense(16) -> Dense(10) on 8x8x1 inputs, in Linen


class TinyNNX(nnx.Module):
    """The same net in NNX (other attribute names, so the conversion is not the identity)."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
        self.hidden = nnx.Linear(8 * 8 * 4, 16, rngs=rngs)
        self.out = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.conv(x))
        x = x.reshape((x.shape[0], -1))
        return self.out(nnx.relu(self.hidden(x)))


def tiny_init(rng, x):
    """The same net as plain functions: init (its values are replaced by Linen's)."""
    k1, k2, k3 = jax.random.split(rng, 3)
    return {
        "conv": {"w": 0.1 * jax.random.normal(k1, (3, 3, 1, 4)), "b": jnp.zeros(4)},
        "h": {"w": 0.05 * jax.random.normal(k2, (256, 16)), "b": jnp.zeros(16)},
        "o": {"w": 0.1 * jax.random.normal(k3, (16, 10)), "b": jnp.zeros(10)},
    }


def tiny_apply(p, x):
    y = lax.conv_general_dilated(
        x, p["conv"]["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    y = jax.nn.relu(y + p["conv"]["b"][None, None, None])
    y = y.reshape((y.shape[0], -1))
    y = jax.nn.relu(y @ p["h"]["w"] + p["h"]["b"][None])
    return y @ p["o"]["w"] + p["o"]["b"][None]


def linen_to(form: str, p):
    """Linen params (any leading member axes) in the NNX or function form."""
    conv, dense0, dense1 = p["Conv_0"], p["Dense_0"], p["Dense_1"]
    if form == "linen":
        return p
    if form == "nnx":
        return {"conv": dict(conv), "hidden": dict(dense0), "out": dict(dense1)}
    pair = lambda d: {"w": d["kernel"], "b": d["bias"]}
    return {"conv": pair(conv), "h": pair(dense0), "o": pair(dense1)}


FORMS = {
    "linen": TinyLinen(),
    "nnx": me.NNXModel(lambda rngs: TinyNNX(rngs)),
    "function": (tiny_init, tiny_apply),  # as_model makes a FunctionModel
}


@functools.cache
def linen_start() -> me.EnsembleState:
    """The Linen members' initial state (host arrays), made by ``Ensemble.init`` once."""
    ens = me.Ensemble(TinyLinen(), TX, M, me.make_mesh(8, 1))
    return jax.device_get(init(ens, jax.random.PRNGKey(0), X[:1]))


def linen_start_one():
    """Member 0's initial Linen parameters."""
    return jax.tree.map(lambda v: v[0], linen_start().params)


def train_form(form: str, mesh_shape, strategy: str):
    """``STEPS`` steps of ``form`` started from the Linen members' initial parameters.

    The APIs do not initialise alike from one key, so every form starts from Linen's
    parameters, converted (and the optimizer state made for them).
    """
    mesh = me.make_mesh(*mesh_shape)
    model = me.as_model(FORMS[form])
    ens = me.Ensemble(model, TX, M, mesh, member_strategy=strategy)
    start = linen_start()
    params = linen_to(form, start.params)
    # the form's own init has exactly the structure and shapes of the converted params
    own, own_state = jax.eval_shape(model.init, jax.random.PRNGKey(0), X[:1])
    chex.assert_trees_all_equal_shapes_and_dtypes(own, linen_to(form, linen_start_one()))
    assert own_state == {}
    state = start.replace(params=params, opt_state=jax.jit(jax.vmap(TX.init))(params))
    state = jax.device_put(state, me.member_sharding(mesh))
    losses = []
    for _ in range(STEPS):
        state, metrics = ens.train_step(state, X, Y)
        losses.append(np.asarray(metrics["loss"]))
    return jax.device_get(state.params), np.stack(losses)


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize(
    "mesh_shape,strategy",
    [((8, 1), "loop"), ((4, 1), "vmap")],
    ids=["1_member_per_device", "2_members_per_device_vmap"],
)
def test_linen_nnx_and_functions_train_to_the_same_members(mesh_shape, strategy):
    need_devices(8)
    ref_params, ref_losses = train_form("linen", mesh_shape, strategy)
    assert np.all(ref_losses[-1] < ref_losses[0])  # it trains
    for form in ("nnx", "function"):
        params, losses = train_form(form, mesh_shape, strategy)
        chex.assert_trees_all_close(params, linen_to(form, ref_params), atol=1e-5, rtol=0)
        np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=0)


# ------------------------------------------------------------------ NNX with dropout + BN
class DropoutBNNNX(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(64, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)
        self.out = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
        x = self.bn(self.dense(x.reshape((x.shape[0], -1))))
        return self.out(self.dropout(nnx.relu(x)))


class MaskProbeNNX(nnx.Module):
    """conftest's MaskProbe in NNX: dropout masks a step writes into the kernel."""

    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(PROBE_EXAMPLES, PROBE_FEATURES, use_bias=False, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return probe_logits(self.dropout(self.dense(x)))


@pytest.fixture(scope="module")
def nnx_masks():
    """NNX dropout masks of 4 members, 2 steps, on ensemble=2 x data=4 (2 members a device)."""
    need_devices(8)
    return dropout_masks(me.NNXModel(MaskProbeNNX), me.make_mesh(ensemble=2, data=4))


@pytest.mark.parametrize("what", ["shards", "members", "steps"])
def test_nnx_dropout_draws_a_mask_per_shard_member_and_step(nnx_masks, what):
    """Fails when the step key drops the fold over `data`, the members' keys or the step."""
    assert_masks_are_independent(nnx_masks, data=4, what=what)


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("mesh_shape", [(4, 2), (2, 4)])
def test_nnx_dropout_batchnorm_members_match_single_model_training(mesh_shape):
    """NNX masks, batch statistics and gradients equal one model's, data shard by data shard
    (each member's own dropout masks and statistics, averaged over ``data``); evaluation is
    deterministic (no dropout) and leaves the statistics alone."""
    need_devices(8)
    ens = me.Ensemble(me.NNXModel(DropoutBNNNX), TX, 4, me.make_mesh(*mesh_shape))
    state = testing.assert_members_match_single_model_training(
        ens, jax.random.key(0), X, Y, 2, rtol=0, atol=1e-5
    )
    testing.assert_sharded_over_members(state, ens.mesh)
    chex.assert_shape(state.model_state["batch_stats"]["bn"]["mean"], (4, 16))
    mean = np.asarray(state.model_state["batch_stats"]["bn"]["mean"])
    assert min(np.abs(mean[0] - mean[i]).max() for i in range(1, 4)) > 0  # per member
    p1, p2 = np.asarray(ens.predict(state, X)), np.asarray(ens.predict(state, X))
    np.testing.assert_array_equal(p1, p2)
    np.testing.assert_array_equal(state.model_state["batch_stats"]["bn"]["mean"], mean)


class CallTimeRngs(nnx.Module):
    """Dropout fed at call time (``rngs=``) and a ``train`` argument, not module modes."""

    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(64, 10, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)  # keeps no stream

    def __call__(self, x, train: bool = False, rngs: nnx.Rngs | None = None):
        y = self.dense(x.reshape((x.shape[0], -1)))
        return self.dropout(y, deterministic=not train, rngs=rngs)


def test_nnx_call_time_rngs_and_train_argument():
    model = me.NNXModel(CallTimeRngs)
    params, state = jax.jit(model.init)(jax.random.key(0), X[:1])
    assert state == {}
    apply = jax.jit(lambda k, train: model.apply(params, {}, X[:4], train, k)[0], static_argnums=1)
    a, b, c = (np.asarray(apply(jax.random.key(i), True)) for i in (1, 2, 1))
    assert np.mean(a == 0) > 0.2 and np.abs(a - b).max() > 0  # masks follow the key
    np.testing.assert_array_equal(a, c)
    e = np.asarray(apply(jax.random.key(1), False))
    assert np.all(e != 0) and np.abs(e - np.asarray(apply(jax.random.key(2), False))).max() == 0


def test_as_model_routes_every_form():
    assert isinstance(me.as_model(TinyLinen()), me.LinenModel)
    assert isinstance(me.as_model(DropoutBNNNX), me.NNXModel)  # a class: cls(rngs=rngs)
    nnx_model = me.NNXModel(lambda rngs: TinyNNX(rngs))
    assert me.as_model(nnx_model) is nnx_model
    hash(nnx_model.graphdef)  # static: hashable
    fn = me.as_model((tiny_init, tiny_apply))
    assert isinstance(fn, me.FunctionModel) and not fn.stateful
    params, state = jax.eval_shape(fn.init, jax.random.PRNGKey(0), X[:1])
    assert state == {}
    logits, _ = jax.eval_shape(fn.apply, params, state, X[:2], True, jax.random.PRNGKey(1))
    chex.assert_shape(logits, (2, 10))
    instance = nnx.eval_shape(lambda: TinyNNX(nnx.Rngs(0)))  # an (abstract) instance
    with pytest.raises(TypeError, match=r"nnx.Module instance .*NNXModel\(lambda rngs: TinyNNX"):
        me.as_model(instance)
    with pytest.raises(TypeError, match="not an nnx.Module"):
        me.NNXModel(lambda rngs: TinyLinen())
    with pytest.raises(TypeError, match="takes a factory"):
        me.NNXModel(instance)
    with pytest.raises(TypeError, match="is not supported"):
        me.as_model("cnn")


# ------------------------------------------------------------------ per-member hyperparameters
class Linear(nn.Module):
    """Logistic regression on the flattened image: the cheapest model to compile."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(x.reshape((x.shape[0], -1)))


def test_per_member_learning_rates_equal_separate_runs():
    need_devices(2)
    lrs = np.array([0.01, 0.05, 0.1, 0.2], np.float32)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
    mesh = me.make_mesh(ensemble=2, data=1, devices=jax.devices()[:2])
    ens = me.Ensemble(Linear(), tx, 4, mesh, hyperparams={"learning_rate": lrs})
    state = init(ens, jax.random.PRNGKey(1), X[:1])
    hp = state.opt_state.hyperparams["learning_rate"]
    np.testing.assert_allclose(np.asarray(hp), lrs)
    assert hp.sharding.is_equivalent_to(me.member_sharding(mesh), 1)
    start = jax.device_get(state.params)
    for _ in range(STEPS):
        state, metrics = ens.train_step(state, X, Y)

    @jax.jit
    def step(p, o, lr):
        def loss(p):
            logits = Linear().apply({"params": p}, X)
            return optax.softmax_cross_entropy_with_integer_labels(logits, Y).mean()

        value, g = jax.value_and_grad(loss)(p)
        u, o = optax.sgd(lr, 0.9).update(g, o, p)
        return optax.apply_updates(p, u), o, value

    for i, lr in enumerate(lrs):
        p = jax.tree.map(lambda v, i=i: v[i], start)
        o = optax.sgd(lr, 0.9).init(p)
        for _ in range(STEPS):
            p, o, value = step(p, o, lr)
        member = jax.tree.map(lambda v, i=i: np.asarray(v)[i], state.params)
        chex.assert_trees_all_close(member, jax.device_get(p), atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(metrics["loss"])[i], value, atol=1e-5)


_INJECTED = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)


@pytest.mark.parametrize(
    "tx,hyperparams,match",
    [
        (TX, {"learning_rate": [0.1] * 4}, r"optax.inject_hyperparams.*state is a tuple"),
        (_INJECTED, {"lr": [0.1] * 4}, r"'lr'.* known: learning_rate, momentum$"),
        (_INJECTED, {"learning_rate": [0.1] * 3}, r"shape \(3,\); .* shape \(4,\)"),
        (_INJECTED, {"learning_rate": 0.1}, r"shape \(\); give one value per member"),
        (_INJECTED, {"learning_rate": [[0.1] * 4]}, r"shape \(1, 4\)"),
        (_INJECTED, {"momentum": [0.9, np.nan, 0.9, 0.9]}, r"'momentum'.* non-finite"),
        (_INJECTED, {"learning_rate": ["a"] * 4}, r"dtype <U1; give numbers"),
        (
            optax.inject_hyperparams(optax.sgd)(learning_rate=optax.linear_schedule(0.1, 0, 9)),
            {"learning_rate": [0.1] * 4},
            r"'learning_rate'.* is a schedule",
        ),
    ],
    ids=["not_injected", "unknown", "short", "scalar", "2d", "nan", "strings", "schedule"],
)
def test_bad_hyperparams(tx, hyperparams, match):
    need_devices(4)
    with pytest.raises(ValueError, match=match) as info:
        me.Ensemble(TinyLinen(), tx, 4, me.make_mesh(4, 1), hyperparams=hyperparams)
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------ the zoo
@pytest.mark.slow
def test_resnet_trains_in_an_ensemble_and_updates_batch_stats():
    need_devices(2)
    model = models.ResNet(stage_sizes=(1, 1), num_filters=4)
    mesh = me.make_mesh(ensemble=2, data=1, devices=jax.devices()[:2])
    ens = me.Ensemble(model, optax.sgd(0.05), 2, mesh)
    x = np.random.default_rng(0).normal(size=(2, 8, 8, 3)).astype(np.float32)
    y = np.array([1, 7], np.int32)
    state = init(ens, jax.random.PRNGKey(0), x[:1])
    before = jax.device_get(state)
    state, metrics = ens.train_step(state, x, y)
    chex.assert_tree_all_finite(state)
    chex.assert_shape(metrics["loss"], (2,))
    stats = state.model_state["batch_stats"]
    assert set(stats) == {"BatchNorm_0", "ResidualBlock_0", "ResidualBlock_1"}
    assert "BatchNorm_2" in stats["ResidualBlock_1"]  # the projection shortcut (stride 2)
    moved = jax.tree.map(
        lambda a, b: float(np.abs(np.asarray(a) - b).max()),
        stats,
        before.model_state["batch_stats"],
    )
    assert min(jax.tree.leaves(moved)) > 0  # every running statistic was updated
    grads_moved = jax.tree.map(
        lambda a, b: float(np.abs(np.asarray(a) - b).max()), state.params, before.params
    )
    assert max(jax.tree.leaves(grads_moved)) > 0


def test_howto_cnn_is_the_flax_cnn_and_registry():
    key, x = jax.random.PRNGKey(0), jnp.zeros((1, 28, 28, 1))
    a = jax.eval_shape(models.CNN().init, key, x)
    b = jax.eval_shape(models.HowtoCNN().init, key, x)
    chex.assert_trees_all_equal_shapes_and_dtypes(a, b)
    assert issubclass(models.HowtoCNN, models.CNN)
    assert set(models.REGISTRY) >= {"cnn", "mlp", "howto_cnn", "resnet"}
    assert isinstance(models.get_model("resnet"), models.ResNet)
    shapes = jax.eval_shape(models.ResNet().init, key, jnp.zeros((1, 32, 32, 3)))
    assert shapes["params"]["Dense_0"]["kernel"].shape == (64, 10)  # ResNet-8: 16, 32, 64


# Tiny forms of every zoo model (8x8x1 inputs); a model added to the registry must be added
# here. The MLP with BatchNorm runs in the default suite (the ResNet has had its axis_name
# from the start): BatchNorm statistics are what depends on how the batch is split.
ZOO = {
    "mlp": lambda: models.MLP((16,), batch_norm=True),
    "resnet": lambda: models.ResNet(stage_sizes=(1,), num_filters=4),
    "cnn": lambda: models.CNN(),
    "howto_cnn": lambda: models.HowtoCNN(),
    "vit": lambda: models.ViT(patch_size=4, hidden=16, num_heads=2, num_layers=1, mlp_dim=32),
    "resnet20": lambda: models.ResNet20(stage_sizes=(1,), num_filters=4),
    "wrn": lambda: models.WideResNet(depth=10, width=1),
    "be_cnn": lambda: models.BatchEnsembleCNN(),
    "be_mlp": lambda: models.BatchEnsembleMLP((16,)),
}
FAST = {"mlp"}


def test_the_zoo_list_covers_the_registry():
    assert set(ZOO) == set(models.REGISTRY)


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in ZOO]
)
def test_every_zoo_model_is_mesh_invariant(name):
    """Two SGD steps of 2 members on data=1 and data=2 agree: BatchNorm (MLP's too) averages
    its statistics over the data shards, so a member sees the whole batch either way."""
    need_devices(4)

    def train(mesh):
        ens = me.Ensemble(ZOO[name](), optax.sgd(0.1), 2, mesh, member_strategy="vmap")
        state = ens.init(jax.random.key(0), X[:1])
        for _ in range(2):
            state, metrics = ens.train_step(state, X, Y)
        return {"state": (state.params, state.model_state), "loss": metrics["loss"]}

    testing.assert_mesh_invariant(train, [(2, 1), (2, 2)], rtol=1e-4, atol=1e-5)
