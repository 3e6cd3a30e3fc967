"""The core: parity between backends, mesh shapes and a plain per-member loop; sharding; errors."""

from __future__ import annotations

import functools
import math
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MaskProbe, Tiny, assert_masks_are_independent, dropout_masks, need_devices

import meshensemble as me
from meshensemble import testing

M = 8


class DropoutBN(nn.Module):
    """Dropout and BatchNorm, to exercise RNG streams and mutable collections."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.reshape((x.shape[0], -1))
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        x = nn.Dropout(0.3, deterministic=not train)(x)
        return nn.Dense(10)(x)


X, Y = testing.learnable_dataset(32)
_tiny = Tiny()
MODELS = {
    "tiny": _tiny,
    "dropout_bn": DropoutBN(),
    "function": me.FunctionModel(
        lambda rng, x: _tiny.init(rng, x)["params"],
        lambda p, x: _tiny.apply({"params": p}, x),
    ),
}
TX = optax.sgd(0.1, 0.9)


def run(
    mesh_shape,
    backend="shard_map",
    steps=5,
    model="tiny",
    strategy="auto",
    key="legacy",
    m=M,
    axis_types="explicit",
):
    """Trains ``m`` members ``steps`` steps on (X, Y); cached, so shared configurations run once
    (whichever way the arguments are spelled: ``run((8, 1))`` is ``run((8, 1), "shard_map")``)."""
    return _run(mesh_shape, backend, steps, model, strategy, key, m, axis_types)


@functools.cache
def _run(mesh_shape, backend, steps, model, strategy, key, m, axis_types):
    mesh = me.make_mesh(*mesh_shape, axis_types=axis_types)
    ens = me.Ensemble(MODELS[model], TX, m, mesh, backend=backend, member_strategy=strategy)
    state = ens.init(jax.random.PRNGKey(0) if key == "legacy" else jax.random.key(0), X[:1])
    history = []
    for _ in range(steps):
        state, metrics = ens.train_step(state, X, Y)
        history.append(jax.device_get(metrics))
    return ens, state, tuple(history)


def per_member_reference(steps=5, model=None, m=M, xs=None, ys=None):
    """The anchor: each of ``m`` members trained alone with a jitted single-model step, on
    (X, Y), or member ``i`` on its own batch ``(xs[i], ys[i])``."""
    model = model or Tiny()
    keys = jax.random.split(jax.random.PRNGKey(0), m)

    @jax.jit
    def step(p, o, x, y):
        def loss(p):
            logits = model.apply({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        value, g = jax.value_and_grad(loss)(p)
        u, o = TX.update(g, o, p)
        return optax.apply_updates(p, u), o, value

    params, losses = [], []
    for i, k in enumerate(keys):
        p = model.init(k, X[:1])["params"]
        o = TX.init(p)
        x, y = (X, Y) if xs is None else (xs[i], ys[i])
        for _ in range(steps):
            p, o, value = step(p, o, x, y)
        params.append(p)
        losses.append(value)
    return jax.tree.map(lambda *a: np.stack(a), *params), np.array(losses)


FEW = 2
"""Members of the runs whose every device holds all members (ensemble=1): a loop of 2 is
the same code as a loop of 8 at a quarter of its unrolled program."""


@pytest.fixture(scope="module")
def reference():
    """The per-member anchors of ``M`` and of ``FEW`` members (``{m: (params, losses)}``)."""
    return {m: per_member_reference(m=m) for m in (M, FEW)}


@pytest.fixture(scope="module")
def baseline():
    need_devices(8)
    return run((8, 1))


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize(
    "mesh_shape,backend",
    [((8, 1), "shard_map"), ((8, 1), "pmap"), ((1, 8), "shard_map"), ((1, 8), "pmap")],
)
def test_parity_with_per_member_loop(mesh_shape, backend, reference):
    """One member per device (8 of them), and all members on every device (a loop of FEW)
    with the batch split 8 ways, under both backends."""
    need_devices(8)
    m = M if mesh_shape[0] > 1 else FEW
    _, state, history = run(mesh_shape, backend, m=m)
    ref_params, ref_loss = reference[m]
    chex.assert_trees_all_close(jax.device_get(state.params), ref_params, atol=1e-5, rtol=0)
    np.testing.assert_allclose(history[-1]["loss"], ref_loss, atol=1e-5)


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("mesh_shape", [(1, 8)])
def test_shard_map_equals_pmap_metrics(mesh_shape):
    need_devices(8)
    _, s1, h1 = run(mesh_shape, "shard_map", m=FEW)  # test_parity_with_per_member_loop's runs
    _, s2, h2 = run(mesh_shape, "pmap", m=FEW)
    chex.assert_trees_all_close(h1, h2, atol=1e-5, rtol=0)
    chex.assert_trees_all_close(jax.device_get(s1), jax.device_get(s2), atol=1e-5, rtol=0)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_mesh_shapes_give_the_same_members():
    """Members split over devices and members x data split (8 members); all members on
    every device with the batch split 8 ways and all on one device, the full batch in one
    piece (FEW members in a loop: the data-parallel gradient equals the one-device one).
    (2, 4) is (4, 2)'s path again, and (2, 1) (a device subset) is checked against (8, 1)
    by test_vmap_and_loop_strategies_agree; each compiled its own programs for no new case."""
    need_devices(8)
    for m, shapes in ((M, [(8, 1), (4, 2)]), (FEW, [(1, 8), (1, 1)])):
        trained = lambda mesh, m=m: run((mesh.shape["ensemble"], mesh.shape["data"]), m=m)[1:]
        testing.assert_mesh_invariant(trained, shapes, rtol=0, atol=1e-5)


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("axis_types", ["explicit", "auto"])
def test_explicit_and_auto_axes(axis_types, baseline):
    need_devices(8)
    _, ref_state, _ = baseline
    _, state, _ = run((4, 2), axis_types=axis_types)
    chex.assert_trees_all_close(jax.device_get(state), jax.device_get(ref_state), atol=1e-5)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_vmap_and_loop_strategies_agree(baseline):
    need_devices(8)
    _, ref_state, _ = baseline
    _, state, _ = run((2, 1), strategy="vmap")
    chex.assert_trees_all_close(jax.device_get(state), jax.device_get(ref_state), atol=1e-5)


def test_init_matches_howto_convention_and_sharding_is_kept():
    need_devices(8)
    key = jax.random.PRNGKey(42)
    mesh = me.make_mesh(ensemble=4, data=2)
    ens = me.Ensemble(Tiny(), TX, M, mesh)
    state = ens.init(key, X[:1])
    chex.assert_tree_shape_prefix(state, (M,))
    for i, k in enumerate(jax.random.split(key, M)):  # Flax itself, not the adapter
        expected = Tiny().init(k, X[:1])["params"]
        member = jax.tree.map(lambda v, i=i: np.asarray(v)[i], state.params)
        chex.assert_trees_all_equal(member, jax.device_get(expected))
    testing.assert_members_equal_single_models(ens, state, key, X[:1])  # bit for bit

    testing.assert_sharded_over_members(state, mesh)
    state, _ = ens.train_step(state, X, Y)
    testing.assert_sharded_over_members(state, mesh)
    chex.assert_tree_all_finite(state)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_typed_key_equals_legacy_key():
    need_devices(8)
    # the legacy run is test_dropout_batchnorm_train_and_keep_parity_between_backends's
    _, legacy, _ = run((8, 1), steps=3, model="dropout_bn")
    _, typed, _ = run((8, 1), steps=3, model="dropout_bn", key="typed")
    chex.assert_trees_all_close(jax.device_get(legacy.params), jax.device_get(typed.params))


@pytest.mark.slow  # among the heaviest default tests, measured
def test_members_diverge_and_ensemble_metrics_come_from_averaged_probs(baseline):
    ens, state, history = baseline
    kernels = np.asarray(state.params["Dense_1"]["kernel"])
    assert min(np.abs(kernels[0] - kernels[i]).max() for i in range(1, M)) > 1e-3
    assert np.std(history[-1]["loss"]) > 0

    member = np.asarray(ens.predict_members(state, X))
    probs = np.asarray(ens.predict(state, X))
    chex.assert_shape(member, (M, len(X), 10))
    np.testing.assert_allclose(probs, member.mean(0), atol=1e-6)
    # the step's ensemble metrics are those of the averaged softmax of the step's members,
    # which predict() reproduces for the state *before* the step: check on a fresh step.
    before_ens = np.asarray(ens.predict(state, X))
    before_members = np.asarray(ens.predict_members(state, X))
    mesh = ens.mesh
    dropout_free = me.Ensemble(Tiny(), optax.sgd(0.0), M, mesh)
    zero_state = dropout_free.init(jax.random.PRNGKey(0), X[:1])
    zero_state = zero_state.replace(params=jax.tree.map(jnp.copy, state.params))
    _, metrics = dropout_free.train_step(zero_state, X, Y)
    acc = float(np.mean(before_ens.argmax(-1) == Y))
    nll = float(np.mean(-np.log(before_ens[np.arange(len(Y)), Y])))
    np.testing.assert_allclose(metrics["ensemble_accuracy"], acc, atol=1e-6)
    np.testing.assert_allclose(metrics["ensemble_nll"], nll, atol=1e-5)
    mean_of_member_acc = float(np.mean(before_members.argmax(-1) == Y[None]))
    np.testing.assert_allclose(np.mean(metrics["accuracy"]), mean_of_member_acc, atol=1e-6)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_ensemble_learns_far_above_chance():
    need_devices(8)
    mesh = me.make_mesh(ensemble=4, data=2)
    ens = me.Ensemble(Tiny(), optax.adam(1e-2), M, mesh)
    x, y = testing.learnable_dataset(256, seed=1)
    state = ens.init(jax.random.key(3), x[:1])
    for i in range(40):
        sl = slice((i % 8) * 32, (i % 8 + 1) * 32)
        state, _ = ens.train_step(state, x[sl], y[sl])
    xt, yt = testing.learnable_dataset(200, seed=2)
    acc = float(np.mean(np.asarray(ens.predict(state, xt)).argmax(-1) == yt))
    assert acc > 0.6, acc


@pytest.mark.slow  # among the heaviest default tests, measured
def test_dropout_batchnorm_train_and_keep_parity_between_backends():
    need_devices(8)
    # one member per device; several members per device under pmap are checked against a
    # single model by test_dropout_batchnorm_members_match_single_model_training
    _, s_sm, h_sm = run((8, 1), "shard_map", model="dropout_bn", steps=3)
    _, s_pm, h_pm = run((8, 1), "pmap", model="dropout_bn", steps=3)
    chex.assert_trees_all_close(jax.device_get(s_sm), jax.device_get(s_pm), atol=1e-5)
    chex.assert_trees_all_close(h_sm, h_pm, atol=1e-5)
    stats = np.asarray(s_sm.model_state["batch_stats"]["BatchNorm_0"]["mean"])
    chex.assert_shape(stats, (M, 16))
    assert np.abs(stats).max() > 0  # running statistics were updated
    assert np.abs(stats[0] - stats[1]).max() > 0  # per member
    # members x data (4, 2): the masks, statistics and gradients of every member equal a
    # single model's, shard by shard, in test_dropout_batchnorm_members_match_single_model_training


# ------------------------------------------------------------------ dropout keys
@pytest.fixture(scope="module")
def linen_masks():
    """Linen dropout masks of 4 members, 2 steps, on ensemble=2 x data=4 (2 members a device)."""
    need_devices(8)
    return dropout_masks(MaskProbe(), me.make_mesh(ensemble=2, data=4))


@pytest.mark.parametrize("what", ["shards", "members", "steps"])
def test_linen_dropout_draws_a_mask_per_shard_member_and_step(linen_masks, what):
    """Fails when the step key drops the fold over `data`, the members' keys or the step."""
    assert_masks_are_independent(linen_masks, data=4, what=what)


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize(
    "mesh_shape,backend,key",
    [((4, 2), "shard_map", "legacy"), ((2, 4), "shard_map", "typed"), ((1, 8), "pmap", "typed")],
)
def test_dropout_batchnorm_members_match_single_model_training(mesh_shape, backend, key):
    """Masks, BatchNorm statistics and gradients equal one model's, data shard by data shard."""
    need_devices(8)
    ens = me.Ensemble(DropoutBN(), TX, 4, me.make_mesh(*mesh_shape), backend=backend)
    k = jax.random.PRNGKey(0) if key == "legacy" else jax.random.key(0)
    state = testing.assert_members_match_single_model_training(ens, k, X, Y, 2, rtol=0, atol=1e-5)
    testing.assert_sharded_over_members(state, ens.mesh)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_per_member_batches():
    need_devices(8)
    mesh = me.make_mesh(ensemble=4, data=2)
    ens = me.Ensemble(Tiny(), TX, M, mesh)
    state = ens.init(jax.random.PRNGKey(0), X[:1])
    perms = np.stack([np.random.default_rng(i).permutation(32) for i in range(M)])
    xs, ys = X[perms], Y[perms]
    state, metrics = ens.train_step(state, xs, ys)
    assert np.isnan(metrics["ensemble_accuracy"])
    # member i equals that member trained alone (a plain jitted Flax step) on its own batch
    stacked, ref_loss = per_member_reference(steps=1, xs=xs, ys=ys)
    chex.assert_trees_all_close(jax.device_get(state.params), stacked, atol=1e-5)
    np.testing.assert_allclose(metrics["loss"], ref_loss, atol=1e-5)


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("n", [1, 13, 32])
def test_predict_any_n(n, baseline):
    ens, state, _ = baseline
    mesh = me.make_mesh(ensemble=2, data=4)
    ens2 = me.Ensemble(Tiny(), TX, M, mesh)
    state2 = jax.tree.map(lambda v: jax.device_put(v, me.member_sharding(mesh)), state)
    a = np.asarray(ens.predict(state, X[:n]))
    b = np.asarray(ens2.predict(state2, X[:n]))
    c = np.asarray(ens2.predict(state2, jax.device_put(X[:n])))
    chex.assert_shape(b, (n, 10))
    np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_allclose(b, c, atol=1e-6)
    chex.assert_shape(ens2.predict_members(state2, X[:n]), (M, n, 10))


