"""Members bigger than a device (#18): FSDP over ``data``, a ``model`` axis, resharding."""

from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from conftest import need_devices
from jax.sharding import PartitionSpec as P

import meshensemble as me
from meshensemble.core import sharding
from meshensemble.models import conv as conv_lib
from meshensemble.runtime.distributed import launch_local
from meshensemble.training import TrainConfig, train

RNG = np.random.default_rng(0)
IMAGES = RNG.random((16, 28, 28, 1), np.float32)
LABELS = RNG.integers(0, 10, 16).astype(np.int32)
MEMBERS = {"cnn": 4, "vit": 2}
"""Members per model. The CNN's 4 are 2 a device on (2, 4) and (2, 2, 2): several per device
(the members' loop over FSDP-split parameters), half the program of 8. The ViT's 2 are one a
device, half its program again, for what only the ViT has: parameters split over the
``model`` axis by their names."""
STEPS = 5
# SGD: an element-wise update whose result follows the gradient linearly, so a gradient
# that is not the data-mean (summed over data, or a slice's alone) moves the parameters
# far more than 1e-5; Adam would also turn the meshes' different float rounding of
# near-zero gradients into steps of the learning rate.
TX = optax.sgd(0.05, 0.9)
# A small ViT on 28x28 (16 patches of 7x7, one layer): every kind of parameter the
# default ViT has, FSDP- and model-split alike, at a fraction of its compile time.
SMALL_VIT = dict(patch_size=7, hidden=32, num_heads=2, num_layers=1, mlp_dim=64)


class SmallCNN(nn.Module):
    """The zoo CNN's layers (two 3x3 convolutions computed as the zoo's ``"auto"`` does,
    average pooling, two dense layers) at widths 4, 8 and 32: the same kinds of leaves
    (4-d kernels, 2-d kernels, biases, one of 10 that 4 does not divide) for FSDP to split,
    at a fraction of the zoo CNN's compile time (800k parameters a member)."""

    @nn.compact
    def __call__(self, x):
        conv = conv_lib.conv_general_dilated("auto")
        for features in (4, 8):
            x = nn.relu(nn.Conv(features, (3, 3), conv_general_dilated=conv)(x))
            x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(32)(x.reshape((x.shape[0], -1))))
        return nn.Dense(10)(x)


MODELS = {"cnn": SmallCNN, "vit": functools.partial(me.models.ViT, **SMALL_VIT)}


def trained(name: str, mesh_shape: tuple[int, ...], shard: bool):
    """(ens, state after STEPS steps, state bytes per device at init)."""
    need_devices(8)
    mesh = me.make_mesh(*mesh_shape[:2], model=mesh_shape[2] if len(mesh_shape) > 2 else None)
    ens = me.Ensemble(MODELS[name](), TX, MEMBERS[name], mesh=mesh, shard_members=shard)
    state = ens.init(jax.random.key(0), IMAGES[:1])
    nbytes = sharding.state_bytes_per_device(state)
    for _ in range(STEPS):
        state, _ = ens.train_step(state, IMAGES, LABELS)
    return ens, state, nbytes


LAYOUTS = {"plain": ((2, 4), False), "fsdp": ((2, 4), True), "fsdp+model": ((2, 2, 2), True)}
"""The reference (2, 4) unsharded, (2, 4) FSDP and (2, 2, model=2) FSDP."""


@functools.cache
def run(name: str, layout: str):
    """``trained`` of one model in one of :data:`LAYOUTS`, once per test run."""
    return trained(name, *LAYOUTS[layout])


def runs(name: str):
    """All three layouts of one model (the default set trains the ViT in two of them)."""
    return {layout: run(name, layout) for layout in LAYOUTS}


