"""The model interface the ensemble core sees, and its adapters.

The core never calls Flax directly. It needs two pure functions per member:

* ``init(rng, x) -> (params, model_state)``
* ``apply(params, model_state, x, train, rng) -> (logits, new_model_state)``

``model_state`` holds the mutable collections (``batch_stats`` for BatchNorm), ``{}``
when there are none; ``rng`` feeds stochastic layers (dropout) in training.
Adapters turn a Flax Linen module (:class:`LinenModel`) or a pair of plain functions
(:class:`FunctionModel`) into this interface; :func:`as_model` picks one.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import flax.linen as nn
import jax

PyTree = Any


@runtime_checkable
class Model(Protocol):
    """What the ensemble needs from a model: pure ``init`` and ``apply`` for one member."""

    def init(self, rng: jax.Array, x: jax.Array) -> tuple[PyTree, PyTree]:
        """Returns ``(params, model_state)`` for one member from its key and a sample batch."""
        ...

    def apply(
        self, params: PyTree, model_state: PyTree, x: jax.Array, train: bool, rng: jax.Array
    ) -> tuple[jax.Array, PyTree]:
        """Returns ``(logits [B, classes], new_model_state)`` for one member."""
        ...


@dataclasses.dataclass(frozen=True)
class LinenModel:
    """Adapter for a Flax Linen module.

    ``init`` calls ``module.init({"params": rng}, x)`` (the Flax HOWTO's convention), so
    member ``i`` equals ``module.init(jax.random.split(key, M)[i], x)``. If the module's
    ``__call__`` takes ``train`` (or ``deterministic``/``use_running_average``), it is set
    from the train flag. Collections other than ``params`` form ``model_state`` and are
    mutable in training; the dropout stream is ``rng``.

    Args:
      module: the Linen module.
      rng_streams: names of the RNG streams to feed from the step key in training.

    Example:
      >>> model = me.LinenModel(me.models.CNN())
    """

    module: nn.Module
    rng_streams: tuple[str, ...] = ("dropout",)

    def _kwargs(self, train: bool) -> dict[str, bool]:
        params = inspect.signature(self.module.__call__).parameters
        if "train" in params:
            return {"train": train}
        if "deterministic" in params:
            return {"deterministic": not train}
        if "use_running_average" in params:
            return {"use_running_average": not train}
        return {}

    def init(self, rng: jax.Array, x: jax.Array) -> tuple[PyTree, PyTree]:
        variables = dict(self.module.init({"params": rng}, x, **self._kwargs(False)))
        params = variables.pop("params", {})
        return params, variables

    def apply(
        self, params: PyTree, model_state: PyTree, x: jax.Array, train: bool, rng: jax.Array
    ) -> tuple[jax.Array, PyTree]:
        variables = {"params": params, **model_state}
        kwargs = self._kwargs(train)
        if not train:
            return self.module.apply(variables, x, **kwargs), model_state
        rngs = {name: jax.random.fold_in(rng, i) for i, name in enumerate(self.rng_streams)}
        if not model_state:
            return self.module.apply(variables, x, rngs=rngs, **kwargs), model_state
        logits, new_state = self.module.apply(
            variables, x, rngs=rngs, mutable=list(model_state), **kwargs
        )
        return logits, dict(new_state)


@dataclasses.dataclass(frozen=True)
class FunctionModel:
    """Adapter for a pair of plain functions.

    Args:
      init_fn: ``init_fn(rng, x) -> params`` or ``-> (params, model_state)``.
      apply_fn: ``apply_fn(params, x) -> logits``; with ``stateful=True`` it is
        ``apply_fn(params, model_state, x, train, rng) -> (logits, new_model_state)``.
      stateful: whether the functions carry a model state.

    Example:
      >>> init = lambda rng, x: {"w": jax.random.normal(rng, (x.shape[-1], 10))}
      >>> model = me.FunctionModel(init, lambda p, x: x @ p["w"])
    """

    init_fn: Callable[..., Any]
    apply_fn: Callable[..., Any]
    stateful: bool = False

    def init(self, rng: jax.Array, x: jax.Array) -> tuple[PyTree, PyTree]:
        out = self.init_fn(rng, x)
        return (out[0], out[1]) if self.stateful else (out, {})

    def apply(
        self, params: PyTree, model_state: PyTree, x: jax.Array, train: bool, rng: jax.Array
    ) -> tuple[jax.Array, PyTree]:
        if self.stateful:
            return self.apply_fn(params, model_state, x, train, rng)
        return self.apply_fn(params, x), model_state


def as_model(model: Any) -> Model:
    """Wraps ``model`` in the core's :class:`Model` interface.

    Args:
      model: a Flax Linen module, a ``(init_fn, apply_fn)`` pair, or an object that
        already has ``init`` and ``apply`` with the :class:`Model` signatures.

    Returns:
      A :class:`Model`.

    Raises:
      TypeError: ``model`` is none of these.

    Example:
      >>> m = me.as_model(me.models.CNN())
    """
    if isinstance(model, nn.Module):
        return LinenModel(model)
    if isinstance(model, tuple) and len(model) == 2 and all(map(callable, model)):
        return FunctionModel(*model)
    if isinstance(model, LinenModel | FunctionModel):
        return model
    if isinstance(model, Model):
        return model
    raise TypeError(
        f"model {type(model).__name__} is not supported; pass a flax.linen.Module, an "
        "(init_fn, apply_fn) pair, or an object with init(rng, x) and "
        "apply(params, model_state, x, train, rng)"
    )