def test_inputs_already_sharded_are_accepted(baseline):
    ens, state, _ = baseline
    mesh = ens.mesh
    xs = jax.device_put(X, me.batch_sharding(mesh))
    ys = jax.device_put(Y, me.replicated_sharding(mesh))
    probs = ens.predict(state, xs)
    np.testing.assert_allclose(np.asarray(probs), np.asarray(ens.predict(state, X)), atol=1e-6)
    ens2 = me.Ensemble(Tiny(), TX, M, mesh)
    s = ens2.init(jax.random.PRNGKey(0), X[:1])
    s, metrics = ens2.train_step(s, xs, ys)
    chex.assert_shape(metrics["loss"], (M,))


def test_function_model_matches_linen():
    need_devices(8)
    _, s_linen, _ = run((4, 2))  # test_mesh_shapes_give_the_same_members's run
    _, s_fn, _ = run((4, 2), model="function")
    chex.assert_trees_all_close(jax.device_get(s_linen.params), jax.device_get(s_fn.params))


# ------------------------------------------------------------------ bad input
def _ens(mesh_shape=(4, 2), m=M, **kw):
    return me.Ensemble(Tiny(), TX, m, me.make_mesh(*mesh_shape), **kw)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: _ens(m=6), r"num_members=6 is not a positive multiple .* ensemble axis \(4\)"),
        (lambda: _ens(m=0), r"num_members=0"),
        (lambda: me.make_mesh(ensemble=16, data=1), r"needs 16 devices but only 8 exist"),
        (lambda: me.make_mesh(ensemble=3, data=3), r"needs 9 devices"),
        (lambda: me.make_mesh(data=3), r"data=3 x model=1 does not divide the 8 devices"),
        (lambda: me.make_mesh(ensemble=0), r"ensemble=0 is not a positive whole number"),
        (lambda: _ens(backend="pmap"), r"backend='pmap' maps one axis.*ensemble=4 x data=2"),
        (lambda: _ens(backend="xla"), r"backend='xla' is unknown; choose one of shard_map, pmap"),
        (lambda: _ens(member_strategy="fast"), r"member_strategy='fast' is unknown"),
        (lambda: _ens(compute_dtype="int8"), r"compute_dtype='int8' is not a floating dtype"),
        (lambda: _ens(compute_dtype="bf17"), r"compute_dtype='bf17' is not a floating dtype"),
        (lambda: me.parse_mesh("ensemble=4,modl=2"), r"bad part 'modl=2'"),
        (lambda: me.parse_mesh("ensemble=x"), r"not a positive integer"),
    ],
)
def test_bad_construction(make, match):
    need_devices(8)
    with pytest.raises(ValueError, match=match) as info:
        make()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "images,labels,match",
    [
        (X[:31], Y[:31], r"batch size 31 is not a positive multiple of the mesh.s data axis \(2\)"),
        (X[:32], Y[:16], r"images of shape \(32, 8, 8, 1\) and labels of shape \(16,\) differ"),
        (X[None].repeat(3, 0), Y[None].repeat(3, 0), r"per-member labels .* have 3 members"),
        (X, Y.astype(np.float32), r"labels have dtype float32"),
        (X, Y[:, None, None], r"labels of shape \(32, 1, 1\) must be"),
    ],
)
def test_bad_batches_leave_state_untouched(images, labels, match):
    need_devices(8)
    ens = _ens()
    state = ens.init(jax.random.PRNGKey(0), X[:1])
    before = jax.device_get(state)
    with pytest.raises(ValueError, match=match) as info:
        ens.train_step(state, images, labels)
    assert "\n" not in str(info.value)
    chex.assert_trees_all_equal(jax.device_get(state), before)  # not donated, not changed
    state, _ = ens.train_step(state, X, Y)  # and still usable


