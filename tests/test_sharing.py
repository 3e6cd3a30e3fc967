"""Member layouts (issue 40): shared and frozen leaves, BatchEnsemble and LoRA ensembles.

The anchor is a reference written plainly here, on one device with plain Flax and optax:
each member is the model on its own leaves plus the shared ones; the shared leaves step
on the gradient of the mean of the members' losses, each member's own leaves on its own
loss, frozen leaves never. Every mesh shape, both backends and both member strategies
must train the same parameters (1e-5 after 20 steps).
"""

from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import need_devices
from flax import traverse_util

import meshensemble as me
from meshensemble.core.sharding import state_bytes_per_device

M = 8
STEPS = 20
X, Y = me.testing.learnable_dataset(32)  # [32, 8, 8, 1] float32, 10 classes
TX = optax.sgd(0.1, momentum=0.9)


class TinyBECNN(nn.Module):
    """A BatchEnsemble CNN small enough for 20 steps on every mesh."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(me.models.BEConv(4, (3, 3))(x))
        x = nn.avg_pool(x, (2, 2), (2, 2)).reshape((x.shape[0], -1))
        return me.models.BEDense(10)(x)


LORA_MLP = me.models.lora(me.models.MLP((16,)), rank=2, alpha=4.0)
BACKBONE = me.models.MLP((16,)).init(jax.random.PRNGKey(7), X[:1])["params"]  # "pretrained"
CASES = {
    "be_cnn": dict(model=TinyBECNN(), shared=me.models.batchensemble_shared, frozen=None),
    "lora_mlp": dict(
        model=LORA_MLP, shared=LORA_MLP.backbone, frozen=LORA_MLP.backbone, params=BACKBONE
    ),
    # frozen but not shared: each member keeps its own copy of the backbone, untouched
    "lora_mlp_own_backbone": dict(
        model=LORA_MLP, shared=None, frozen=LORA_MLP.backbone, params=BACKBONE
    ),
}


def flat(tree):
    """``{path: leaf}`` of a nested dict of parameters (None leaves: absent)."""
    return {k: v for k, v in traverse_util.flatten_dict(tree).items() if v is not None}


def reference(case: str, steps: int = STEPS):
    """The plain anchor: ``{path: [M, ...]}`` of every member's whole parameters."""
    c = CASES[case]
    model = me.as_model(c["model"])
    keys = jax.random.split(jax.random.PRNGKey(0), M)
    members = [flat(model.init(k, X[:1])[0]) for k in keys]
    given = flat(c.get("params") or {})
    members = [{p: given.get(p, v) for p, v in m.items()} for m in members]
    is_shared = {p: bool(c["shared"] and c["shared"](p, v)) for p, v in members[0].items()}
    is_frozen = {p: bool(c["frozen"] and c["frozen"](p, v)) for p, v in members[0].items()}
    own = [{p: v for p, v in m.items() if not is_shared[p] and not is_frozen[p]} for m in members]
    shared = {p: v for p, v in members[0].items() if is_shared[p] and not is_frozen[p]}
    fixed = [{p: v for p, v in m.items() if is_frozen[p]} for m in members]
    for m in fixed:  # frozen and shared: member 0's copy
        m.update({p: members[0][p] for p in m if is_shared[p]})

    def loss(own_i, shared, fixed_i):
        whole = traverse_util.unflatten_dict({**own_i, **shared, **fixed_i})
        logits = model.apply(whole, {}, X, False, None)[0]
        return optax.softmax_cross_entropy_with_integer_labels(logits, Y).mean()

    @jax.jit
    def step(own, shared, opt_own, opt_shared):
        grads = [jax.grad(loss)(o, shared, f) for o, f in zip(own, fixed)]
        mean_loss = lambda s: sum(loss(o, s, f) for o, f in zip(own, fixed)) / M
        g_shared = jax.grad(mean_loss)(shared)
        new_own, new_opt = [], []
        for o, g, s in zip(own, grads, opt_own):
            u, s = TX.update(g, s, o)
            new_own.append(optax.apply_updates(o, u))
            new_opt.append(s)
        u, opt_shared = TX.update(g_shared, opt_shared, shared)
        return new_own, optax.apply_updates(shared, u), new_opt, opt_shared

    opt_own, opt_shared = [TX.init(o) for o in own], TX.init(shared)
    for _ in range(steps):
        own, shared, opt_own, opt_shared = step(own, shared, opt_own, opt_shared)
    whole = [{**o, **shared, **f} for o, f in zip(own, fixed)]
    return {p: np.stack([np.asarray(w[p]) for w in whole]) for p in whole[0]}


