"""Models for ensembles (Flax Linen): the Flax MNIST/HOWTO CNN, an MLP and a small ResNet."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from meshensemble.core.mesh import DATA
from meshensemble.models.conv import conv_general_dilated
from meshensemble.models.vit import ViT


class CNN(nn.Module):
    """The CNN of the Flax MNIST example and of the Flax ensembling HOWTO.

    Two 3x3 convolutions (32, 64 features) with ReLU and 2x2 average pooling, a dense
    layer of 256 and a dense output layer.

    ``conv`` only changes how the convolutions are computed, never the parameters
    (names, shapes, initialisation) or the values beyond float rounding: ``"auto"``
    computes them with XLA's convolution on CPU (``"canonical"``: its backward pass in
    XLA:CPU's fast layout) and on TPU, and as im2col matmuls on GPU (under ``vmap`` over
    members batched matmuls, never a grouped convolution); see
    :mod:`meshensemble.models.conv`.

    Attributes:
      num_classes: number of outputs.
      conv: ``"auto"``, ``"xla"`` (``lax.conv_general_dilated``, as in the Flax
        example), ``"im2col"`` or ``"canonical"``.

    Example:
      >>> x = me.data.normalize(images[:2])                # [B, 28, 28, 1] float32
      >>> params = jax.eval_shape(me.models.CNN().init, key, x)   # shapes; CNN().init(key, x)
      >>> jax.eval_shape(me.models.CNN().apply, params, x).shape  # CNN().apply(params, x)
      (2, 10)
      >>> plain = me.models.CNN(conv="xla")  # the Flax example's computation, same params
    """

    num_classes: int = 10
    conv: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        conv = conv_general_dilated(self.conv)
        x = nn.Conv(features=32, kernel_size=(3, 3), conv_general_dilated=conv)(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=64, kernel_size=(3, 3), conv_general_dilated=conv)(x)
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
      axis_name: the mesh axis the batch is split over; BatchNorm's statistics are
        averaged over it (see :func:`batch_axis`), so the model trains the same on any
        mesh, as the zoo's ResNet does.

    Example:
      >>> x = me.data.normalize(images[:2])
      >>> params = jax.eval_shape(me.models.MLP((128,)).init, key, x)  # shapes only
      >>> logits = jax.eval_shape(lambda p: me.models.MLP((128,)).apply(p, x, train=False), params)
      >>> logits.shape  # [B, 10]
      (2, 10)
    """

    features: Sequence[int] = (128,)
    num_classes: int = 10
    dropout: float = 0.0
    batch_norm: bool = False
    axis_name: str | None = DATA

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = jnp.reshape(x, (x.shape[0], -1))
        for width in self.features:
            x = nn.Dense(width)(x)
            if self.batch_norm:
                axis = batch_axis(self.axis_name)
                x = nn.BatchNorm(use_running_average=not train, axis_name=axis)(x)
            x = nn.relu(x)
            if self.dropout:
                x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(self.num_classes)(x)


class HowtoCNN(CNN):
    """The CNN of the Flax ensembling HOWTO ("Ensembling on multiple devices").

    The HOWTO trains the Flax MNIST example's CNN, so this is :class:`CNN` under the
    HOWTO's name: the same architecture, parameter names and initialisation (a
    subclass that changes nothing). Inputs ``[B, 28, 28, 1]``, outputs ``[B, 10]``.

    Attributes:
      num_classes: number of outputs.

    Example:
      >>> x = me.data.normalize(images[:1])
      >>> params = jax.eval_shape(me.models.HowtoCNN().init, key, x)["params"]  # shapes only
      >>> sorted(params) == sorted(jax.eval_shape(me.models.CNN().init, key, x)["params"])
      True
    """


def batch_axis(axis_name: str | None = DATA) -> str | None:
    """``axis_name`` if that mesh axis is bound here (inside the ensemble's steps), else None.

    For ``nn.BatchNorm(axis_name=...)``: inside :class:`meshensemble.Ensemble`'s steps the
    batch is split over the mesh axis ``"data"``, and BatchNorm must average its statistics
    over it to normalise with the whole batch's; outside a mesh (a plain ``model.apply``)
    there is no such axis and each call's batch is the whole batch.

    Args:
      axis_name: the axis to average over (default :data:`meshensemble.DATA`), or None.

    Returns:
      ``axis_name`` when it is bound in the current trace with a size above 1, else None
      (over one device the mean is the value itself; skipping it keeps a step on a mesh
      whose manual axes are all of size 1 free of collectives, which XLA refuses there).

    Example:
      >>> train = False
      >>> bn = nn.BatchNorm(use_running_average=not train, axis_name=me.models.batch_axis())
      >>> me.models.batch_axis() is None   # outside a mesh step: no axis to average over
      True
    """
    if axis_name is None:
        return None
    try:
        size = lax.axis_size(axis_name)
    except NameError:
        return None
    return axis_name if size > 1 else None