def init_bytes(name: str, layout: str) -> int:
    """The state bytes per device of one model initialised in one of :data:`LAYOUTS`, not
    trained (an init compiles in a fraction of a step's time)."""
    mesh_shape, shard = LAYOUTS[layout]
    mesh = me.make_mesh(*mesh_shape[:2], model=mesh_shape[2] if len(mesh_shape) > 2 else None)
    ens = me.Ensemble(MODELS[name](), TX, MEMBERS[name], mesh=mesh, shard_members=shard)
    return sharding.state_bytes_per_device(ens.init(jax.random.key(0), IMAGES[:1]))


def leaves_with_specs(ens, state):
    is_spec = lambda s: isinstance(s, P)
    specs = ens.state_specs(IMAGES[:1])
    return zip(jax.tree.leaves(state), jax.tree.leaves(specs, is_leaf=is_spec))


# ---------------------------------------------------------------- the rule
def test_the_fsdp_rule_takes_the_largest_divisible_dimension():
    assert sharding.fsdp_axis((3136, 256), 4) == 0
    assert sharding.fsdp_axis((3, 3, 1, 32), 4) == 3
    assert sharding.fsdp_axis((64, 4, 16), 4, taken=(0,)) == 2
    assert sharding.fsdp_axis((10,), 4) is None
    assert sharding.fsdp_axis((2,), 4) is None
    assert sharding.fsdp_axis((256,), 1) is None
    assert sharding.fsdp_axis((8, 8), 4) == 0  # ties: the first


def test_param_specs_follow_the_logical_rules_and_fsdp():
    need_devices(8)
    mesh = me.make_mesh(2, 2, model=2)
    spec = functools.partial(sharding.param_spec, mesh=mesh, shard_members=True)
    assert spec((64, 4, 16), names=("embed", "heads", "kv")) == P("ensemble", "data", "model")
    assert spec((64, 128), names=("embed", "mlp")) == P("ensemble", "data", "model")
    # unannotated (or names mapped to nothing): FSDP over data x model
    assert spec((64, 10), names=("embed", "classes")) == P("ensemble", ("data", "model"))
    assert spec((3136, 256)) == P("ensemble", ("data", "model"))
    assert spec((10,)) == P("ensemble", "data")  # data x model = 4 does not divide 10
    assert spec((9,)) == P("ensemble")
    # without FSDP only the annotated dimensions split
    assert sharding.param_spec((64, 128), mesh, False, ("embed", "mlp")) == P(
        "ensemble", None, "model"
    )
    assert sharding.manual_spec(P("ensemble", ("data", "model"), "model")) == P(
        "ensemble", "data", None
    )
    assert sharding.gather_axes({"a": P("ensemble", None, "data"), "b": P("ensemble")}) == (1, None)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_optimizer_state_follows_its_parameters():
    need_devices(8)
    ens = me.Ensemble(
        me.models.ViT(), optax.adam(1e-3), 2, me.make_mesh(2, 2, model=2), shard_members=True
    )
    specs = ens.state_specs(IMAGES[:1])
    kernel = specs.params["encoder_0"]["mlp"]["up"]["kernel"]
    assert kernel == P("ensemble", "data", "model")
    assert specs.opt_state[0].mu["encoder_0"]["mlp"]["up"]["kernel"] == kernel
    assert specs.opt_state[0].nu["encoder_0"]["mlp"]["up"]["kernel"] == kernel
    assert specs.opt_state[0].count == P("ensemble")
    assert specs.step == specs.rng == P("ensemble")


def test_make_mesh_and_parse_mesh_know_the_model_axis():
    need_devices(8)
    mesh = me.make_mesh(ensemble=2, data=2, model=2)
    assert dict(mesh.shape) == {"ensemble": 2, "data": 2, "model": 2}
    assert mesh.axis_names == ("ensemble", "data", me.MODEL)
    assert dict(me.make_mesh(data=2, model=2).shape) == {"ensemble": 2, "data": 2, "model": 2}
    assert tuple(me.make_mesh(2, 4).axis_names) == me.AXES  # no model unless asked for
    assert me.parse_mesh("ensemble=2,data=2,model=2") == {"ensemble": 2, "data": 2, "model": 2}
    with pytest.raises(ValueError, match="model=0"):
        me.make_mesh(2, 2, model=0)
    with pytest.raises(ValueError, match="needs 16 devices"):
        me.make_mesh(2, 4, model=2)


