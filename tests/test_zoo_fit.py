"""Models that follow the data (issue 39): every zoo model takes the input shape and the
number of classes from the data, the CIFAR ResNet-20 and a Wide ResNet are in the zoo, and a
model that cannot take the input is refused in one line; MNIST's models are unchanged.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshensemble as me
from meshensemble.errors import UsageError
from meshensemble.models import build_model


def _count(model, shape) -> int:
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, *shape)))
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(shapes["params"]))


@pytest.mark.slow  # among the heaviest default tests, measured
def test_mnist_models_are_the_registry_defaults_bitwise():
    x = jnp.zeros((1, 28, 28, 1))
    for name in ("cnn", "mlp", "howto_cnn", "resnet", "vit"):
        built = build_model(name, (28, 28, 1), 10)
        assert built == me.models.get_model(name), name
    a = me.models.CNN().init(jax.random.key(0), x)
    b = build_model("cnn", (28, 28, 1), 10).init(jax.random.key(0), x)
    chex.assert_trees_all_equal(a, b)


@pytest.mark.parametrize(
    "name, fields", [("cnn", {}), ("mlp", {}), ("resnet", {}), ("vit", {"hidden": 16}),
                     ("resnet20", {}), ("wrn", {"depth": 10, "width": 1})],
)  # fmt: skip
@pytest.mark.parametrize("shape, classes", [((32, 32, 3), 10), ((8, 8, 1), 3)])
def test_every_zoo_model_takes_the_data_s_shape_and_classes(name, fields, shape, classes):
    model = build_model(name, shape, classes, **fields)
    x = jnp.zeros((2, *shape))
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    out = jax.eval_shape(lambda v: model.apply(v, x), variables)
    assert out.shape == (2, classes)


def test_the_cifar_resnets_have_their_published_sizes():
    assert _count(build_model("resnet20", (32, 32, 3), 10, trace=False), (32, 32, 3)) == 272_474
    wrn = build_model("wrn", (32, 32, 3), 10, trace=False)  # WRN-28-10: 36.5 M parameters
    assert (wrn.depth, wrn.width) == (28, 10)
    assert 36_400_000 < _count(wrn, (32, 32, 3)) < 36_600_000


@pytest.mark.parametrize(
    "args, fields, parts",
    [
        (
            ("vit", (30, 30, 3), 10),
            {},
            ["patch_size=4 does not divide the 30x30 images", "(1, 2, 3"],
        ),
        (("cnn", (13,), 3), {}, ["model 'cnn' takes images [H, W, C]", "(13,)", "--model mlp"]),
        (("resnet20", (13,), 3), {}, ["model 'resnet' takes images"]),
        (("cnn", (2, 2, 1), 3), {}, ["at least 4x4", "2x2"]),
        (("wrn", (8, 8, 1), 3), {"depth": 12}, ["depth=12", "6n + 4"]),
        (("mlp", (8,), 3), {"bogus": 1}, ["model 'mlp'", "bogus"]),
        (("nope", (8,), 3), {}, ["model 'nope' is unknown"]),
        (("mlp", (8,), 0), {}, ["num_outputs=0"]),
    ],
)
def test_a_model_that_cannot_take_the_input_is_one_line(args, fields, parts):
    with pytest.raises(UsageError) as err:
        build_model(*args, **fields)
    text = str(err.value)
    assert "\n" not in text
    for part in parts:
        assert part in text, (part, text)


def test_a_user_model_without_check_input_is_refused_by_tracing_it():
    import flax.linen as nn

    class Fixed(nn.Module):  # a model that only takes 784 features
        num_classes: int = 10

        @nn.compact
        def __call__(self, x):
            return nn.Dense(self.num_classes)(x.reshape(x.shape[0], 784))

    assert build_model(Fixed(), (28, 28, 1), 4).num_classes == 4
    with pytest.raises(UsageError) as err:
        build_model(Fixed(), (32, 32, 3), 10)
    assert "model 'Fixed' cannot take inputs of shape (32, 32, 3)" in str(err.value)