@functools.cache
def anchor(case: str):
    return reference(case)


def whole_members(state) -> dict:
    """``{path: [M, ...]}`` of the ensemble's members: own leaves, shared ones broadcast."""
    out = {p: np.asarray(v) for p, v in flat(jax.device_get(state.params)).items()}
    if isinstance(state, me.core.state.SharedState):
        for p, v in flat(jax.device_get(state.shared)).items():
            out[p] = np.broadcast_to(np.asarray(v), (M, *np.shape(v)))
    return out


def make(case: str, mesh_shape=(4, 2), backend="shard_map", strategy="auto", **kw):
    c = CASES[case]
    if mesh_shape == "one":
        mesh = me.make_mesh(1, 1, devices=jax.devices()[:1])
    elif isinstance(mesh_shape, str):  # "fsdp" or "fsdp+model": members split over data
        model = 2 if mesh_shape.endswith("model") else None
        mesh = me.make_mesh(2, 4 // (model or 1), model=model)
        kw = dict(shard_members=True, sample=X[:1]) | kw
    else:
        mesh = me.make_mesh(*mesh_shape)
    return me.Ensemble(
        c["model"],
        TX,
        M,
        mesh,
        backend=backend,
        member_strategy=strategy,
        shared=c["shared"],
        frozen=c["frozen"],
        **kw,
    )


@functools.cache
def trained(case: str, mesh_shape=(4, 2), backend="shard_map", strategy="auto", steps=STEPS):
    ens = make(case, mesh_shape, backend, strategy)
    state = ens.init(jax.random.PRNGKey(0), X[:1], params=CASES[case].get("params"))
    for _ in range(steps):
        state, metrics = ens.train_step(state, X, Y)
    return ens, state, jax.device_get(metrics)


LAYOUTS = [
    ((4, 2), "shard_map", "auto"),
    ("one", "shard_map", "auto"),  # 8 members looped on one device
    ((8, 1), "pmap", "auto"),
    ((8, 1), "shard_map", "auto"),
    ((2, 4), "shard_map", "vmap"),
    ((1, 8), "shard_map", "loop"),
    ((1, 8), "pmap", "vmap"),
    ("fsdp", "shard_map", "auto"),  # (2, 4), shared leaves split over data too
    ("fsdp+model", "shard_map", "auto"),  # (2, 2, model=2): over data x model
]
# The default set: a BatchEnsemble (shared gradient) on a mesh and on one device, a LoRA
# ensemble (frozen shared backbone) on the pmap backend; every other case is slow.
FAST = {((4, 2), "shard_map", "auto"): {"be_cnn"}}
FAST[("one", "shard_map", "auto")] = {"be_cnn"}
FAST[((8, 1), "pmap", "auto")] = {"lora_mlp"}
PARITY = [
    pytest.param(case, *layout, marks=() if case in FAST.get(layout, ()) else pytest.mark.slow)
    for layout in LAYOUTS
    for case in sorted(CASES)
]


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("case,mesh_shape,backend,strategy", PARITY)
def test_every_mesh_and_backend_trains_the_plain_reference(case, mesh_shape, backend, strategy):
    """20 steps on the mesh equal the plain one-device reference within 1e-5: the shared
    leaves on the members' mean loss, the members' own on their own, frozen ones kept."""
    need_devices(8)
    _, state, _ = trained(case, mesh_shape, backend, strategy)
    got, want = whole_members(state), anchor(case)
    assert sorted(got) == sorted(want)
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=0)
    frozen = CASES[case]["frozen"]
    for path, value in flat(BACKBONE if frozen else {}).items():  # bitwise, every member
        np.testing.assert_array_equal(got[path], np.broadcast_to(value, got[path].shape))