def test_describe_mesh_shows_three_axes_and_idle_devices():
    need_devices(8)
    from meshensemble.core.mesh import describe_mesh, idle_devices

    assert describe_mesh(me.make_mesh(2, 4)) == "ensemble=2 x data=4 x model=1"
    assert describe_mesh(me.make_mesh(2, 1, model=4)) == "ensemble=2 x data=1 x model=4"
    assert idle_devices(me.make_mesh(2, 1)) == jax.device_count() - 2
    assert idle_devices(me.make_mesh(2, 2, model=2)) == jax.device_count() - 8


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_model_axis_that_splits_no_parameter_says_so():
    """model=3 divides neither the heads (2) nor the MLP (64) of SMALL_VIT: 0 leaves split.
    (The note reads the parameters' shapes only: the state's shapes, as in its docstring.)"""
    need_devices(8)
    notes = {}
    for m in (3, 2):
        ens = me.Ensemble(MODELS["vit"](), TX, 2, mesh=me.make_mesh(2, 1, model=m))
        state = jax.eval_shape(lambda ens=ens: ens.init(jax.random.key(0), IMAGES[:1]))
        notes[m] = sharding.model_axis_note(ens, state, IMAGES[:1])
        split, total = sharding.model_split_count(ens.state_specs(IMAGES[:1]))
        assert (split == 0) == (m == 3) and total == len(jax.tree.leaves(state.params))
    assert notes[2] is None
    assert notes[3].startswith(f"warning: mesh model=3 splits 0 of {total} parameter leaves")
    assert "widths named for 'model': 2, 64" in notes[3] and "(model=2 or 4)" in notes[3]
    plain = me.Ensemble(MODELS["vit"](), TX, 2, mesh=me.make_mesh(2, 1))
    assert sharding.model_axis_note(plain, None, None) is None


def test_the_pmap_backend_refuses_sharded_members():
    need_devices(8)
    with pytest.raises(ValueError, match="shard_members=True needs backend='shard_map'"):
        me.Ensemble(me.models.MLP(), TX, 8, me.make_mesh(8, 1), backend="pmap", shard_members=True)
    with pytest.raises(ValueError, match="no 'model' axis"):
        me.Ensemble(me.models.MLP(), TX, 4, me.make_mesh(4, 1, model=2), backend="pmap")


def test_the_sharded_layout_needs_the_input_shape_not_init():
    need_devices(8)
    ens = me.Ensemble(me.models.MLP(), TX, 2, me.make_mesh(2, 4), shard_members=True)
    with pytest.raises(ValueError, match=r"Ensemble\(\.\.\., sample=images\[:1\]\)"):
        ens.state_spec  # noqa: B018


# ---------------------------------------------------------------- equivalence
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_fsdp_and_the_model_axis_train_the_same_members_as_unsharded(name):
    got = runs(name)
    want = jax.device_get(got["plain"][1].params)
    for layout in ("fsdp", "fsdp+model"):
        chex.assert_trees_all_close(
            jax.device_get(got[layout][1].params), want, atol=1e-5, rtol=0, custom_message=layout
        )
    chex.assert_trees_all_close(
        jax.device_get(got["fsdp"][1].opt_state),
        jax.device_get(got["plain"][1].opt_state),
        atol=1e-5,
        rtol=0,
    )


