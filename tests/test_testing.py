"""meshensemble.testing: each helper passes on a right ensemble and fails on a wrong one."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import Tiny, need_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshensemble as me
from meshensemble import testing

M = 4
TX = optax.sgd(0.1, 0.9)
X, Y = testing.learnable_dataset(16)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class DropoutMLP(nn.Module):
    """Dense -> dropout -> dense: the per-shard masks decide its gradients."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(16)(x.reshape((x.shape[0], -1))))
        return nn.Dense(10)(nn.Dropout(0.5, deterministic=not train)(x))


class WithBatchNorm(nn.Module):
    """A model with state (``batch_stats``) besides its parameters."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(8)(x.reshape((x.shape[0], -1)))
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(10)(x)


def ensemble(model=None, mesh_shape=(2, 2), **kw) -> me.Ensemble:
    return me.Ensemble(model or Tiny(), TX, M, me.make_mesh(*mesh_shape), **kw)


def host_state(state: me.EnsembleState, **changes) -> me.EnsembleState:
    """``state`` on the host as numpy, with fields replaced by ``fn(field)`` for each change."""
    host = jax.device_get(state)
    return host.replace(**{name: fn(getattr(host, name)) for name, fn in changes.items()})


def swap_members(tree):
    """Members 0 and 1 exchanged in every leaf."""
    order = np.array([1, 0, *range(2, M)])
    return jax.tree.map(lambda v: np.asarray(v)[order], tree)


# ------------------------------------------------------------------ devices
def test_set_fake_cpu_devices_is_a_no_op_at_the_same_count_and_too_late_otherwise():
    testing.set_fake_cpu_devices(jax.device_count())  # conftest already set 8
    with pytest.raises(RuntimeError, match=r"^too late: JAX already started with 8 devices; ") as e:
        testing.set_fake_cpu_devices(3)
    assert "set_fake_cpu_devices(3) in conftest.py" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="fake devices=0 is not a positive whole number"):
        testing.set_fake_cpu_devices(0)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_set_fake_cpu_devices_in_a_fresh_process():
    """Before JAX starts it gives the devices; after a computation it says it is too late."""
    code = (
        "import meshensemble.testing as t; t.set_fake_cpu_devices(3); import jax; "
        "print(jax.device_count(), jax.devices()[0].platform)"
    )
    late = "import jax.numpy as jnp; jnp.zeros(1).block_until_ready(); " + code
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    run = lambda c: subprocess.run(
        [sys.executable, "-c", c], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
    )
    ok = run(code)
    assert ok.returncode == 0 and ok.stdout.split() == ["3", "cpu"], ok.stderr
    bad = run("import jax; jax.config.update('jax_platforms', 'cpu'); " + late)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1] == (
        "RuntimeError: too late: JAX already started with 1 devices; call "
        "set_fake_cpu_devices(3) in conftest.py before anything imports jax.numpy or runs a "
        "computation"
    )


def test_need_devices_skips_with_a_reason():
    assert testing.need_devices(jax.device_count()) is None
    with pytest.raises(pytest.skip.Exception, match=r"needs 9 devices, have 8; set_fake_cpu"):
        testing.need_devices(9)


# ------------------------------------------------------------------ trees and shardings
def test_assert_trees_close_fetches_sharded_arrays_and_names_the_leaf():
    need_devices(4)
    ens = ensemble()
    state = ens.init(jax.random.key(0), X[:1])
    host = jax.device_get(state)
    testing.assert_trees_close(state, host, rtol=0, atol=0)  # global arrays vs numpy
    bumped = jax.tree.map(np.array, host)  # a writable copy
    bumped.params["Dense_1"]["bias"][1, 4] += 1e-3
    with pytest.raises(AssertionError, match=r"differ in leaves 'params/Dense_1/bias'"):
        testing.assert_trees_close(state, bumped)
    testing.assert_trees_close(state, bumped, atol=2e-3)
    with pytest.raises(AssertionError, match="tree structs"):
        testing.assert_trees_close(state.params, {"Dense_1": host.params["Dense_1"]})


def test_assert_sharded_over_members_names_the_misplaced_leaf():
    need_devices(4)
    ens = ensemble()
    state = ens.init(jax.random.key(0), X[:1])
    testing.assert_sharded_over_members(state, ens.mesh)
    state, _ = ens.train_step(state, X, Y)
    testing.assert_sharded_over_members(state, ens.mesh)
    replicated = me.replicated_sharding(ens.mesh)
    params = {**state.params, "Dense_0": {**state.params["Dense_0"]}}
    params["Dense_0"]["bias"] = jax.device_put(params["Dense_0"]["bias"], replicated)
    with pytest.raises(AssertionError, match=r"\.params\['Dense_0'\]\['bias'\] of shape \(4, 16\)"):
        testing.assert_sharded_over_members(state.replace(params=params), ens.mesh)
    with pytest.raises(AssertionError, match=r"\.step is a ndarray, not a jax.Array"):
        testing.assert_sharded_over_members(jax.device_get(state), ens.mesh)
    other = me.make_mesh(2, 2, devices=jax.devices()[4:])  # the same shape, other devices
    with pytest.raises(AssertionError, match=r"\.step of shape \(4,\) has sharding"):
        testing.assert_sharded_over_members(state, other)
    reshaped = me.make_mesh(4, 1)  # another shape: said plainly
    with pytest.raises(AssertionError, match=r"is on another mesh, \{'ensemble': 2, 'data': 2"):
        testing.assert_sharded_over_members(state, reshaped)


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 1, 2)], ids=["fsdp", "fsdp+model"])
def test_assert_sharded_over_members_understands_fsdp_and_model_specs(mesh_shape):
    need_devices(4)
    vit = me.models.ViT(patch_size=4, hidden=16, num_heads=2, num_layers=1, mlp_dim=32)
    mesh = me.make_mesh(*mesh_shape[:2], model=mesh_shape[2] if len(mesh_shape) > 2 else None)
    ens = me.Ensemble(vit, TX, 2, mesh, shard_members=True)
    state = ens.init(jax.random.key(0), X[:1])
    layout = ens.state_specs(X[:1])  # the sharded layout is read off the input shape
    specs = jax.tree.leaves(layout, is_leaf=lambda v: isinstance(v, P))
    assert any(len(s) > 1 for s in specs)  # some leaves are split inside their member
    testing.assert_sharded_over_members(state, ens.mesh)
    testing.assert_sharded_over_members(state, ens.mesh, layout)
    kernel = state.params["head"]["kernel"]
    # the member axis over data instead of ensemble: refused, with or without specs
    wrong = jax.device_put(kernel, NamedSharding(ens.mesh, P("data")))
    bad = state.replace(params={**state.params, "head": {**state.params["head"], "kernel": wrong}})
    for specs_arg in (None, layout):
        with pytest.raises(AssertionError, match=r"\['head'\]\['kernel'\] of shape"):
            testing.assert_sharded_over_members(bad, ens.mesh, specs_arg)
    # members whole where the spec splits them: only the exact check notices
    whole = jax.device_put(state, me.member_sharding(ens.mesh))
    testing.assert_sharded_over_members(whole, ens.mesh)
    with pytest.raises(AssertionError, match="the state's spec"):
        testing.assert_sharded_over_members(whole, ens.mesh, layout)


# ------------------------------------------------------------------ members vs single models
@pytest.mark.slow  # among the heaviest default tests, measured
def test_assert_members_equal_single_models_catches_swapped_and_perturbed_members():
    need_devices(4)
    ens = ensemble(WithBatchNorm())
    key = jax.random.key(7)
    state = ens.init(key, X[:1])
    testing.assert_members_equal_single_models(ens, state, key, X[:1])
    with pytest.raises(AssertionError, match=r"^member 0 is not the single model .*params/"):
        testing.assert_members_equal_single_models(
            ens, host_state(state, params=swap_members), key, X[:1]
        )

    nudged = jax.tree.map(np.array, jax.device_get(state))  # a writable host copy
    nudged.model_state["batch_stats"]["BatchNorm_0"]["var"][2, 3] += 1e-6
    with pytest.raises(
        AssertionError, match=r"^member 2 .*'model_state/batch_stats/BatchNorm_0/var'"
    ):
        testing.assert_members_equal_single_models(ens, nudged, key, X[:1])
    testing.assert_members_equal_single_models(ens, nudged, key, X[:1], atol=1e-5)
    with pytest.raises(AssertionError, match="^member 0"):
        testing.assert_members_equal_single_models(ens, state, jax.random.key(8), X[:1])


def test_single_model_train_step_is_a_plain_optax_step():
    """One shard: the step is value_and_grad + optax on the model alone."""
    model = Tiny()
    params = jax.jit(model.init)(jax.random.PRNGKey(3), X[:1])["params"]
    step = testing.single_model_train_step(model, TX)
    p, ms, o, loss = step(params, {}, TX.init(params), X, Y, jax.random.PRNGKey(0), 0)

    def loss_of(p):
        logits = model.apply({"params": p}, X)
        return optax.softmax_cross_entropy_with_integer_labels(logits, Y).mean()

    value, grads = jax.jit(jax.value_and_grad(loss_of))(params)  # one program, not op by op
    updates, _ = TX.update(grads, TX.init(params), params)
    testing.assert_trees_close(p, optax.apply_updates(params, updates), rtol=0, atol=1e-6)
    np.testing.assert_allclose(loss, value, atol=1e-6)
    assert ms == {}
    with pytest.raises(ValueError, match="data_shards=0 is not a positive integer"):
        testing.single_model_train_step(model, TX, data_shards=0)
    with pytest.raises(ValueError, match="does not split into data_shards=3"):
        testing.single_model_train_step(model, TX, data_shards=3)(
            params, {}, TX.init(params), X, Y, jax.random.PRNGKey(0), 0
        )


def test_single_model_train_step_draws_a_mask_per_shard():
    """With dropout, the same batch cut into 2 shards trains differently from 1 shard."""
    model = me.as_model(DropoutMLP())
    params, _ = model.init(jax.random.key(0), X[:1])
    args = (params, {}, TX.init(params), X, Y, jax.random.key(1), 0)
    one = testing.single_model_train_step(model, TX)(*args)[0]
    two = testing.single_model_train_step(model, TX, data_shards=2)(*args)[0]
    with pytest.raises(AssertionError, match="params"):
        testing.assert_trees_close({"params": one}, {"params": two})


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("mesh_shape", [(2, 2), (4, 1)])
def test_assert_members_match_single_model_training_passes_on_the_ensemble(mesh_shape):
    need_devices(4)
    ens = ensemble(DropoutMLP(), mesh_shape)
    state = testing.assert_members_match_single_model_training(
        ens, jax.random.key(0), X, Y, steps=2, rtol=0, atol=1e-5
    )
    assert int(np.asarray(state.step)[0]) == 2


@pytest.mark.slow  # among the heaviest default tests, measured
def test_assert_members_match_single_model_training_follows_per_member_hyperparams():
    need_devices(4)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
    lrs = [0.01, 0.05, 0.1, 0.2]
    ens = me.Ensemble(Tiny(), tx, M, me.make_mesh(2, 2), hyperparams={"learning_rate": lrs})
    testing.assert_members_match_single_model_training(ens, jax.random.key(0), X, Y, 2)


class SwappedInit(me.Ensemble):
    """A wrong ensemble: members 0 and 1 start from each other's parameters."""

    def init(self, key, sample):
        state = super().init(key, sample)
        return jax.device_put(host_state(state, params=swap_members), me.member_sharding(self.mesh))


