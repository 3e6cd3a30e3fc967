"""LoRA adapters on a model's dense and convolution layers: ensembles over one backbone.

:func:`lora` wraps a Flax Linen module (the zoo's CNN or MLP, or a user's) so that each
``nn.Dense`` and ``nn.Conv`` it calls computes ``layer(x) + (alpha / rank) * (x A) B``
(Hu et al., 2021): ``A`` of the layer kernel's shape with ``rank`` outputs (for a
convolution, a convolution of the layer's window and strides to ``rank`` channels),
``B`` ``[rank, features]``. ``B`` starts at zero, so every member starts exactly at the
backbone; ``A`` is drawn per member (as ``peft`` does, uniform with bound
``1/sqrt(fan_in)``), so the members move apart from the first step (an ensemble of
adapters, Wang et al., 2023).

The adapters are new leaves ``lora_a``, ``lora_b`` beside each layer's own ``kernel`` and
``bias``, under the module's own paths: a backbone trained as the plain module (e.g. by
``meshensemble train --members 1``) loads by name (``ens.init(key, x, params=backbone)``).
:func:`lora_backbone` picks every other leaf; ``Ensemble(shared=..., frozen=...)`` with it
keeps one frozen copy of the backbone per device, without gradient or optimizer state.

Example:
  >>> net = me.models.lora(me.models.MLP((8,)), rank=2, alpha=4.0)
  >>> ens = me.Ensemble(net, optax.sgd(0.1), 2, mesh, shared=net.backbone,
  ...                   frozen=net.backbone)
  >>> state = ens.init(key, images[:1].astype(np.float32))
  >>> state.params["Dense_0"]["lora_b"].shape, state.shared["Dense_0"]["kernel"].shape
  ((2, 2, 8), (784, 8))
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from meshensemble.core.adapters import LinenModel

PyTree = Any
ADAPTER_NAMES = ("lora_a", "lora_b")
"""The names of the adapter leaves :func:`lora` adds to each adapted layer."""

_INSIDE = contextvars.ContextVar("meshensemble_lora_inside", default=False)


def lora_backbone(path: tuple[str, ...], leaf: Any) -> bool:
    """The backbone of a :func:`lora` model: every leaf that is not an adapter.

    Pass it as ``shared=`` and ``frozen=`` (one frozen copy of the backbone per device).

    Args:
      path: a parameter's path, e.g. ``("Dense_0", "kernel")``.
      leaf: the parameter (unused).

    Returns:
      False for ``lora_a``/``lora_b``, True otherwise.

    Example:
      >>> lora_backbone(("Dense_0", "kernel"), None), lora_backbone(("Dense_0", "lora_a"), None)
      (True, False)
    """
    return not (path and path[-1] in ADAPTER_NAMES)


@dataclasses.dataclass(frozen=True)
class LoRA(LinenModel):
    """A Linen module whose dense and convolution layers carry low-rank adapters.

    The :class:`meshensemble.Model` of one member (build it with :func:`lora`); ``init``
    and ``apply`` run the module with the adapters added by a Flax method interceptor.

    Attributes:
      module: the Linen module (the backbone's architecture).
      rng_streams: as :class:`~meshensemble.LinenModel`'s.
      rank: the adapters' rank ``r``.
      alpha: the scale's numerator: the adapters' output is scaled by ``alpha / rank``.
      targets: the layer classes that get adapters (default ``nn.Dense``, ``nn.Conv``).

    Example:
      >>> net = LoRA(me.models.MLP((8,)), rank=2, alpha=2.0)
      >>> net.scale
      1.0
    """

    rank: int = 4
    alpha: float = 4.0
    targets: tuple[type, ...] = (nn.Dense, nn.Conv)

    @property
    def scale(self) -> float:
        """``alpha / rank``, the adapters' scale."""
        return float(self.alpha) / int(self.rank)

    @property
    def backbone(self) -> Any:
        """The filter of the backbone's leaves (:func:`lora_backbone`)."""
        return lora_backbone

    def member_layout(self) -> dict[str, Any]:
        """The member layout adapters are made for: the backbone frozen and shared.

        Returns:
          ``{"shared": lora_backbone, "frozen": lora_backbone}``, the ``Ensemble``'s keywords.

        Example:
          >>> LoRA(me.models.MLP((8,))).member_layout()["frozen"] is lora_backbone
          True
        """
        return {"shared": lora_backbone, "frozen": lora_backbone}

    def _adapt(self, next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        layer = context.module
        wanted = context.method_name == "__call__" and isinstance(layer, self.targets)
        if not wanted or _INSIDE.get():
            return next_fun(*args, **kwargs)
        y = next_fun(*args, **kwargs)
        kernel = layer.get_variable("params", "kernel")
        a_init = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform")
        a = layer.param("lora_a", a_init, (*kernel.shape[:-1], self.rank), kernel.dtype)
        b = layer.param("lora_b", nn.initializers.zeros_init(), (self.rank, kernel.shape[-1]))
        down = layer.clone(parent=None, features=self.rank, use_bias=False)
        token = _INSIDE.set(True)
        try:  # the layer's own computation (window, strides, padding) down to `rank`
            h = down.apply({"params": {"kernel": a}}, *args, **kwargs)
        finally:
            _INSIDE.reset(token)
        return y + (self.scale * jnp.dot(h, b.astype(h.dtype))).astype(y.dtype)

    def init(self, rng: jax.Array, x: jax.Array) -> tuple[PyTree, PyTree]:
        with nn.intercept_methods(self._adapt):
            return super().init(rng, x)

    def apply(
        self, params: PyTree, model_state: PyTree, x: jax.Array, train: bool, rng: jax.Array
    ) -> tuple[jax.Array, PyTree]:
        with nn.intercept_methods(self._adapt):
            return super().apply(params, model_state, x, train, rng)

    def logical_axes(self, sample: Any) -> PyTree:
        """The logical axis names of the parameters, adapters included (unnamed)."""
        with nn.intercept_methods(self._adapt):
            return super().logical_axes(sample)


def lora(module: nn.Module, rank: int = 4, alpha: float | None = None) -> LoRA:
    """Low-rank adapters on ``module``'s dense and convolution layers (one member's model).

    Args:
      module: a Flax Linen module, e.g. ``me.models.MLP()`` or ``me.models.CNN()``.
      rank: the adapters' rank ``r`` (a positive integer).
      alpha: the scale's numerator (``alpha / rank``); default ``rank`` (scale 1).

    Returns:
      A :class:`LoRA` model; its ``backbone`` filter names the module's own leaves.

    Raises:
      ValueError: ``rank`` is not a positive integer, ``alpha`` not a positive number, or
        ``module`` not a Linen module instance.

    Example:
      >>> net = me.models.lora(me.models.CNN(), rank=4, alpha=8.0)
      >>> net.scale
      2.0
    """
    if not isinstance(module, nn.Module):
        raise ValueError(
            f"lora() takes a Flax Linen module instance, e.g. me.models.MLP(); got "
            f"{type(module).__name__}"
        )
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank={rank!r} must be a positive integer, e.g. rank=4")
    alpha = float(rank if alpha is None else alpha)
    if not alpha > 0:
        raise ValueError(f"alpha={alpha!r} must be a positive number, e.g. alpha={2 * rank}")
    return LoRA(module, rank=rank, alpha=alpha)