@pytest.mark.slow  # among the heaviest default tests, measured
def test_the_shared_leaves_move_and_the_members_differ():
    """The parity above is not vacuous: the shared kernel moved, the members differ."""
    need_devices(8)
    _, state, metrics = trained("be_cnn")
    init = make("be_cnn").init(jax.random.PRNGKey(0), X[:1])
    moved = np.abs(np.asarray(state.shared["BEConv_0"]["shared_kernel"]))
    assert not np.allclose(moved, np.abs(np.asarray(init.shared["BEConv_0"]["shared_kernel"])))
    r = np.asarray(state.params["BEConv_0"]["r"])
    assert np.ptp(r, axis=0).max() > 0.5  # random signs, then trained apart
    assert np.ptp(metrics["loss"]) > 0


@pytest.mark.parametrize(
    "mesh_shape,backend",
    [pytest.param((4, 2), "shard_map", marks=pytest.mark.slow), ((8, 1), "pmap")],
)
def test_frozen_leaves_are_bitwise_the_given_backbone(mesh_shape, backend):
    need_devices(8)
    _, state, _ = trained("lora_mlp", mesh_shape, backend)
    for path, value in flat(BACKBONE).items():
        np.testing.assert_array_equal(flat(jax.device_get(state.shared))[path], value)
    assert not jax.tree.leaves(state.shared_opt_state)  # no optimizer state for them


def test_a_lora_member_starts_exactly_at_the_backbone():
    need_devices(8)
    ens = make("lora_mlp")
    state = ens.init(jax.random.PRNGKey(0), X[:1], params=BACKBONE)
    plain = me.models.MLP((16,)).apply({"params": BACKBONE}, X)
    members = np.asarray(ens.predict_members(state, X, logits=True))
    np.testing.assert_array_equal(members, np.broadcast_to(np.asarray(plain), members.shape))
    assert np.ptp(np.asarray(state.params["Dense_0"]["lora_a"]), axis=0).max() > 0


@pytest.mark.slow  # among the heaviest default tests, measured
def test_without_filters_the_state_is_todays():
    """None filters: an EnsembleState of exactly the plain stacked structure (no shared
    fields), each member ``model.init(split(key, M)[i])``; filters that pick nothing give
    a SharedState that trains the same members."""
    need_devices(8)
    mesh = me.make_mesh(4, 2)
    plain = me.Ensemble(me.models.MLP((16,)), TX, M, mesh, shared=None, frozen=None)
    state = plain.init(jax.random.PRNGKey(0), X[:1])
    assert type(state) is me.EnsembleState
    keys = jax.random.split(jax.random.PRNGKey(0), M)
    params = jax.vmap(lambda k: me.models.MLP((16,)).init(k, X[:1])["params"])(keys)
    want = me.EnsembleState(
        jnp.zeros(M, jnp.int32), params, jax.vmap(TX.init)(params), {}, jnp.zeros((M, 2))
    )
    assert jax.tree.structure(state) == jax.tree.structure(want)
    chex.assert_trees_all_equal(jax.device_get(state.params), jax.device_get(params))
    nothing = lambda path, leaf: False
    empty = me.Ensemble(me.models.MLP((16,)), TX, M, mesh, shared=nothing, frozen=nothing)
    other = empty.init(jax.random.PRNGKey(0), X[:1])
    assert type(other) is me.core.state.SharedState and not jax.tree.leaves(other.shared)
    for _ in range(3):
        state, _ = plain.train_step(state, X, Y)
        other, _ = empty.train_step(other, X, Y)
    chex.assert_trees_all_close(jax.device_get(other.params), jax.device_get(state.params))