@pytest.mark.parametrize("name", ["cnn", pytest.param("vit", marks=pytest.mark.slow)])
def test_state_bytes_per_device_fall_by_data_and_by_data_x_model(name):
    plain, fsdp, both = (init_bytes(name, k) for k in ("plain", "fsdp", "fsdp+model"))
    # data = 4 and data x model = 2 x 2: a quarter, up to the few leaves nothing divides
    # (odd biases, Adam's count, the step counters and keys)
    print(f"{name}: state bytes per device {plain} -> fsdp {fsdp} -> fsdp+model {both}")
    assert plain / fsdp > 3.8
    assert plain / both > 3.8
    ens, state, _ = run(name, "fsdp+model")  # after training, still split as specified
    split = [(leaf, spec) for leaf, spec in leaves_with_specs(ens, state) if len(tuple(spec)) > 1]
    assert split  # the state really is split inside the members' devices
    for leaf, spec in split:
        assert leaf.sharding.spec == spec


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_predict_and_evaluate_on_a_sharded_state_equal_unsharded(name):
    got = runs(name)
    plain, state = got["plain"][0], got["plain"][1]
    want = np.asarray(plain.predict(state, IMAGES[:13]))  # 13: padded over data
    want_members = np.asarray(plain.predict_members(state, IMAGES))
    want_logits = np.asarray(plain.predict_members(state, IMAGES, logits=True))
    want_eval = plain.evaluate(state, IMAGES, LABELS, batch_size=8)
    for layout in ("fsdp", "fsdp+model"):
        ens, sharded, _ = got[layout]
        np.testing.assert_allclose(np.asarray(ens.predict(sharded, IMAGES[:13])), want, atol=1e-5)
        np.testing.assert_allclose(
            np.asarray(ens.predict_members(sharded, IMAGES)), want_members, atol=1e-5
        )
        logits = np.asarray(ens.predict_members(sharded, IMAGES, logits=True))
        np.testing.assert_allclose(logits, want_logits, atol=1e-4)
        result = ens.evaluate(sharded, IMAGES, LABELS, batch_size=8)
        np.testing.assert_allclose(result["nll"], want_eval["nll"], atol=1e-5)
        assert result["accuracy"] == want_eval["accuracy"]


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("name", sorted(MODELS))
def test_extract_members_returns_an_ordinary_single_model_tree(name):
    ens, state, _ = run(name, "fsdp+model")
    last = MEMBERS[name] - 1
    params = me.extract_members(state, last)
    plain = jax.device_get(run(name, "plain")[1].params)
    chex.assert_trees_all_close(params, jax.tree.map(lambda v: v[last], plain), atol=1e-5, rtol=0)
    logits = jax.jit(MODELS[name]().apply)({"params": params}, IMAGES[:4])  # not op by op
    member = np.asarray(ens.predict_members(state, IMAGES[:4]))[last]
    np.testing.assert_allclose(np.asarray(jax.nn.softmax(logits)), member, atol=1e-5)


# ---------------------------------------------------------------- checkpoints
@pytest.mark.parametrize(
    "target,shard",
    [((2, 1), False), pytest.param((1, 1), False, marks=pytest.mark.slow), ((2, 4), True)],
    ids=["2x1", "1 device", "2x4 fsdp"],
)
def test_a_sharded_checkpoint_restores_onto_another_mesh(tmp_path, target, shard):
    ens, state, _ = run("vit", "fsdp+model")  # trained with FSDP on (2, 2, model=2)
    want = jax.device_get(state)
    ckpt = me.Checkpointer(str(tmp_path / "w"))
    try:
        ckpt.save(STEPS, state, {"step": STEPS})
    finally:
        ckpt.close()
    if target == (1, 1):
        mesh = me.make_mesh(1, 1, devices=jax.devices()[:1])
    else:
        mesh = me.make_mesh(*target, devices=jax.devices()[: target[0] * target[1]])
    other = me.Ensemble(MODELS["vit"](), TX, MEMBERS["vit"], mesh=mesh, shard_members=shard)
    restored, _, step = me.restore_checkpoint(str(tmp_path / "w"), other, IMAGES[:1])
    assert step == STEPS
    chex.assert_trees_all_equal(jax.device_get(restored), want)
    if shard:  # restored straight into the target's FSDP layout
        for leaf, spec in leaves_with_specs(other, restored):
            assert leaf.sharding.spec == spec
    assert {d for v in jax.tree.leaves(restored) for d in v.sharding.device_set} <= set(
        mesh.devices.flat
    )
    np.testing.assert_allclose(
        np.asarray(other.predict(restored, IMAGES)),
        np.asarray(ens.predict(state, IMAGES)),
        atol=1e-5,
    )
    restored, _ = other.train_step(restored, IMAGES, LABELS)  # and training goes on there


