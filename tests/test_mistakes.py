"""Bad input through the Python API: one clear error, raised before anything runs.

Each test names the mistake a user makes and checks the one-line message that names the
value and the fix (issue "Every mistake gets one clear line").
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from conftest import Tiny, need_devices
from flax import nnx

import meshensemble as me

X = np.random.default_rng(0).normal(size=(16, 8, 8, 1)).astype(np.float32)
Y = (np.arange(16) % 10).astype(np.int32)


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


@pytest.fixture(params=["shard_map", "pmap"])
def ens_state(request):
    need_devices(8)
    ens = me.Ensemble(Tiny(), optax.sgd(0.1), 8, me.make_mesh(8, 1), backend=request.param)
    return ens, ens.init(jax.random.key(0), X[:1])


@pytest.mark.slow  # among the heaviest default tests, measured
def test_reused_state_after_train_step_raises_on_both_backends(ens_state):
    ens, state = ens_state
    new_state, _ = ens.train_step(state, X, Y)
    for call in (
        lambda: ens.train_step(state, X, Y),
        lambda: ens.predict(state, X),
        lambda: ens.evaluate(state, X, Y),
    ):
        with pytest.raises(ValueError, match="use the state that call returned") as err:
            call()
        one_line(err)
    # the returned state is alive and keeps training
    new_state, metrics = ens.train_step(new_state, X, Y)
    assert np.isfinite(np.asarray(metrics["loss"])).all()


@pytest.mark.parametrize("shift,found", [(10, "[10, 19]"), (-1, "[-1, 8]")])
def test_labels_out_of_range_name_the_range_and_the_classes(ens_state, shift, found):
    ens, state = ens_state
    for call in (
        lambda: ens.train_step(state, X, Y + shift),
        lambda: ens.evaluate(state, X, Y + shift),
        lambda: ens.train_step(state, X, ens.place(Y + shift)),  # labels already on device
    ):
        with pytest.raises(ValueError, match="predicts 10 classes") as err:
            call()
        assert found in one_line(err)
    # nothing ran: the state was not consumed
    ens.train_step(state, X, Y)


def test_per_member_labels_are_range_checked():
    need_devices(8)
    ens = me.Ensemble(Tiny(), optax.sgd(0.1), 8, me.make_mesh(8, 1))
    state = ens.init(jax.random.key(0), X[:1])
    xs, ys = np.stack([X] * 8), np.stack([Y] * 8)
    ys[3, 0] = 12
    with pytest.raises(ValueError, match=r"\[0, 12\] but the model predicts 10"):
        ens.train_step(state, xs, ys)


def test_evaluate_rejects_bad_batch_sizes_and_bins(ens_state):
    ens, state = ens_state
    for kwargs, name in (
        ({"batch_size": -5}, "batch_size=-5"),
        ({"batch_size": 0}, "batch_size=0"),
        ({"num_bins": 0}, "num_bins=0"),
    ):
        with pytest.raises(ValueError, match="must be a positive integer") as err:
            ens.evaluate(state, X, Y, **kwargs)
        assert name in one_line(err)


def test_empty_inputs_and_python_lists(ens_state):
    ens, state = ens_state
    with pytest.raises(ValueError, match="hold no example") as err:
        ens.predict(state, X[:0])
    one_line(err)
    probs = ens.predict(state, X.tolist())  # a Python list works like the array
    np.testing.assert_allclose(np.asarray(probs), np.asarray(ens.predict(state, X)), atol=1e-6)
    state, metrics = ens.train_step(state, X.tolist(), Y.tolist())
    assert np.asarray(metrics["loss"]).shape == (8,)


def test_uncalled_optimizer_and_module_class_fail_in_the_constructor():
    with pytest.raises(TypeError, match=r"call it first, e\.g\. optax\.sgd\(") as err:
        me.Ensemble(Tiny(), optax.sgd, 8)
    one_line(err)
    with pytest.raises(TypeError, match=r"pass an instance: Tiny\(\.\.\.\)"):
        me.Ensemble(Tiny, optax.sgd(0.1), 8)


def test_nnx_class_needing_arguments_gets_the_factory_hint():
    class Net(nnx.Module):
        def __init__(self, width: int, rngs: nnx.Rngs):
            self.linear = nnx.Linear(64, width, rngs=rngs)

        def __call__(self, x):
            return self.linear(x.reshape((x.shape[0], -1)))

    with pytest.raises(TypeError, match=r"NNXModel\(lambda rngs: Net\(width=\.\.\., rngs=rngs\)\)"):
        me.Ensemble(Net, optax.sgd(0.1), 8)
    ens = me.Ensemble(me.NNXModel(lambda rngs: Net(10, rngs)), optax.sgd(0.1), 8)
    assert ens.num_classes(ens.init(jax.random.key(0), X[:1]), X) == 10


def test_float16_is_refused_for_want_of_loss_scaling():
    with pytest.raises(ValueError, match="needs loss scaling") as err:
        me.Ensemble(Tiny(), optax.sgd(0.1), 8, compute_dtype="float16")
    assert "bfloat16" in one_line(err)


def test_train_step_bounds_the_programs_in_flight(monkeypatch):
    """A host loop that never reads a result still waits once more than 2 are queued."""
    need_devices(8)
    from jax._src.array import ArrayImpl

    ens = me.Ensemble(Tiny(), optax.sgd(0.1), 8, me.make_mesh(4, 2))
    state = ens.init(jax.random.key(0), X[:1])
    waits = []
    real = ArrayImpl.block_until_ready
    monkeypatch.setattr(ArrayImpl, "block_until_ready", lambda a: (waits.append(a), real(a))[1])
    outputs = []
    for _ in range(6):
        state, metrics = ens.train_step(state, X, Y)
        outputs.append(metrics["loss"])
    # every step beyond the bound waited for the oldest one still queued, in order
    bound = me.core.ensemble.MAX_IN_FLIGHT
    assert [id(a) for a in waits] == [id(a) for a in outputs[: 6 - bound]]


class ShardBN(nn.Module):
    """Dense + the zoo's BatchNorm convention (statistics averaged over ``data``)."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(16)(x.reshape((x.shape[0], -1)))
        x = nn.BatchNorm(use_running_average=not train, axis_name=me.models.batch_axis())(x)
        return nn.Dense(10)(nn.relu(x))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["resnet", "own_batchnorm"])
