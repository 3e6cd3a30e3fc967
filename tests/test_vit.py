"""The zoo's Vision Transformer: shapes, logical axis names, and ensembles of it on a mesh."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import need_devices
from jax.sharding import PartitionSpec as P

import meshensemble as me
from meshensemble import models, testing

X, Y = testing.learnable_dataset(16)  # 8x8x1 images
TINY = dict(patch_size=4, hidden=16, num_heads=2, num_layers=2, mlp_dim=32)
NAMES = {"patch", "embed", "position", "heads", "kv", "mlp", "classes", None}
KEY = jax.random.key(0)


def tiny(**kw) -> models.ViT:
    """A 2-layer ViT on 8x8 images (4 patches of 4x4, plus the class token)."""
    return models.ViT(**{**TINY, **kw})


def init(model: models.ViT, x) -> dict:
    """``model.init(KEY, x)`` compiled as one program (op by op, a ViT's init and apply
    compile every primitive apart: seconds, for the same numbers)."""
    return jax.jit(model.init)(KEY, x)


def apply(model: models.ViT, variables, x, **kw) -> jax.Array:
    """``model.apply(variables, x, **kw)`` compiled as one program (``train`` static)."""
    return jax.jit(model.apply, static_argnames="train")(variables, x, **kw)


# ------------------------------------------------------------------ the module alone
@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_logits_are_float32_batch_by_classes(pool):
    model = tiny(pool=pool, num_classes=7)
    variables = init(model, X[:1])
    logits = apply(model, variables, X, train=False)
    assert logits.shape == (16, 7) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()


def test_default_vit_takes_mnist_and_cifar_shapes():
    model = models.get_model("vit")
    assert isinstance(model, models.ViT) and models.REGISTRY["vit"] is models.ViT
    for shape in [(2, 28, 28, 1), (2, 32, 32, 3)]:
        out = jax.eval_shape(lambda x, m=model: m.init_with_output(KEY, x)[0], jnp.zeros(shape))
        assert out.shape == (2, 10) and out.dtype == jnp.float32


@pytest.mark.slow  # among the heaviest default tests, measured
def test_dropout_only_in_training():
    model = tiny(dropout=0.1)
    variables = init(model, X[:1])
    plain = apply(tiny(), variables, X)
    np.testing.assert_array_equal(apply(model, variables, X, train=False), plain)
    rngs = {"dropout": jax.random.key(1)}
    assert not np.allclose(apply(model, variables, X, train=True, rngs=rngs), plain, atol=1e-3)


def test_bad_patch_size_and_pool_name_the_fix():
    with pytest.raises(ValueError, match="patch_size=3 does not divide the image size 8x8"):
        tiny(patch_size=3).init(KEY, X[:1])
    with pytest.raises(ValueError, match="pool='max' is unknown"):
        tiny(pool="max").init(KEY, X[:1])


def test_every_parameter_has_logical_names_of_its_rank():
    model = tiny()
    params = init(model, X[:1])["params"]
    boxes = jax.tree.leaves(params, is_leaf=lambda v: isinstance(v, nn.LogicallyPartitioned))
    assert boxes and all(isinstance(b, nn.LogicallyPartitioned) for b in boxes)
    specs = models.param_logical_axes(model, X[:1])
    shapes = nn.meta.unbox(params)
    flat_specs = dict(jax.tree_util.tree_flatten_with_path(specs)[0])
    flat_shapes = dict(jax.tree_util.tree_flatten_with_path(shapes)[0])
    assert flat_specs.keys() == flat_shapes.keys()
    for path, spec in flat_specs.items():
        where = jax.tree_util.keystr(path)
        assert len(spec) == flat_shapes[path].ndim, f"{where}: {spec} for {flat_shapes[path].shape}"
        assert set(spec) <= NAMES, f"{where}: {spec} uses an undocumented name"
    layer = specs["encoder_0"]
    assert layer["attention"]["query"]["kernel"] == P("embed", "heads", "kv")
    assert layer["attention"]["out"]["kernel"] == P("heads", "kv", "embed")
    assert layer["mlp"]["up"]["kernel"] == P("embed", "mlp")
    assert layer["mlp"]["down"]["kernel"] == P("mlp", "embed")
    assert specs["patch_embed"]["kernel"] == P("patch", "embed")
    assert specs["pos_embed"] == P(None, "position", "embed")
    assert specs["head"]["kernel"] == P("embed", "classes")
    # the rules table: heads and the MLP over "model", the rest replicated
    mesh_specs = nn.logical_to_mesh(specs, models.LOGICAL_AXIS_RULES)
    assert mesh_specs["encoder_0"]["mlp"]["up"]["kernel"] == P(None, "model")
    assert mesh_specs["encoder_0"]["attention"]["key"]["kernel"] == P(None, "model", None)
    assert mesh_specs["head"]["kernel"] == P(None, None)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_without_logical_axes_the_same_plain_parameters():
    boxed = init(tiny(), X[:1])["params"]
    plain = init(tiny(logical_axes=False), X[:1])["params"]
    assert not any(
        isinstance(v, nn.LogicallyPartitioned)
        for v in jax.tree.leaves(plain, is_leaf=lambda v: isinstance(v, nn.meta.AxisMetadata))
    )
    testing.assert_trees_close(plain, nn.meta.unbox(boxed))
    # apply takes boxed and unboxed parameters alike
    a = apply(tiny(), {"params": boxed}, X)
    b = apply(tiny(), {"params": nn.meta.unbox(boxed)}, X)
    np.testing.assert_array_equal(a, b)
    # a model without annotations: every parameter replicated
    specs = models.param_logical_axes(models.MLP((8,)), X[:1])
    assert set(jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))) == {P()}


def test_bf16_compute_gives_float32_logits_close_to_float32():
    variables = init(tiny(), X[:1])
    want = apply(tiny(), variables, X)
    got = apply(tiny(dtype=jnp.bfloat16), variables, X)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=0.1)
    assert not np.array_equal(got, want)  # it did compute in bfloat16


# ------------------------------------------------------------------ ensembles of ViTs
@pytest.mark.slow
def test_members_equal_single_models_at_init_and_after_training_with_dropout():
    need_devices(8)
    ens = me.Ensemble(tiny(dropout=0.1), optax.adam(1e-2), 8, me.make_mesh(4, 2))
    state = ens.init(KEY, X[:1])
    testing.assert_members_equal_single_models(ens, state, KEY, X[:1])
    # data=2 sums each gradient in two halves, the single model in one (another float order),
    # and Adam divides by sqrt(v): one attention weight of 256 moved by 4.7e-5 after 3 steps
    # (2026-11-28); 1e-4 is the mesh-invariance test's bound below, for the same reason
    testing.assert_members_match_single_model_training(ens, KEY, X, Y, steps=3, atol=1e-4)


@pytest.mark.slow
def test_ensemble_of_vits_is_mesh_invariant():
    need_devices(8)

    def train(mesh):
        ens = me.Ensemble(tiny(), optax.adam(1e-3), 8, mesh)
        state = ens.init(KEY, X[:1])
        losses = []
        for _ in range(3):
            state, metrics = ens.train_step(state, X, Y)
            losses.append(metrics["loss"])
        return {"params": state.params, "loss": jnp.stack(losses)}

    # data=2 sums each gradient in two halves (another float order), and Adam divides by
    # sqrt(v): a near-zero gradient's rounding moves its update by up to ~lr; 1e-4 still
    # catches members or shards stepping on the wrong examples (differences of order lr).
    out = testing.assert_mesh_invariant(train, [(4, 2), (8, 1)], rtol=1e-4, atol=1e-4)
    assert np.isfinite(out["loss"]).all() and (out["loss"][-1] < out["loss"][0]).all()


@pytest.mark.slow
def test_bf16_ensemble_trains():
    need_devices(8)
    for compute in [{"compute_dtype": "bfloat16"}, {}]:
        model = tiny() if compute else tiny(dtype=jnp.bfloat16)
        ens = me.Ensemble(model, optax.adam(1e-2), 4, me.make_mesh(4, 2), **compute)
        state = ens.init(KEY, X[:1])
        for _ in range(2):
            state, metrics = ens.train_step(state, X, Y)
        assert jax.tree.leaves(state.params)[0].dtype == jnp.float32
        assert np.isfinite(me.distributed.fetch(metrics["loss"])).all()


@pytest.mark.slow
def test_checkpoint_restores_onto_another_mesh_and_members_extract(tmp_path):
    need_devices(8)
    make = lambda mesh: me.Ensemble(tiny(), optax.adam(1e-2), 8, mesh)
    ens = make(me.make_mesh(4, 2))
    state, _ = ens.train_step(ens.init(KEY, X[:1]), X, Y)
    mngr = me.checkpoint_manager(str(tmp_path))
    me.save_checkpoint(mngr, 1, state, {"step": 1})
    mngr.wait_until_finished()
    mngr.close()
    other = make(me.make_mesh(8, 1))
    restored, _, step = me.restore_checkpoint(str(tmp_path), other, X[:1], echo=lambda _: None)
    assert step == 1
    testing.assert_sharded_over_members(restored, other.mesh)
    testing.assert_trees_close(restored.params, state.params)
    params = me.extract_members(restored, 3)
    probs = jax.nn.softmax(tiny().apply({"params": params}, X))
    np.testing.assert_allclose(
        probs, me.distributed.fetch(other.predict_members(restored, X))[3], atol=1e-6
    )


# ------------------------------------------------------------------ a mesh of model axis only
@pytest.mark.parametrize("shape", [(1, 1, 2), pytest.param((1, 1, 8), marks=pytest.mark.slow)])
def test_a_mesh_with_only_a_model_axis_trains_the_single_model(shape):
    """ensemble=1, data=1, model=P: every manual axis has size 1 (XLA refused the
    all-reduces over them); the step skips them and equals one device's step."""
    need_devices(shape[2])

    def run(mesh):  # one layer: what the model axis splits, at half the compile time
        ens = me.Ensemble(tiny(num_layers=1), optax.sgd(0.1, 0.9), 1, mesh)
        state, metrics = ens.train_step(ens.init(KEY, X[:1]), X, Y)
        return state, metrics

    state, metrics = run(me.make_mesh(*shape[:2], model=shape[2]))
    want, want_metrics = run(me.make_mesh(1, 1, devices=jax.devices()[:1]))
    kernel = state.params["encoder_0"]["mlp"]["up"]["kernel"]
    assert kernel.sharding.spec == P("ensemble", None, "model")  # really split over model
    testing.assert_trees_close(state.params, want.params, rtol=1e-5, atol=1e-6)
    testing.assert_trees_close(metrics["loss"], want_metrics["loss"], rtol=1e-5, atol=1e-6)
