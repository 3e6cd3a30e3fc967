"""Models for ensembles: the Flax MNIST CNN and small companions (Flax Linen)."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


class CNN(nn.Module):
    """The CNN of the Flax MNIST example and of the Flax ensembling HOWTO.

    Two 3x3 convolutions (32, 64 features) with ReLU and 2x2 average pooling, a dense
    layer of 256 and a dense output layer.

    Attributes:
      num_classes: number of outputs.

    Example:
      >>> logits = me.models.CNN().apply(params, images)  # images [B, 28, 28, 1] -> [B, 10]
    """

    num_classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Conv(features=32, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=64, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.Dense(features=256)(x)
        x = nn.relu(x)
        return nn.Dense(features=self.num_classes)(x)


class MLP(nn.Module):
    """A multi-layer perceptron on flattened inputs, with optional dropout and BatchNorm.

    Attributes:
      features: hidden layer widths.
      num_classes: number of outputs.
      dropout: dropout rate after each hidden layer (0 for none).
      batch_norm: put a BatchNorm before each hidden activation.

    Example:
      >>> logits = me.models.MLP((128,)).apply(params, images, train=False)  # [B, 10]
    """

    features: Sequence[int] = (128,)
    num_classes: int = 10
    dropout: float = 0.0
    batch_norm: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = jnp.reshape(x, (x.shape[0], -1))
        for width in self.features:
            x = nn.Dense(width)(x)
            if self.batch_norm:
                x = nn.BatchNorm(use_running_average=not train)(x)
            x = nn.relu(x)
            if self.dropout:
                x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(self.num_classes)(x)


REGISTRY = {"cnn": CNN, "mlp": MLP}
"""Model names the CLI's ``--model`` accepts."""


def get_model(name: str) -> nn.Module:
    """Returns a fresh model by its CLI name.

    Args:
      name: one of ``REGISTRY`` (``"cnn"``, ``"mlp"``).

    Returns:
      The Linen module with its defaults.

    Raises:
      ValueError: an unknown name.

    Example:
      >>> me.models.get_model("cnn")
      CNN(...)
    """
    if name not in REGISTRY:
        raise ValueError(f"model {name!r} is unknown; choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name]()