def test_batchnorm_statistics_are_the_whole_batch_whatever_the_data_axis(model):
    """data=1 and data=2 (and 4) train the same members: BatchNorm reduces over ``data``."""
    need_devices(8)
    net = me.models.ResNet(stage_sizes=(1,), num_filters=4) if model == "resnet" else ShardBN()
    xs = np.random.default_rng(1).normal(size=(16, 8, 8, 3)).astype(np.float32)
    results = []
    for shape in ((2, 1), (2, 2), (2, 4), (1, 8)):
        ens = me.Ensemble(net, optax.sgd(0.1, 0.9), 2, me.make_mesh(*shape))
        state = ens.init(jax.random.key(0), xs[:1])
        for _ in range(2):
            state, metrics = ens.train_step(state, xs, Y)
        results.append(jax.device_get((metrics["loss"], state.params, state.model_state)))
    for other in results[1:]:
        for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(other)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_state_of_another_optimizer_is_one_line():
    """An SGD ensemble's state on an Adam ensemble: not 'TraceState has no attribute mu'."""
    need_devices(2)
    mesh = me.make_mesh(2, 1)
    sgd = me.Ensemble(Tiny(), optax.sgd(0.1, 0.9), 2, mesh)
    adam = me.Ensemble(Tiny(), optax.adam(1e-3), 2, mesh)
    state = sgd.init(jax.random.key(0), X[:1])
    with pytest.raises(me.UsageError, match=r"^state's optimizer state \(TraceState, ") as err:
        adam.train_step(state, X, Y)
    assert "is not what this ensemble's optimizer makes (ScaleByAdamState" in one_line(err)
    state, _ = sgd.train_step(state, X, Y)  # nothing was consumed: the state still trains


def test_images_of_another_size_are_one_line():
    """Not a raw Flax ScopeParamShapeError: the images' shape, the parameter, the fix."""
    need_devices(2)
    ens = me.Ensemble(me.models.MLP((8,)), optax.sgd(0.1), 2, me.make_mesh(2, 1))
    state = ens.init(jax.random.key(0), X[:1])
    wrong = np.zeros((16, 9, 9, 1), np.float32)
    want = (
        r"^images of shape \(16, 9, 9, 1\) do not fit the state's parameters \(parameter "
        r"/Dense_0/kernel has shape \(64, 8\), these images need \(81, 8\)\); give images"
    )
    for call in (
        lambda: ens.train_step(state, wrong, Y),
        lambda: ens.predict(state, wrong),
        lambda: ens.evaluate(state, wrong, Y),
    ):
        with pytest.raises(me.UsageError, match=want) as err:
            call()
        one_line(err)


def test_save_inference_refuses_a_temperature_per_member_of_another_count(tmp_path):
    need_devices(2)
    ens = me.Ensemble(Tiny(), optax.sgd(0.1), 2, me.make_mesh(2, 1))
    state = ens.init(jax.random.key(0), X[:1])
    path = tmp_path / "bundle"
    with pytest.raises(ValueError, match=r"^temperature holds 3 values but the state has 2 "):
        me.save_inference(str(path), state, temperature=[1.0, 1.5, 2.0])
    assert not path.exists()  # refused before anything was written
