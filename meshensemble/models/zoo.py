"""Models for ensembles (Flax Linen): the Flax MNIST/HOWTO CNN, an MLP, ResNets, a Wide ResNet.

Every zoo model takes its input shape and number of classes from the data:
:func:`build_model` sets ``num_classes`` and asks the model whether it can take the
input (a ``check_input(input_shape)`` method: images ``[H, W, C]`` for the convolutional
models and the ViT, whose patch size must divide the image; the MLP takes any shape),
then traces its ``init`` on one example, so a model that cannot take the input is refused
in one line before any work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from meshensemble.core.mesh import DATA
from meshensemble.errors import UsageError
from meshensemble.models.conv import conv_general_dilated
from meshensemble.models.user import is_spec, user_model
from meshensemble.models.vit import ViT


def check_image_input(model: str, input_shape: tuple[int, ...], min_side: int = 1) -> None:
    """Refuses an input that is not an image ``[H, W, C]`` of at least ``min_side`` pixels.

    Args:
      model: the model's name, for the message.
      input_shape: one example's shape.
      min_side: the smallest height and width the model can take.

    Raises:
      UsageError: one line naming the model, the shape and the fix.

    Example:
      >>> check_image_input("cnn", (28, 28, 1))
      >>> check_image_input("cnn", (13,))
      Traceback (most recent call last):
      ...
      meshensemble.errors.UsageError: model 'cnn' takes images [H, W, C]; this data's examples ...
    """
    shape = tuple(int(d) for d in input_shape)
    if len(shape) != 3:
        raise UsageError(
            f"model {model!r} takes images [H, W, C]; this data's examples have shape "
            f"{shape}: use --model mlp for other inputs"
        )
    if min(shape[:2]) < min_side:
        raise UsageError(
            f"model {model!r} needs images of at least {min_side}x{min_side}; this data's are "
            f"{shape[0]}x{shape[1]}: use a model for small inputs (mlp, resnet)"
        )


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

    def check_input(self, input_shape: tuple[int, ...]) -> None:
        """Refuses inputs other than images ``[H, W, C]`` of at least 4x4 (two 2x2 pools).

        Args:
          input_shape: one example's shape.

        Raises:
          UsageError: one line naming the shape and the fix.

        Example:
          >>> me.models.CNN().check_input((32, 32, 3))   # None: it fits
        """
        check_image_input("cnn", input_shape, min_side=4)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        conv = conv_general_dilated(self.conv)
        for width in (32, 64):
            x = nn.Conv(features=width, kernel_size=(3, 3), conv_general_dilated=conv)(x)
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


def _batch_norm(train: bool, dtype: Any, axis_name: str | None) -> nn.BatchNorm:
    """The BatchNorm of the ResNets' stems and of :class:`WideBlock` (momentum 0.9)."""
    return nn.BatchNorm(
        use_running_average=not train, momentum=0.9, dtype=dtype, axis_name=batch_axis(axis_name)
    )


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

    def check_input(self, input_shape: tuple[int, ...]) -> None:
        """Refuses inputs other than images ``[H, W, C]`` (any size: it pools globally).

        Args:
          input_shape: one example's shape.

        Raises:
          UsageError: one line naming the shape and the fix.

        Example:
          >>> me.models.ResNet().check_input((8, 8, 1))
        """
        check_image_input("resnet", input_shape)

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = nn.Conv(self.num_filters, (3, 3), use_bias=False, dtype=self.dtype)(x)
        x = _batch_norm(train, self.dtype, self.axis_name)(x)
        x = nn.relu(x)
        for i, size in enumerate(self.stage_sizes):
            for j in range(size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                block = ResidualBlock(self.num_filters * 2**i, strides, self.dtype, self.axis_name)
                x = block(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)


class ResNet20(ResNet):
    """The CIFAR ResNet-20 of He et al. (2016): :class:`ResNet` with three blocks per stage.

    16, 32 and 64 channels, 0.27 M parameters for 10 classes; the other attributes are
    :class:`ResNet`'s.

    Example:
      >>> ResNet20().stage_sizes
      (3, 3, 3)
    """

    stage_sizes: Sequence[int] = (3, 3, 3)


class WideBlock(nn.Module):
    """A pre-activation basic block: BN, ReLU, 3x3 conv, BN, ReLU, (dropout), 3x3 conv.

    The shortcut is a 1x1 convolution of the pre-activated input when the shape changes.

    Attributes:
      features: output channels.
      strides: stride of the first convolution (and of the shortcut).
      dropout: dropout rate between the convolutions (training only).
      dtype: computation dtype.
      axis_name: the mesh axis BatchNorm averages its statistics over.

    Example:
      >>> block = WideBlock(8, (2, 2))
      >>> x = jnp.zeros((1, 8, 8, 4))
      >>> v = jax.eval_shape(block.init, key, x)
      >>> jax.eval_shape(lambda v: block.apply(v, x), v).shape
      (1, 4, 4, 8)
    """

    features: int
    strides: tuple[int, int] = (1, 1)
    dropout: float = 0.0
    dtype: Any = jnp.float32
    axis_name: str | None = DATA

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        norm = lambda: _batch_norm(train, self.dtype, self.axis_name)
        conv = lambda f, k, s: nn.Conv(f, k, s, use_bias=False, dtype=self.dtype)
        y = nn.relu(norm()(x))
        shortcut = x
        if x.shape[-1] != self.features or self.strides != (1, 1):
            shortcut = conv(self.features, (1, 1), self.strides)(y)
        y = conv(self.features, (3, 3), self.strides)(y)
        y = nn.relu(norm()(y))
        if self.dropout:
            y = nn.Dropout(self.dropout, deterministic=not train)(y)
        y = conv(self.features, (3, 3), (1, 1))(y)
        return shortcut + y


class WideResNet(nn.Module):
    """WRN-``depth``-``width`` for CIFAR-sized images (any ``[B, H, W, C]``, pooled globally).

    Attributes:
      depth: ``6n + 4`` (16, 22, 28, 40...): ``n`` blocks per stage.
      width: the widening factor ``k`` (stages of 16k, 32k, 64k channels).
      num_classes: number of outputs.
      dropout: dropout rate inside each block (training only; 0.3 in the paper's runs
        with dropout).
      dtype: computation dtype (parameters stay float32; logits are float32).
      axis_name: the mesh axis BatchNorm averages its statistics over (see
        :func:`meshensemble.models.batch_axis`).

    Example:
      >>> WideResNet(depth=28, width=10).check_input((32, 32, 3))   # None: it fits
    """

    depth: int = 28
    width: int = 10
    num_classes: int = 10
    dropout: float = 0.0
    dtype: Any = jnp.float32
    axis_name: str | None = DATA

    def blocks(self) -> int:
        """Blocks per stage, ``(depth - 4) / 6``.

        Returns:
          ``n``.

        Raises:
          UsageError: a depth that is not ``6n + 4`` with ``n >= 1``, or a width below 1.

        Example:
          >>> WideResNet(depth=28).blocks()
          4
        """
        if self.depth < 10 or (self.depth - 4) % 6 or self.width < 1:
            raise UsageError(
                f"WideResNet(depth={self.depth}, width={self.width}): the depth must be 6n + 4 "
                "(10, 16, 22, 28, 40) and the width >= 1"
            )
        return (self.depth - 4) // 6

    def check_input(self, input_shape: tuple[int, ...]) -> None:
        """Refuses inputs it cannot take: not images ``[H, W, C]``, or a bad depth.

        Args:
          input_shape: one example's shape.

        Raises:
          UsageError: one line naming the shape (or the depth) and the fix.

        Example:
          >>> WideResNet(depth=16, width=2).check_input((8, 8, 1))
        """
        check_image_input("wrn", input_shape)
        self.blocks()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        n = self.blocks()
        x = nn.Conv(16, (3, 3), use_bias=False, dtype=self.dtype)(x)
        for stage in range(3):
            for j in range(n):
                strides = (2, 2) if stage > 0 and j == 0 else (1, 1)
                features = 16 * self.width * 2**stage
                block = WideBlock(features, strides, self.dropout, self.dtype, self.axis_name)
                x = block(x, train)
        x = _batch_norm(train, self.dtype, self.axis_name)(x)
        x = jnp.mean(nn.relu(x), axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)


REGISTRY = {
    "cnn": CNN,
    "mlp": MLP,
    "howto_cnn": HowtoCNN,
    "resnet": ResNet,
    "vit": ViT,
    "resnet20": ResNet20,
    "wrn": WideResNet,
}
"""Model names :func:`get_model` and the CLI's ``--model`` accept. ``cnn`` and ``howto_cnn``
take images of at least 4x4 (MNIST's ``[B, 28, 28, 1]``, CIFAR's ``[B, 32, 32, 3]``);
``mlp`` any input, flattened; ``resnet`` (a ResNet-8), ``resnet20`` (the CIFAR ResNet-20)
and ``wrn`` (WRN-28-10 by default) any image, pooled globally; ``vit`` (a small Vision
Transformer with logical axis names on its parameters, patches of 4) images whose sides
its patch size divides. :func:`build_model` fits one to the data."""


def get_model(name: str) -> nn.Module:
    """Returns a fresh model by its CLI name, or a user's Linen module as ``module:Class``.

    Args:
      name: one of ``REGISTRY`` (``"cnn"``, ``"mlp"``, ``"howto_cnn"``, ``"resnet"``,
        ``"vit"``), or ``"module:Class"`` / ``"module:function"``
        (:func:`meshensemble.models.user.user_model`).

    Returns:
      The Linen module with its defaults.

    Raises:
      ValueError: an unknown name (a UsageError), or a spec that names no Linen module.

    Example:
      >>> me.models.get_model("cnn")
      CNN(...)
    """
    if is_spec(name):
        return user_model(name)
    if name not in REGISTRY:
        raise UsageError(
            f"model {name!r} is unknown; choose one of {', '.join(REGISTRY)}, or give a Flax "
            "module as module:Class"
        )
    return REGISTRY[name]()


def build_model(
    model: str | nn.Module,
    input_shape: Sequence[int],
    num_outputs: int,
    *,
    trace: bool = True,
    **fields: Any,
) -> nn.Module:
    """A zoo model (or any Linen model) fitted to the data: its outputs and its input.

    Sets ``num_classes=num_outputs`` (and ``fields``) on the model, asks it whether it can
    take ``input_shape`` (its ``check_input`` method, where it has one), then, with
    ``trace``, traces its ``init`` on one float32 example (shapes only, no arrays), so
    any model that cannot take the input is refused here, in one line. With the defaults
    of a name and MNIST's shape and 10 outputs, the model is the registry's default.

    Args:
      model: a name of :data:`REGISTRY`, or a Linen module with a ``num_classes`` field.
      input_shape: one example's shape, e.g. ``(32, 32, 3)`` or ``(13,)``.
      num_outputs: the model's outputs (the classes; ``2 * T`` for a Gaussian regression).
      trace: trace ``init`` on one example to check the input (about a second for a big
        model); False checks only ``check_input``.
      **fields: other attributes to set, e.g. ``depth=16, width=4`` for ``"wrn"``.

    Returns:
      The module.

    Raises:
      UsageError: an unknown name, an unknown field, ``num_outputs`` below 1, or an input
        the model cannot take (one line naming the model, the shape and the fix).

    Example:
      >>> build_model("cnn", (28, 28, 1), 10) == me.models.CNN()   # MNIST: the default
      True
      >>> build_model("resnet20", (8, 8, 1), 3).num_classes
      3
      >>> build_model("vit", (30, 30, 3), 10)
      Traceback (most recent call last):
      ...
      meshensemble.errors.UsageError: model 'vit': patch_size=4 does not divide the 30x30 ...
    """
    if isinstance(num_outputs, bool) or not isinstance(num_outputs, int) or num_outputs < 1:
        raise UsageError(f"num_outputs={num_outputs!r}; a model needs a positive number of outputs")
    name = model if isinstance(model, str) else type(model).__name__
    if isinstance(model, str):
        model = get_model(model)
    if any(f.name == "num_classes" for f in dataclasses.fields(model)):
        fields = {"num_classes": num_outputs, **fields}  # a module without it sets its own
    try:
        model = model.clone(**fields)
    except TypeError as err:
        raise UsageError(f"model {name!r}: {err}; pass only fields the model has") from None
    shape = tuple(int(d) for d in input_shape)
    check = getattr(model, "check_input", None)
    if check is not None:
        check(shape)
    if trace:
        try:
            jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, *shape), jnp.float32))
        except UsageError:
            raise
        except Exception as err:  # any model's own refusal, in one line
            text = " ".join(str(err).split())[:300] or type(err).__name__
            raise UsageError(
                f"model {name!r} cannot take inputs of shape {shape}: {text}; pick another "
                "model or change its settings"
            ) from None
    return model