@pytest.mark.slow  # among the heaviest default tests, measured
def test_shared_leaves_are_one_copy_per_device():
    """Checked on the placed arrays: every device holds the whole shared kernel once
    (replicated over ``ensemble`` and ``data``), and a member's fast weights only for its
    own members; with ``shard_members`` the shared kernel is split over ``data``."""
    need_devices(8)
    ens, state, _ = trained("be_cnn")
    kernel = state.shared["BEDense_0"]["shared_kernel"]
    devices = [s.device for s in kernel.addressable_shards]
    assert sorted(d.id for d in devices) == list(range(8))  # one shard on each device
    assert all(s.data.shape == kernel.shape for s in kernel.addressable_shards)
    r = state.params["BEDense_0"]["r"]
    assert {s.data.shape[0] for s in r.addressable_shards} == {2}  # 2 of 8 members each
    mu = state.shared_opt_state[0].trace["BEDense_0"]["shared_kernel"]
    assert all(s.data.shape == kernel.shape for s in mu.addressable_shards)
    fsdp = make("be_cnn", (2, 4), shard_members=True, sample=X[:1])
    split = fsdp.init(jax.random.PRNGKey(0), X[:1]).shared["BEDense_0"]["shared_kernel"]
    assert {s.data.shape for s in split.addressable_shards} == {(split.shape[0] // 4, 10)}
    assert split.sharding.spec == jax.sharding.PartitionSpec("data")


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_batchensemble_of_8_costs_one_member_and_8_fast_weight_sets():
    need_devices(1)
    one_device = me.make_mesh(1, 1, devices=jax.devices()[:1])
    net, x = me.models.BatchEnsembleMLP((256,)), np.zeros((1, 28, 28, 1), np.float32)
    single = me.Ensemble(net, TX, 1, one_device).init(jax.random.PRNGKey(0), x)
    be = me.Ensemble(net, TX, 8, one_device, shared=me.models.batchensemble_shared)
    state = be.init(jax.random.PRNGKey(0), x)
    fast_sets = state_bytes_per_device((state.params, state.opt_state))  # all 8 members'
    total, one = state_bytes_per_device(state), state_bytes_per_device(single)
    assert total <= 1.2 * (one + fast_sets), (total, one, fast_sets)
    assert total < 0.2 * 8 * one  # the shared kernels dominate a member: far below 8 copies


@pytest.mark.slow
@pytest.mark.parametrize("target", [(2, 4), (8, 1), "fsdp"])
def test_a_checkpoint_restores_exactly_and_reshards(tmp_path, target):
    """A SharedState saved on (4, 2) restores exactly on another mesh (and split over
    ``data``), and the next step from it equals the next step from the original."""
    need_devices(8)
    ens, state, _ = trained.__wrapped__("be_cnn", steps=3)  # its own: a step consumes it
    ckpt = me.Checkpointer(str(tmp_path))
    ckpt.save(3, state, {"step": 3})
    ckpt.close()
    if target == "fsdp":
        other = make("be_cnn", (2, 4), shard_members=True, sample=X[:1])
    else:
        other = make("be_cnn", target)
    restored, _, step = me.restore_checkpoint(str(tmp_path), other, X[:1])
    assert step == 3 and type(restored) is me.core.state.SharedState
    chex.assert_trees_all_equal(jax.device_get(restored), jax.device_get(state))
    specs = other.state_specs(X[:1])
    me.testing.assert_sharded_over_members(restored, other.mesh, specs)
    a = whole_members(ens.train_step(state, X, Y)[0])
    b = whole_members(other.train_step(restored, X, Y)[0])
    chex.assert_trees_all_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "params,match",
    [
        ({"Dense_9": {"kernel": np.zeros((64, 16))}}, "Dense_9/kernel is not a parameter"),
        ({"Dense_0": {"kernel": np.zeros((63, 16))}}, r"Dense_0/kernel has shape \(63, 16\)"),
        ({"Dense_0": {"lora_b": np.zeros((2, 15))}}, r"\(8, 2, 16\), one per member"),
    ],
)
def test_given_values_that_do_not_fit_are_one_line_naming_the_path(params, match):
    need_devices(8)
    with pytest.raises(me.UsageError, match=match) as err:
        make("lora_mlp").init(jax.random.PRNGKey(0), X[:1], params=params)
    assert "\n" not in str(err.value)


def test_given_values_per_member_and_for_all():
    need_devices(8)
    ens = make("lora_mlp")
    b = np.arange(M * 2 * 16, dtype=np.float32).reshape(M, 2, 16)
    state = ens.init(
        jax.random.PRNGKey(0),
        X[:1],
        params={"Dense_1": {"lora_a": np.ones((16, 2))}, "Dense_0": {"lora_b": b}},
    )
    np.testing.assert_array_equal(np.asarray(state.params["Dense_0"]["lora_b"]), b)
    np.testing.assert_array_equal(
        np.asarray(state.params["Dense_1"]["lora_a"]), np.ones((M, 16, 2))
    )


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(shared="kernel"), "shared='kernel' is not a filter"),
        (dict(frozen=lambda path, leaf: 1 / 0), "frozen filter raised ZeroDivisionError"),
        (dict(shared=lambda path, leaf: "yes"), "shared filter returned 'yes'"),
    ],
)
def test_bad_filters_are_one_line(kw, match):
    need_devices(8)
    with pytest.raises(me.UsageError, match=match):
        me.Ensemble(TinyBECNN(), TX, M, me.make_mesh(4, 2), **kw).init(jax.random.PRNGKey(0), X[:1])