class SharedDropoutKey(me.Ensemble):
    """A wrong ensemble: every member draws its dropout masks from member 0's key."""

    def init(self, key, sample):
        state = super().init(key, sample)
        shared = host_state(state, rng=lambda rng: np.broadcast_to(rng[:1], rng.shape).copy())
        return jax.device_put(shared, me.member_sharding(self.mesh))


class ShuffledShards(me.Ensemble):
    """A wrong ensemble: it trains on the batch reversed, so shards see other examples."""

    def train_step(self, state, images, labels):
        return super().train_step(state, images[::-1], labels[::-1])


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize(
    "wrong,model,match",
    [
        (SwappedInit, Tiny(), r"^member 0 after 2 steps differs .*params/"),
        (ShuffledShards, DropoutMLP(), r"^member 0 after 2 steps differs"),
        (SharedDropoutKey, DropoutMLP(), r"^member 1 after 2 steps differs"),
    ],
    ids=["members_swapped", "shards_reordered_under_dropout", "dropout_key_shared"],
)
def test_assert_members_match_single_model_training_fails_on_a_wrong_ensemble(wrong, model, match):
    need_devices(4)
    ens = wrong(model, TX, M, me.make_mesh(2, 2))
    with pytest.raises(AssertionError, match=match):
        testing.assert_members_match_single_model_training(ens, jax.random.key(0), X, Y, 2)


