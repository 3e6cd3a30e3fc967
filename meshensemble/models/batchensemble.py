"""BatchEnsemble (Wen, Tran and Ba, 2020): a shared weight per layer and rank-1 fast weights.

Member ``i`` of a BatchEnsemble layer computes ``((x * r_i) @ W) * s_i + b_i``: the
weight ``W`` is shared by all members, the fast weights ``r_i`` (one per input feature
or channel) and ``s_i`` (one per output) and the bias are the member's own. Written as an
ordinary Flax layer of one member, whose shared weight is named ``shared_kernel``, it is
an ensemble member on the mesh with ``shared=`` :func:`batchensemble_shared`: the
``Ensemble`` keeps one ``W`` per device and stacks the fast weights on the member axis.

The fast weights start as the paper's: random signs (each entry +1 or -1 with
probability 1/2, so members differ from the first step), or a normal around 1
(``fast_init="normal"``, standard deviation ``fast_std``), as uncertainty-baselines'
``random_sign_init`` offers both.

Example:
  >>> be = me.Ensemble(me.models.BatchEnsembleMLP((8,)), optax.sgd(0.1), 2, mesh,
  ...                  shared=me.models.batchensemble_shared)
  >>> state = be.init(key, images[:1])
  >>> state.shared["BEDense_0"]["shared_kernel"].shape   # one copy, no member axis
  (784, 8)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from meshensemble.models.conv import conv_general_dilated
from meshensemble.models.zoo import check_image_input

SHARED_NAME = "shared_kernel"
"""The name of a BatchEnsemble layer's shared weight (what :func:`batchensemble_shared` picks)."""
FAST_INITS = ("random_sign", "normal")
"""The initialisations of the fast weights :class:`BEDense` and :class:`BEConv` take."""


def batchensemble_shared(path: tuple[str, ...], leaf: Any) -> bool:
    """The BatchEnsemble layers' shared weights: the filter for ``Ensemble(shared=...)``.

    Args:
      path: a parameter's path, e.g. ``("BEDense_0", "shared_kernel")``.
      leaf: the parameter (unused).

    Returns:
      Whether the leaf is a layer's shared weight (named :data:`SHARED_NAME`).

    Example:
      >>> batchensemble_shared(("BEDense_0", "shared_kernel"), None)
      True
      >>> batchensemble_shared(("BEDense_0", "r"), None)
      False
    """
    return bool(path) and path[-1] == SHARED_NAME