def test_predict_and_evaluate_use_the_shared_leaves():
    need_devices(8)
    ens, state, _ = trained("be_cnn")
    members = whole_members(state)
    model = me.as_model(TinyBECNN())
    one = lambda i: traverse_util.unflatten_dict({p: v[i] for p, v in members.items()})
    want = np.mean(
        [jax.nn.softmax(model.apply(one(i), {}, X, False, None)[0]) for i in range(M)], axis=0
    )
    np.testing.assert_allclose(np.asarray(ens.predict(state, X)), want, atol=1e-6)
    assert 0 <= ens.evaluate(state, X, Y)["accuracy"] <= 1


def test_zoo_families_are_registered_and_init_as_the_paper_says():
    assert me.models.get_model("be_cnn").__class__ is me.models.BatchEnsembleCNN
    assert me.models.get_model("be_mlp").__class__ is me.models.BatchEnsembleMLP
    params = me.models.BEDense(64).init(jax.random.PRNGKey(0), jnp.ones((1, 32)))["params"]
    assert set(np.unique(np.asarray(params["r"]))) == {-1.0, 1.0}
    normal = me.models.BEDense(64, fast_init="normal").init(
        jax.random.PRNGKey(0), jnp.ones((1, 512))
    )
    r = np.asarray(normal["params"]["r"])
    assert abs(r.mean() - 1) < 0.1 and 0.4 < r.std() < 0.6
    assert me.models.lora(me.models.CNN(), rank=4, alpha=8.0).scale == 2.0
    with pytest.raises(ValueError, match="rank=0 must be a positive integer"):
        me.models.lora(me.models.MLP(), rank=0)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_inference_bundle_and_extracted_members_carry_the_shared_leaves(tmp_path):
    need_devices(8)
    ens, state, _ = trained("be_cnn")
    me.save_inference(str(tmp_path / "bundle"), state)
    other = make("be_cnn", (2, 4))
    loaded = me.load_inference(str(tmp_path / "bundle"), other, X[:1])
    chex.assert_trees_all_equal(whole_members(loaded), whole_members(state))
    got, want = other.predict(loaded, X), ens.predict(state, X)  # (2, 4) sums in another order
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
    members = whole_members(state)
    three = flat(me.extract_members(state, 3))
    chex.assert_trees_all_equal(three, {p: v[3] for p, v in members.items()})
    some = flat(me.extract_members(state, [1, 5]))
    chex.assert_trees_all_equal(some, {p: v[[1, 5]] for p, v in members.items()})


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_checkpoint_of_another_layout_is_refused_naming_the_shared_part(tmp_path):
    need_devices(8)
    _, state, _ = trained("be_cnn")
    ckpt = me.Checkpointer(str(tmp_path))
    ckpt.save(20, state, {"step": 20})
    ckpt.close()
    plain = me.Ensemble(TinyBECNN(), TX, M, me.make_mesh(4, 2))
    with pytest.raises(me.CheckpointError, match="shared") as err:
        me.restore_checkpoint(str(tmp_path), plain, X[:1])
    assert "\n" not in str(err.value)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_the_sharding_invariant_holds_for_shared_leaves_with_adam():
    """``assert_sharded_over_members`` knows shared leaves (no member axis, Adam's scalar
    count among them) and refuses one split over ``ensemble``."""
    need_devices(8)
    ens = me.Ensemble(
        TinyBECNN(), optax.adam(1e-3), M, me.make_mesh(4, 2), shared=me.models.batchensemble_shared
    )
    state, _ = ens.train_step(ens.init(jax.random.PRNGKey(0), X[:1]), X, Y)
    me.testing.assert_sharded_over_members(state, ens.mesh)
    me.testing.assert_sharded_over_members(state, ens.mesh, ens.state_specs(X[:1]))
    kernel = state.shared["BEDense_0"]["shared_kernel"]
    wrong = jax.device_put(
        kernel, jax.sharding.NamedSharding(ens.mesh, jax.sharding.PartitionSpec("ensemble"))
    )
    bad = state.replace(shared={**state.shared, "BEDense_0": {"shared_kernel": wrong}})
    with pytest.raises(AssertionError, match="shared leaf"):
        me.testing.assert_sharded_over_members(bad, ens.mesh)