@pytest.mark.parametrize("typed", [True, False])
def test_member_stream_keys_are_fold_in_of_the_split_key_by_one(typed):
    """The documented derivation, written out here: member i's stream is
    fold_in(split(key, M)[i], 1); changing the constant (in the ensemble or the helper)
    fails this test."""
    need_devices(4)
    key = jax.random.key(3) if typed else jax.random.PRNGKey(3)
    by_hand = [jax.random.fold_in(k, 1) for k in jax.random.split(key, M)]
    raw = lambda k: np.asarray(jax.random.key_data(k) if typed else k)
    want = np.stack([raw(k) for k in by_hand])
    np.testing.assert_array_equal(raw(testing.member_stream_keys(key, M)), want)
    state = ensemble().init(key, X[:1])
    np.testing.assert_array_equal(np.asarray(jax.device_get(state.rng)), want)


def test_assert_members_match_single_model_training_refuses_mixed_precision():
    need_devices(4)
    ens = ensemble(compute_dtype="bfloat16")
    with pytest.raises(ValueError, match="compute_dtype=bfloat16; check parity on an ensemble"):
        testing.assert_members_match_single_model_training(ens, jax.random.key(0), X, Y)


# ------------------------------------------------------------------ mesh invariance
def trained(mesh, steps: int = 2):
    ens = me.Ensemble(Tiny(), TX, M, mesh)
    state = ens.init(jax.random.key(0), X[:1])
    for _ in range(steps):
        state, metrics = ens.train_step(state, X, Y)
    return state.params, metrics["loss"], ens.predict(state, X)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_assert_mesh_invariant_passes_on_training_and_fails_on_a_mesh_dependent_fn():
    need_devices(8)
    # the helper on two meshes (a tuple and a dict); the library's own invariance over
    # more shapes is test_ensemble's test_mesh_shapes_give_the_same_members
    shapes = [(4, 1), {"ensemble": 2, "data": 2}]
    params, loss, probs = testing.assert_mesh_invariant(trained, shapes, rtol=0, atol=1e-5)
    assert isinstance(loss, np.ndarray) and loss.shape == (M,) and probs.shape == (len(X), 10)

    def local_first_row(mesh):  # what device 0 holds: depends on how the batch is split
        x = jax.device_put(jnp.arange(8.0), me.batch_sharding(mesh))
        return np.asarray(x.addressable_shards[0].data)

    with pytest.raises(AssertionError, match=r"on the mesh ensemble x data = 2x2 differs from 4x1"):
        testing.assert_mesh_invariant(local_first_row, [(4, 1), (2, 2)])
    with pytest.raises(ValueError, match="mesh_shapes is empty"):
        testing.assert_mesh_invariant(trained, [])


