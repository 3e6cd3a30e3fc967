"""``EnsembleState`` (leaves stacked on a member axis), member init, per-member hyperparameters."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any


@flax.struct.dataclass
class EnsembleState:
    """The whole ensemble's training state; every leaf has leading axis ``num_members``.

    Attributes:
      step: ``[members]`` int32, steps taken by each member.
      params: model parameters, leaves ``[members, ...]``.
      opt_state: optimizer state, leaves ``[members, ...]``.
      model_state: mutable collections such as ``batch_stats``, leaves ``[members, ...]``
        (``{}`` for models without any).
      rng: ``[members, *key_shape]`` uint32 raw key data of each member's stochastic
        stream (dropout); step ``s`` uses ``fold_in(rng, s)``.

    Example:
      >>> state = ens.init(key, images[:1])
      >>> state.params["Dense_0"]["kernel"].shape  # (members, 784, 8): the tiny MLP
      (2, 784, 8)
    """

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    model_state: PyTree
    rng: jax.Array

    @property
    def num_members(self) -> int:
        """Number of members (the leading axis of every leaf)."""
        return int(self.step.shape[0])


def init_members(
    model: Any,
    tx: optax.GradientTransformation,
    num_members: int,
    input_transform: Callable[[jax.Array], jax.Array] | None,
    hyperparams: Mapping[str, np.ndarray],
    typed: bool,
) -> Callable[[jax.Array, jax.Array], EnsembleState]:
    """The function that initialises every member (to be jitted with member sharding).

    Member ``i`` is ``model.init(jax.random.split(key, num_members)[i], x)``, the Flax
    HOWTO's convention; its optimizer state is ``tx.init`` of its parameters, with the
    per-member ``hyperparams`` written into ``opt_state.hyperparams``; its stochastic
    stream (dropout) is ``fold_in(key_i, 1)``.

    Args:
      model: a :class:`meshensemble.Model`.
      tx: the optimizer of one member.
      num_members: ``M``.
      input_transform: applied to the sample before ``model.init`` (None: none).
      hyperparams: ``{name: [M] values}`` from :func:`member_hyperparams`.
      typed: whether keys are typed (``jax.random.key``); the stream is stored raw.

    Returns:
      ``init(key, sample) -> EnsembleState`` with leaves ``[M, ...]``.

    Example:
      >>> net, tx = me.models.MLP((8,)), optax.sgd(0.1)
      >>> init = jax.jit(init_members(me.as_model(net), tx, 8, None, {}, typed=True))
      >>> jax.eval_shape(init, key, np.zeros((1, 28, 28, 1))).params["Dense_0"]["kernel"].shape
      (8, 784, 8)
    """
    transform = input_transform or (lambda x: x)

    def init(key: jax.Array, sample: jax.Array) -> EnsembleState:
        keys = jax.random.split(key, num_members)
        x = transform(sample)
        params, model_state = jax.vmap(model.init, in_axes=(0, None))(keys, x)
        opt_state = jax.vmap(tx.init)(params)
        if hyperparams:  # per-member values, [m], replace the optimizer's own
            check_hyperparam_names(opt_state, hyperparams, member_axis=True)
            values = dict(opt_state.hyperparams)
            for name, v in hyperparams.items():
                values[name] = jnp.asarray(v, values[name].dtype)
            opt_state = opt_state._replace(hyperparams=values)
        stream = jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys)
        raw = jax.random.key_data(stream) if typed else stream
        return EnsembleState(
            step=jnp.zeros((num_members,), jnp.int32),
            params=params,
            opt_state=opt_state,
            model_state=model_state,
            rng=raw,
        )

    return init


def member_hyperparams(
    hyperparams: Mapping[str, Any] | None, optimizer: Any, num_members: int
) -> dict[str, np.ndarray]:
    """Checks per-member hyperparameters; returns them as ``{name: [num_members] array}``."""
    if not hyperparams:
        return {}
    out = {}
    for name, value in hyperparams.items():
        arr = np.asarray(value)
        if arr.shape != (num_members,):
            raise ValueError(
                f"hyperparams[{name!r}] has shape {arr.shape}; give one value per member, "
                f"shape ({num_members},)"
            )
        if not np.issubdtype(arr.dtype, np.number):
            raise ValueError(f"hyperparams[{name!r}] has dtype {arr.dtype}; give numbers")
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"hyperparams[{name!r}] = {arr.tolist()} has non-finite values")
        out[str(name)] = arr
    # The optimizer's hyperparameters are known from its state: trace its init on a tiny
    # parameter tree (abstractly, nothing runs). An optimizer that cannot init such a tree
    # is checked at Ensemble.init instead, on the real parameters.
    try:
        probe = jax.eval_shape(optimizer.init, {"w": jax.ShapeDtypeStruct((1,), jnp.float32)})
    except Exception:  # any failure only defers the check
        probe = None
    if probe is not None:
        check_hyperparam_names(probe, out, member_axis=False)
    return out


def check_hyperparam_names(
    opt_state: Any, hyperparams: Mapping[str, Any], member_axis: bool
) -> None:
    """Checks that ``opt_state`` is ``inject_hyperparams``' and has scalar ``hyperparams``."""
    known = getattr(opt_state, "hyperparams", None)
    if not isinstance(known, Mapping) or not hasattr(opt_state, "_replace"):
        raise ValueError(
            f"per-member hyperparams need an optimizer made with optax.inject_hyperparams, "
            f"e.g. optax.inject_hyperparams(optax.sgd)(learning_rate=0.1); this optimizer's "
            f"state is a {type(opt_state).__name__}"
        )
    scheduled = getattr(opt_state, "hyperparams_states", {}) or {}
    for name in hyperparams:
        if name not in known:
            raise ValueError(
                f"hyperparams[{name!r}] is not a hyperparameter of the optimizer; known: "
                f"{', '.join(sorted(known)) or 'none'}"
            )
        if name in scheduled:
            raise ValueError(
                f"hyperparams[{name!r}] is a schedule in the optimizer, which would replace "
                "the per-member values every step; give the optimizer a number for it"
            )
        if np.ndim(known[name]) != (1 if member_axis else 0):
            raise ValueError(
                f"hyperparams[{name!r}]: the optimizer's value is not a scalar; only scalar "
                "hyperparameters can be set per member"
            )