def fast_weight_init(kind: str = "random_sign", std: float = 0.5) -> Any:
    """The initialiser of the fast weights ``r`` and ``s``.

    Args:
      kind: ``"random_sign"`` (+1 or -1, each with probability 1/2) or ``"normal"``
        (a normal with mean 1 and standard deviation ``std``).
      std: the normal's standard deviation.

    Returns:
      A Flax initialiser ``(key, shape, dtype) -> array``.

    Raises:
      ValueError: an unknown ``kind``.

    Example:
      >>> sorted(set(fast_weight_init()(key, (64,)).tolist()))
      [-1.0, 1.0]
    """
    if kind not in FAST_INITS:
        raise ValueError(f"fast_init={kind!r} is unknown; choose one of {', '.join(FAST_INITS)}")

    def init(key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
        if kind == "random_sign":
            return jax.random.rademacher(key, tuple(shape), jnp.int32).astype(dtype)
        return (1.0 + std * jax.random.normal(key, tuple(shape))).astype(dtype)

    return init


def _along_last(v: jax.Array, ndim: int) -> jax.Array:
    """``v [F]`` shaped to broadcast along the last axis of an ``ndim``-array (no promotion)."""
    return jnp.reshape(v, (1,) * (ndim - 1) + v.shape)


class BEDense(nn.Module):
    """A dense layer of one BatchEnsemble member: ``((x * r) @ shared_kernel) * s + bias``.

    Attributes:
      features: output features.
      use_bias: add the member's own bias.
      fast_init: ``"random_sign"`` or ``"normal"`` (:func:`fast_weight_init`).
      fast_std: the normal's standard deviation.
      kernel_init: the shared weight's initialiser (``nn.Dense``'s by default).

    Example:
      >>> x = jnp.ones((2, 5))
      >>> params = BEDense(3).init(key, x)["params"]
      >>> {k: v.shape for k, v in params.items()}
      {'shared_kernel': (5, 3), 'r': (5,), 's': (3,), 'bias': (3,)}
    """

    features: int
    use_bias: bool = True
    fast_init: str = "random_sign"
    fast_std: float = 0.5
    kernel_init: Any = nn.initializers.lecun_normal()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        fast = fast_weight_init(self.fast_init, self.fast_std)
        kernel = self.param(SHARED_NAME, self.kernel_init, (x.shape[-1], self.features))
        r = self.param("r", fast, (x.shape[-1],))
        s = self.param("s", fast, (self.features,))
        y = jnp.dot(x * _along_last(r, x.ndim), kernel) * _along_last(s, x.ndim)
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
            y = y + _along_last(bias, y.ndim)
        return y


class BEConv(nn.Module):
    """A 2-D convolution of one BatchEnsemble member: ``conv(x * r, shared_kernel) * s + bias``.

    Inputs ``[B, H, W, C]``; ``r`` has one entry per input channel, ``s`` per output one.

    Attributes:
      features: output channels.
      kernel_size: the window, e.g. ``(3, 3)``.
      strides: the strides.
      padding: ``"SAME"`` or ``"VALID"`` (or explicit pairs, as ``lax`` takes them).
      use_bias: add the member's own bias.
      fast_init: ``"random_sign"`` or ``"normal"`` (:func:`fast_weight_init`).
      fast_std: the normal's standard deviation.
      conv: how the convolution is computed (:mod:`meshensemble.models.conv`; ``"auto"``).
      kernel_init: the shared weight's initialiser (``nn.Conv``'s by default).

    Example:
      >>> params = BEConv(4, (3, 3)).init(key, jnp.ones((1, 8, 8, 2)))["params"]
      >>> params["shared_kernel"].shape, params["r"].shape, params["s"].shape
      ((3, 3, 2, 4), (2,), (4,))
    """

    features: int
    kernel_size: Sequence[int] = (3, 3)
    strides: Sequence[int] = (1, 1)
    padding: Any = "SAME"
    use_bias: bool = True
    fast_init: str = "random_sign"
    fast_std: float = 0.5
    conv: str = "auto"
    kernel_init: Any = nn.initializers.lecun_normal()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        fast = fast_weight_init(self.fast_init, self.fast_std)
        shape = (*self.kernel_size, x.shape[-1], self.features)
        kernel = self.param(SHARED_NAME, self.kernel_init, shape)
        r = self.param("r", fast, (x.shape[-1],))
        s = self.param("s", fast, (self.features,))
        conv = conv_general_dilated(self.conv)
        dims = ("NHWC", "HWIO", "NHWC")
        x = x * _along_last(r, x.ndim)
        y = conv(x, kernel, tuple(self.strides), self.padding, dimension_numbers=dims)
        y = y * _along_last(s, y.ndim)
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
            y = y + _along_last(bias, y.ndim)
        return y


class BatchEnsembleCNN(nn.Module):
    """The zoo's CNN (:class:`meshensemble.models.CNN`) with BatchEnsemble layers.

    Two 3x3 :class:`BEConv` (32, 64 channels) with ReLU and 2x2 average pooling, a
    :class:`BEDense` of 256 and a :class:`BEDense` output layer: the CNN's shared weights
    (``shared_kernel``) plus, per member, fast weights and biases. Train it with
    ``shared=me.models.batchensemble_shared``.

    Attributes:
      num_classes: number of outputs.
      fast_init: ``"random_sign"`` or ``"normal"``.
      conv: how the convolutions are computed (:mod:`meshensemble.models.conv`).

    Example:
      >>> x = me.data.normalize(images[:2])
      >>> params = jax.eval_shape(BatchEnsembleCNN().init, key, x)["params"]
      >>> params["BEConv_1"]["shared_kernel"].shape, params["BEConv_1"]["s"].shape
      ((3, 3, 32, 64), (64,))
    """

    num_classes: int = 10
    fast_init: str = "random_sign"
    conv: str = "auto"

    def check_input(self, input_shape: tuple[int, ...]) -> None:
        """Refuses inputs other than images ``[H, W, C]`` of at least 4x4 (two 2x2 pools).

        Args:
          input_shape: one example's shape.

        Raises:
          UsageError: one line naming the shape and the fix.

        Example:
          >>> BatchEnsembleCNN().check_input((32, 32, 3))   # None: it fits
        """
        check_image_input("be_cnn", input_shape, min_side=4)

    def member_layout(self) -> dict[str, Any]:
        """The member layout this model is made for: its shared weights shared.

        Returns:
          ``{"shared": batchensemble_shared, "frozen": None}``, the ``Ensemble``'s
          keywords (what ``meshensemble train --model be_*`` passes).

        Example:
          >>> net = BatchEnsembleCNN()
          >>> me.Ensemble(net, optax.sgd(0.1), 2, mesh, **net.member_layout()).layout.trivial
          False
        """
        return {"shared": batchensemble_shared, "frozen": None}

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for width in (32, 64):
            x = BEConv(width, (3, 3), fast_init=self.fast_init, conv=self.conv)(x)
            x = nn.relu(x)
            x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(BEDense(256, fast_init=self.fast_init)(x))
        return BEDense(self.num_classes, fast_init=self.fast_init)(x)


class BatchEnsembleMLP(nn.Module):
    """The zoo's MLP (:class:`meshensemble.models.MLP`, without dropout or BatchNorm) with
    :class:`BEDense` layers; train it with ``shared=me.models.batchensemble_shared``.

    Attributes:
      features: hidden layer widths.
      num_classes: number of outputs.
      fast_init: ``"random_sign"`` or ``"normal"``.

    Example:
      >>> x = me.data.normalize(images[:2])
      >>> params = jax.eval_shape(BatchEnsembleMLP((16,)).init, key, x)["params"]
      >>> sorted(params), params["BEDense_1"]["shared_kernel"].shape
      (['BEDense_0', 'BEDense_1'], (16, 10))
    """

    features: Sequence[int] = (128,)
    num_classes: int = 10
    fast_init: str = "random_sign"

    def member_layout(self) -> dict[str, Any]:
        """The member layout this model is made for: its shared weights shared.

        Returns:
          ``{"shared": batchensemble_shared, "frozen": None}``, the ``Ensemble``'s
          keywords (what ``meshensemble train --model be_*`` passes).

        Example:
          >>> net = BatchEnsembleMLP()
          >>> me.Ensemble(net, optax.sgd(0.1), 2, mesh, **net.member_layout()).layout.trivial
          False
        """
        return {"shared": batchensemble_shared, "frozen": None}

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.reshape(x, (x.shape[0], -1))
        for width in self.features:
            x = nn.relu(BEDense(width, fast_init=self.fast_init)(x))
        return BEDense(self.num_classes, fast_init=self.fast_init)(x)