WORKER = """
import sys
import meshensemble as me
pid, port, workdir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
me.use_fake_cpu_devices(4)
me.distributed.initialize(f"localhost:{port}", 2, pid)
import jax, optax
X, Y = me.testing.learnable_dataset(32)
ens = me.Ensemble(me.models.BatchEnsembleMLP((16,)), optax.sgd(0.1, momentum=0.9), 8,
                  me.make_mesh(4, 2), shared=me.models.batchensemble_shared)
state = ens.init(jax.random.PRNGKey(0), X[:1])
for _ in range(2):
    state, _ = ens.train_step(state, X, Y)
ckpt = me.Checkpointer(workdir)
ckpt.save(2, state, {"step": 2})
ckpt.close()
"""


@pytest.mark.slow  # among the heaviest default tests, measured
def test_two_processes_of_four_devices_train_what_one_process_of_eight_does(tmp_path):
    """The shared gradient's ``psum`` over ``ensemble`` crosses the processes (members 0-3
    in one, 4-7 in the other on a (4, 2) mesh): the result is the one-process run's.
    In the default set although it takes seconds: the only guard of issue 40's "2 processes
    x 4 devices equal 1 x 8" (2 steps, the smallest that carries the shared momentum)."""
    import subprocess
    import sys

    from meshensemble.runtime.distributed import free_port

    need_devices(8)
    (tmp_path / "worker.py").write_text(WORKER)
    port, workdir = str(free_port()), str(tmp_path / "run")
    procs = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "worker.py"), str(i), port, workdir],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    ens = me.Ensemble(
        me.models.BatchEnsembleMLP((16,)),
        TX,
        M,
        me.make_mesh(4, 2),
        shared=me.models.batchensemble_shared,
    )
    restored, _, step = me.restore_checkpoint(workdir, ens, X[:1])
    state = ens.init(jax.random.PRNGKey(0), X[:1])
    for _ in range(2):  # the second step also carries the shared momentum across
        state, _ = ens.train_step(state, X, Y)
    assert step == 2
    chex.assert_trees_all_close(jax.device_get(restored), jax.device_get(state), atol=1e-6)


def test_the_nonfinite_guard_knows_shared_leaves():
    """A NaN in a shared leaf is every member's; re-initialising some members keeps the
    shared leaves (a frozen backbone above all), unless they are the non-finite ones."""
    from meshensemble.training.guards import finite_members, select_members

    need_devices(8)
    ens = make("lora_mlp")
    state = ens.init(jax.random.PRNGKey(0), X[:1], params=BACKBONE)
    fresh = ens.init(jax.random.PRNGKey(1), X[:1])  # another backbone: must not be taken
    sick = state.replace(
        shared={
            **state.shared,
            "Dense_1": {
                **state.shared["Dense_1"],
                "bias": state.shared["Dense_1"]["bias"] * np.nan,
            },
        }
    )
    assert list(np.asarray(finite_members(state))) == [True] * M
    assert list(np.asarray(finite_members(sick))) == [False] * M
    mask = np.arange(M) == 3
    mixed = select_members(jnp.asarray(mask), fresh, state)
    chex.assert_trees_all_equal(jax.device_get(mixed.shared), jax.device_get(state.shared))
    a = np.asarray(mixed.params["Dense_0"]["lora_a"])
    np.testing.assert_array_equal(a[3], np.asarray(fresh.params["Dense_0"]["lora_a"])[3])
    np.testing.assert_array_equal(a[2], np.asarray(state.params["Dense_0"]["lora_a"])[2])
    redone = select_members(jnp.ones(M, bool), fresh, sick)
    chex.assert_trees_all_equal(jax.device_get(redone.shared), jax.device_get(fresh.shared))