class ResidualBlock(nn.Module):
    """A basic residual block: two 3x3 convolutions with BatchNorm, and a shortcut.

    The shortcut is a 1x1 convolution with BatchNorm when the shape changes. The last
    BatchNorm's scale starts at zero, so each block starts as the identity.

    Attributes:
      features: output channels.
      strides: stride of the first convolution (and of the shortcut).
      dtype: computation dtype.
      axis_name: the mesh axis the batch is split over; BatchNorm's statistics are
        averaged over it (see :func:`batch_axis`).

    Example:
      >>> x = jnp.zeros((1, 8, 8, 16))
      >>> block = ResidualBlock(16, (2, 2))
      >>> variables = jax.eval_shape(lambda: block.init(key, x, train=False))  # shapes only
      >>> y = jax.eval_shape(lambda v: block.apply(v, x, train=False), variables)
      >>> y.shape   # [B, H/2, W/2, 16]
      (1, 4, 4, 16)
    """

    features: int
    strides: tuple[int, int] = (1, 1)
    dtype: Any = jnp.float32
    axis_name: str | None = DATA

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        axis = batch_axis(self.axis_name)
        norm = lambda **kw: nn.BatchNorm(
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
            axis_name=axis,
            **kw,
        )
        conv = lambda f, k, s: nn.Conv(f, k, s, use_bias=False, dtype=self.dtype)
        residual = x
        y = nn.relu(norm()(conv(self.features, (3, 3), self.strides)(x)))
        y = norm(scale_init=nn.initializers.zeros_init())(conv(self.features, (3, 3), (1, 1))(y))
        if residual.shape != y.shape:
            residual = norm()(conv(self.features, (1, 1), self.strides)(residual))
        return nn.relu(residual + y)


class ResNet(nn.Module):
    """A small ResNet with BatchNorm for CIFAR-sized images (default ``[B, 32, 32, 3]``).

    A 3x3 stem convolution (``num_filters`` channels, no pooling), then one stage of
    :class:`ResidualBlock` per entry of ``stage_sizes``: stage ``i`` has
    ``stage_sizes[i]`` blocks of ``num_filters * 2**i`` channels, its first block
    striding by 2 (except in stage 0); then global average pooling and a dense layer.
    The default ``stage_sizes=(1, 1, 1)`` is a ResNet-8 (16, 32, 64 channels);
    ``(3, 3, 3)`` is the CIFAR ResNet-20; ``stage_sizes=(2, 2, 2, 2), num_filters=64``
    is ResNet-18-like. Thanks to the global pooling any ``[B, H, W, C]`` input works
    (MNIST's ``[B, 28, 28, 1]`` too).

    ``model_state`` is ``{"batch_stats": ...}``; call with ``train=True`` and
    ``mutable=["batch_stats"]`` to train (the ensemble's adapter does this). BatchNorm
    statistics are those of the whole batch across the ``data`` axis (see ``axis_name``).

    Attributes:
      stage_sizes: residual blocks per stage.
      num_filters: channels of the stem and of the first stage.
      num_classes: number of outputs.
      dtype: computation dtype (parameters stay float32), e.g. ``jnp.bfloat16``.
      axis_name: the mesh axis the batch is split over (default ``"data"``): in training,
        BatchNorm normalises with the statistics of the whole global batch, averaged over
        this axis, so ``data=1`` and ``data=2`` train the same members. Outside a mesh
        (the axis is not bound) each call uses its own batch, as plain Flax does.

    Example:
      >>> model = me.models.ResNet(stage_sizes=(2, 2, 2), num_filters=16)
      >>> x = jnp.zeros((2, 32, 32, 3))                               # CIFAR-10's shapes
      >>> variables = jax.eval_shape(model.init, key, x)   # shapes; model.init(key, x): arrays
      >>> logits = jax.eval_shape(lambda v: model.apply(v, x, train=False), variables)
      >>> logits.shape                                     # [B, 10]
      (2, 10)
    """

    stage_sizes: Sequence[int] = (1, 1, 1)
    num_filters: int = 16
    num_classes: int = 10
    dtype: Any = jnp.float32
    axis_name: str | None = DATA

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = nn.Conv(self.num_filters, (3, 3), use_bias=False, dtype=self.dtype)(x)
        x = nn.BatchNorm(
            use_running_average=not train,
            momentum=0.9,
            dtype=self.dtype,
            axis_name=batch_axis(self.axis_name),
        )(x)
        x = nn.relu(x)
        for i, size in enumerate(self.stage_sizes):
            for j in range(size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                block = ResidualBlock(self.num_filters * 2**i, strides, self.dtype, self.axis_name)
                x = block(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)


REGISTRY = {"cnn": CNN, "mlp": MLP, "howto_cnn": HowtoCNN, "resnet": ResNet, "vit": ViT}
"""Model names :func:`get_model` and the CLI's ``--model`` accept. ``cnn``, ``howto_cnn``
and ``mlp`` take MNIST's ``[B, 28, 28, 1]``; ``resnet`` is made for CIFAR-sized
``[B, 32, 32, 3]`` and, with its global pooling, runs on MNIST too; ``vit`` (a small
Vision Transformer with logical axis names on its parameters, patches of 4) takes both."""


def get_model(name: str) -> nn.Module:
    """Returns a fresh model by its CLI name.

    Args:
      name: one of ``REGISTRY`` (``"cnn"``, ``"mlp"``, ``"howto_cnn"``, ``"resnet"``,
        ``"vit"``).

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