# ------------------------------------------------------------------ data
def test_learnable_dataset_defaults_are_the_tests_former_set():
    x, y = testing.learnable_dataset(32, seed=5)
    rng = np.random.default_rng(5)
    y0 = rng.integers(0, 10, 32)
    x0 = rng.normal(0, 0.3, (32, 8, 8, 1)).astype(np.float32)
    x0[np.arange(32), y0 % 8, :, 0] += 1.5
    x0[np.arange(32), :, y0 // 8 + 3, 0] += 1.5
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(y, y0)
    assert x.dtype == np.float32 and y.dtype == np.int32


def test_learnable_dataset_shapes_and_classes_are_separable():
    x, y = testing.learnable_dataset(600, image_shape=(6, 10, 3), num_classes=20, seed=1)
    assert x.shape == (600, 6, 10, 3) and set(np.unique(y)) == set(range(20))
    np.testing.assert_array_equal(x, testing.learnable_dataset(600, (6, 10, 3), 20, seed=1)[0])
    templates = np.stack([x[y == c].mean(0) for c in range(20)])  # nearest class mean
    xt, yt = testing.learnable_dataset(200, image_shape=(6, 10, 3), num_classes=20, seed=2)
    dist = ((xt[:, None] - templates[None]) ** 2).sum(axis=(2, 3, 4))
    assert np.mean(dist.argmin(1) == yt) > 0.95


@pytest.mark.parametrize(
    "kwargs",
    [{"n": 0}, {"num_classes": 41}, {"num_classes": 0}, {"image_shape": (8, 8)}],
)
def test_learnable_dataset_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="give n >= 1") as info:
        testing.learnable_dataset(**{"n": 8, **kwargs})
    assert "\n" not in str(info.value)


def test_every_public_helper_is_documented_with_an_example():
    for name in testing.__all__:
        doc = inspect.getdoc(getattr(testing, name)) or ""
        for section in ("Args:", "Example:"):
            assert section in doc, f"meshensemble.testing.{name} lacks {section}"
    lines = len(inspect.getsource(testing).splitlines())
    assert lines <= 700, lines  # the project's module limit (tests/test_layout.py)