def test_state_of_another_ensemble_and_bad_key():
    need_devices(8)
    ens = _ens()
    other = _ens(m=4).init(jax.random.PRNGKey(0), X[:1])
    with pytest.raises(ValueError, match="state has 4 members but this Ensemble has 8"):
        ens.train_step(other, X, Y)
    with pytest.raises(ValueError, match="is not one PRNG key"):
        ens.init(jax.random.split(jax.random.PRNGKey(0), 2), X[:1])


@pytest.mark.slow  # among the heaviest default tests, measured
def test_mixed_precision_keeps_float32_master_weights():
    """bf16 compute: the model sees bf16, the state stays float32, the steps track fp32.
    The casts are the step's (core/steps.py), the same under both backends: shard_map on
    members x data here, pmap's step against shard_map's in test_parity_with_per_member_loop."""
    need_devices(8)
    backend, mesh = "shard_map", me.make_mesh(ensemble=4, data=2)
    seen = []

    class Spy(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            seen.append(x.dtype)
            x = nn.relu(nn.Conv(4, (3, 3))(x))
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            return nn.Dense(10)(x.reshape((x.shape[0], -1)))

    runs = {}
    for dtype in (None, "bfloat16"):
        ens = me.Ensemble(Spy(), TX, 4, mesh, backend=backend, compute_dtype=dtype)
        state = ens.init(jax.random.key(0), X[:1])
        losses = []
        for _ in range(4):
            state, metrics = ens.train_step(state, X, Y)
            losses.append(np.asarray(metrics["loss"]))
        probs = ens.predict(state, X)
        runs[dtype] = state, np.array(losses), probs
    state, losses, probs = runs["bfloat16"]
    assert jnp.bfloat16 in seen and jnp.float32 in seen  # each run traced its own dtype
    for leaf in jax.tree.leaves((state.params, state.opt_state, state.model_state)):
        assert leaf.dtype == jnp.float32, leaf.dtype
    assert probs.dtype == jnp.float32
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
    ref_state, ref_losses, ref_probs = runs[None]
    np.testing.assert_allclose(losses, ref_losses, rtol=0.05, atol=0.02)  # bf16: ~3 digits
    assert np.abs(probs - ref_probs).max() < 0.05
    assert np.abs(losses[-1] - ref_losses[-1]).max() > 0  # it did compute in bf16


def _all_reduce_groups(ens, state):
    """The replica groups of every all-reduce in the compiled train step."""
    text = ens.train_step_fn().lower(state, ens.place(X), ens.place(Y)).compile().as_text()
    return re.findall(r"all-reduce\(.*?replica_groups=(\{[^ ]*\})", text)


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize(
    "mesh_shape, groups",
    [((8, 1), ["{{0,1,2,3,4,5,6,7}}"]), ((1, 1), []), ((4, 2), None)],
)
def test_no_all_reduce_over_an_axis_of_size_one(mesh_shape, groups):
    """A size-1 ``data`` (or ``ensemble``) axis adds no all-reduce to the step: XLA:CPU ran
    even a trivial one as a rendezvous of every device, a fifth of the user CNN's step."""
    need_devices(math.prod(mesh_shape))
    mesh = me.make_mesh(*mesh_shape, devices=jax.devices()[: math.prod(mesh_shape)])
    ens = me.Ensemble(Tiny(), TX, M, mesh)
    found = _all_reduce_groups(ens, ens.init(jax.random.PRNGKey(0), X[:1]))
    if groups is None:  # data=2: the gradients' all-reduce pairs devices over data
        assert any(g.startswith("{{0,1}") or "{0,1}" in g for g in found), found
    else:
        assert found == groups


def _copied_state_leaves(ens, state):
    """The state-shaped buffers the compiled train step copies (each copy costs a leaf)."""
    text = ens.train_step_fn().lower(state, ens.place(X), ens.place(Y)).compile().as_text()
    entry = text[text.index("\nENTRY") : text.index("\n}\n", text.index("\nENTRY"))]
    local = {
        f"f32[{','.join(map(str, leaf.addressable_shards[0].data.shape))}]"
        for leaf in jax.tree.leaves((state.params, state.opt_state))
    }
    copied = re.findall(r"= (f32\[[\d,]*\])\{[\d,]*\} (?:copy\(|fusion\(.*wrapped_copy)", entry)
    assert local, "the state has no float32 leaves to look for"
    return [s for s in copied if s in local]


@pytest.mark.parametrize(
    "mesh_shape, strategy", [((8, 1), "loop"), ((4, 1), "vmap"), ((4, 2), "vmap")]
)
def test_the_donated_state_is_updated_in_place(mesh_shape, strategy):
    """The step copies no parameter or optimizer leaf: every update waits for the gradient
    and the metrics (``steps.ordered_after``), and one member per device is vmapped, so XLA
    writes the new state into the donated buffers (it copied 28 leaves of the user CNN)."""
    need_devices(math.prod(mesh_shape))
    mesh = me.make_mesh(*mesh_shape, devices=jax.devices()[: math.prod(mesh_shape)])
    members = mesh_shape[0] * (2 if strategy == "vmap" else 1)
    ens = me.Ensemble(Tiny(), TX, members, mesh, member_strategy=strategy)
    assert _copied_state_leaves(ens, ens.init(jax.random.PRNGKey(0), X[:1])) == []
