"""``EnsembleState`` (leaves stacked on a member axis), ``SharedState`` (with leaves all members
share), member init, per-member hyperparameters."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshensemble.core.layout import Layout, combine, partition

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


@flax.struct.dataclass
class SharedState(EnsembleState):
    """The state of an ensemble with a member layout (``Ensemble(shared=..., frozen=...)``).

    The fields of :class:`EnsembleState` hold what each member owns (leaves
    ``[members, ...]``); two more hold what all members share, without the member axis.
    A leaf of the model's parameters is in ``params`` or in ``shared``, ``None`` in the
    other (:func:`meshensemble.core.layout.combine` merges them); frozen leaves have no
    optimizer state (``None`` there).

    Attributes:
      shared: the shared parameters, leaves ``[...]`` (one copy, replicated over
        ``ensemble``), ``None`` at the members' own leaves.
      shared_opt_state: the optimizer state of the shared leaves that are trained.

    Example:
      >>> be = me.Ensemble(me.models.BatchEnsembleMLP((8,)), optax.sgd(0.1), 2, mesh,
      ...                  shared=me.models.batchensemble_shared)
      >>> state = be.init(key, images[:1])
      >>> state.shared["BEDense_0"]["shared_kernel"].shape, state.params["BEDense_0"]["r"].shape
      ((784, 8), (2, 784))
    """

    shared: PyTree
    shared_opt_state: PyTree


def member_part(state: EnsembleState) -> EnsembleState:
    """The members' own part of a state: an :class:`EnsembleState` (itself, without a layout).

    Example:
      >>> member_part(state) is state   # a plain state is all members' own
      True
    """
    if not isinstance(state, SharedState):
        return state
    return EnsembleState(state.step, state.params, state.opt_state, state.model_state, state.rng)


def with_shared(members: EnsembleState, shared: Any) -> EnsembleState:
    """``members`` joined with ``(shared, shared_opt_state)`` (None: ``members`` itself).

    Example:
      >>> with_shared(member_part(state), None) is state
      True
    """
    if shared is None:
        return members
    fields = (members.step, members.params, members.opt_state, members.model_state, members.rng)
    return SharedState(*fields, *shared)


def shared_part(state: EnsembleState) -> tuple[PyTree, PyTree] | None:
    """``(shared, shared_opt_state)`` of a :class:`SharedState`, None for a plain state.

    Example:
      >>> shared_part(state) is None
      True
    """
    return (state.shared, state.shared_opt_state) if isinstance(state, SharedState) else None


def whole_params(params: PyTree, shared: PyTree) -> PyTree:
    """One member's whole parameters: its own leaves with the shared ones (None: no sharing).

    Example:
      >>> whole_params({"a": 1, "b": None}, {"a": None, "b": 2})
      {'a': 1, 'b': 2}
    """
    return params if shared is None else combine(params, shared)


def init_members(
    model: Any,
    tx: optax.GradientTransformation,
    num_members: int,
    input_transform: Callable[[jax.Array], jax.Array] | None,
    hyperparams: Mapping[str, np.ndarray],
    typed: bool,
    layout: Layout | None = None,
) -> Callable[..., EnsembleState]:
    """The function that initialises every member (to be jitted with member sharding).

    Member ``i`` is ``model.init(jax.random.split(key, num_members)[i], x)``, the Flax
    HOWTO's convention; its optimizer state is ``tx.init`` of its parameters, with the
    per-member ``hyperparams`` written into ``opt_state.hyperparams``; its stochastic
    stream (dropout) is ``fold_in(key_i, 1)``. With a ``layout`` the shared leaves are
    member 0's (initialised once, without the member axis) and the frozen leaves get no
    optimizer state: a :class:`SharedState`.

    Args:
      model: a :class:`meshensemble.Model`.
      tx: the optimizer of one member.
      num_members: ``M``.
      input_transform: applied to the sample before ``model.init`` (None: none).
      hyperparams: ``{name: [M] values}`` from :func:`member_hyperparams` (the shared
        leaves' optimizer keeps its own values).
      typed: whether keys are typed (``jax.random.key``); the stream is stored raw.
      layout: the :class:`~meshensemble.core.layout.Layout` (None or trivial: every leaf
        a member's own, an :class:`EnsembleState` as without it).

    Returns:
      ``init(key, sample, given=None) -> EnsembleState`` with leaves ``[M, ...]``;
      ``given`` is :func:`~meshensemble.core.layout.given_values`' tree of values that
      replace the initial ones (a member's shape for all members, or ``[M, ...]``).

    Example:
      >>> net, tx = me.models.MLP((8,)), optax.sgd(0.1)
      >>> init = jax.jit(init_members(me.as_model(net), tx, 8, None, {}, typed=True))
      >>> jax.eval_shape(init, key, np.zeros((1, 28, 28, 1))).params["Dense_0"]["kernel"].shape
      (8, 784, 8)
    """
    transform = input_transform or (lambda x: x)
    layout = layout or Layout()

    def init(key: jax.Array, sample: jax.Array, given: PyTree = None) -> EnsembleState:
        keys = jax.random.split(key, num_members)
        x = transform(sample)
        params, model_state = jax.vmap(model.init, in_axes=(0, None))(keys, x)
        params = with_given(params, given, num_members)
        stream = jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys)
        raw = jax.random.key_data(stream) if typed else stream
        step = jnp.zeros((num_members,), jnp.int32)
        if layout.trivial:
            opt_state = member_opt_state(jax.vmap(tx.init)(params), hyperparams)
            return EnsembleState(step, params, opt_state, model_state, raw)
        first = with_given(model.init(keys[0], x)[0], given, None)  # the shared leaves' values
        frozen, shared_mask = layout.frozen_mask(first), layout.shared_mask(first)
        own, shared = partition(params, shared_mask)[0], partition(first, shared_mask)[1]
        own_trained, shared_trained = partition(own, frozen)[0], partition(shared, frozen)[0]
        # over the keys: every member gets a state even when it owns no trained leaf
        opt_state = jax.vmap(lambda _, p: tx.init(p))(keys, own_trained)
        opt_state = member_opt_state(opt_state, hyperparams)
        shared_opt_state = tx.init(shared_trained)
        return SharedState(step, own, opt_state, model_state, raw, shared, shared_opt_state)

    return init


def with_given(params: PyTree, given: PyTree, num_members: int | None) -> PyTree:
    """``params`` with the given values in place (None in ``given``: keep the initial one).

    Args:
      params: the members' parameters ``[M, ...]`` (``num_members``), or one member's
        (``num_members=None``).
      given: a tree of ``params``' structure (one member's shapes, or ``[M, ...]``) with
        None where nothing is given, or None.
      num_members: ``M``, or None for one member's parameters.

    Returns:
      The parameters, each given value broadcast over the members (or member 0's taken).

    Example:
      >>> with_given({"w": jnp.zeros((2, 3))}, {"w": np.ones(3)}, 2)["w"].tolist()
      [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    """
    if given is None:
        return params

    def one(value: jax.Array, g: Any) -> jax.Array:
        if g is None:
            return value
        g = jnp.asarray(g, value.dtype)
        if num_members is None:
            return g if g.ndim == value.ndim else g[0]
        return g if g.ndim == value.ndim else jnp.broadcast_to(g, value.shape)

    return jax.tree.map(one, params, given, is_leaf=lambda v: v is None)


def member_opt_state(opt_state: PyTree, hyperparams: Mapping[str, np.ndarray]) -> PyTree:
    """The members' optimizer state with the per-member ``hyperparams`` written in ([M] each).

    Example:
      >>> member_opt_state(jax.vmap(optax.sgd(0.1).init)({"w": jnp.zeros((2, 3))}), {})
      (EmptyState(), EmptyState())
    """
    if not hyperparams:
        return opt_state
    check_hyperparam_names(opt_state, hyperparams, member_axis=True)
    values = dict(opt_state.hyperparams)
    for name, v in hyperparams.items():
        values[name] = jnp.asarray(v, values[name].dtype)
    return opt_state._replace(hyperparams=values)


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