# ---------------------------------------------------------------- multi-process
@pytest.mark.slow
def test_two_processes_with_fsdp_equal_one(tmp_path):
    need_devices(8)
    data = me.data.synthetic(num_train=128, num_test=40, seed=3)
    npz = me.data.save_npz(data, tmp_path / "synthetic.npz")
    common = dict(
        source="npz", data_file=str(npz), model="mlp", members=4, mesh="ensemble=2,data=4",
        batch_size=32, max_steps=3, learning_rate=0.05, eval_batch_size=40,
        shard_members=True, quiet=True, input="device",
    )  # fmt: skip
    # input="device": "auto" asks jax.devices()[0] for its memory, which process 1 cannot
    # address (MemoryStats ... only supported for addressable devices; data/stream.py)
    argv = ["train", "--shard-members"]
    for key, value in common.items():
        if key not in ("shard_members", "quiet"):
            argv += [f"--{key.replace('_', '-')}", str(value)]
    workdir = tmp_path / "multi"
    argv += ["--workdir", str(workdir), "--quiet"]
    assert launch_local(argv, 2, 4, timeout=300, prefix_output=False) == 0
    one = train(TrainConfig(**common, workdir=str(tmp_path / "one")))
    assert any(len(tuple(s)) > 1 for s in jax.tree.leaves(
        one.ensemble.state_spec, is_leaf=lambda s: isinstance(s, P)
    ))  # fmt: skip
    ens = me.Ensemble(me.models.MLP(), TX, 4, me.make_mesh(4, 1), input_transform=me.data.normalize)
    state, _, step = me.restore_checkpoint(str(workdir), ens, data.test_images[:1])
    assert step == 3
    chex.assert_trees_all_close(jax.device_get(state), jax.device_get(one.state), atol=1e-5)


# ---------------------------------------------------------------- bench
@pytest.mark.slow
def test_the_layouts_bench_reports_state_bytes_and_step_time():
    need_devices(8)
    from meshensemble import bench

    layouts = [(2, 4, 1, False), (2, 4, 1, True), (2, 2, 2, True)]
    rows = bench.measure_layouts(me.models.MLP(), layouts, members=2, batch_size=8, steps=2)
    assert [r["layout"] for r in rows] == ["2x4x1", "2x4x1 fsdp", "2x2x2 fsdp"]
    assert rows[0]["state_bytes"] / rows[1]["state_bytes"] > 3.5
    assert rows[0]["state_bytes"] / rows[2]["state_bytes"] > 3.5
    assert all(r["step_s"] > 0 and r["compile_s"] > 0 and np.isfinite(r["loss"]) for r in rows)
    assert "2x2x2 fsdp" in bench.format_layouts(rows)


def test_a_global_norm_optimizer_on_split_members_is_one_line_and_keeps_the_state():
    """clip_by_global_norm needs whole members: shard_map's 1,300-character type error
    becomes one line naming the transform and the fix; nothing is donated."""
    need_devices(8)
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1))
    mesh = me.make_mesh(2, 4)
    ens = me.Ensemble(me.models.MLP((16,)), tx, 2, mesh, shard_members=True, sample=IMAGES[:1])
    state = ens.init(jax.random.key(0), IMAGES[:1])
    with pytest.raises(me.errors.UsageError, match=r"shard_members=True\): .*clip_by_global_n"):
        ens.train_step(state, IMAGES, LABELS)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))
