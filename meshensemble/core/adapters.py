"""The model interface the ensemble core sees, and its adapters.

The core never calls Flax directly. It needs two pure functions per member:

* ``init(rng, x) -> (params, model_state)``
* ``apply(params, model_state, x, train, rng) -> (logits, new_model_state)``

``model_state`` holds the mutable collections (``batch_stats`` for BatchNorm), ``{}``
when there are none; ``rng`` feeds stochastic layers (dropout) in training.
Adapters turn a Flax Linen module (:class:`LinenModel`), a factory of Flax NNX modules
(:class:`NNXModel`) or a pair of plain functions (:class:`FunctionModel`) into this
interface; :func:`as_model` picks one.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict

PyTree = Any


@runtime_checkable
class Model(Protocol):
    """What the ensemble needs from a model: pure ``init`` and ``apply`` for one member.

    A model may also define ``logical_axes(sample) -> tree`` (the logical axis names of
    its parameters, from shapes only; :class:`LinenModel` reads Flax's
    ``nn.with_logical_partitioning``): :mod:`meshensemble.core.sharding` splits the named
    dimensions over the ``model`` mesh axis. A model without it is replicated over
    ``model``.
    """

    def init(self, rng: jax.Array, x: jax.Array) -> tuple[PyTree, PyTree]:
        """Returns ``(params, model_state)`` for one member from its key and a sample batch."""
        ...

    def apply(
        self, params: PyTree, model_state: PyTree, x: jax.Array, train: bool, rng: jax.Array
    ) -> tuple[jax.Array, PyTree]:
        """Returns ``(logits [B, classes], new_model_state)`` for one member."""
        ...


def _parameters(fn: Callable[..., Any]) -> Mapping[str, inspect.Parameter]:
    """``fn``'s parameters by name; none when it has no signature (builtins, some callables)."""
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def _mode_kwargs(fn: Callable[..., Any], train: bool) -> dict[str, bool]:
    """The train/eval keyword ``fn`` takes, if any, set from ``train``."""
    params = _parameters(fn)
    modes = {"train": train, "deterministic": not train, "use_running_average": not train}
    for name, value in modes.items():  # the first the function takes
        if name in params:
            return {name: value}
    return {}


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
        return _mode_kwargs(self.module.__call__, train)

    def logical_axes(self, sample: Any) -> PyTree:
        """The logical axis names of the module's parameters, from shapes only.

        Args:
          sample: a sample input ``[1, ...]`` (array or ``jax.ShapeDtypeStruct``).

        Returns:
          A tree like the parameters with a tuple of logical names (``None`` for unnamed
          dimensions) per leaf, ``()`` for leaves without ``nn.with_logical_partitioning``.

        Example:
          >>> me.as_model(me.models.ViT()).logical_axes(images[:1])["head"]["kernel"]
          ('embed', 'classes')
        """
        x = jax.ShapeDtypeStruct(jnp.shape(sample), jnp.result_type(sample.dtype))
        init = lambda v: self.module.init({"params": jax.random.key(0)}, v, **self._kwargs(False))
        specs = nn.get_partition_spec(jax.eval_shape(init, x).get("params", {}))
        is_spec = lambda s: isinstance(s, jax.sharding.PartitionSpec)
        return jax.tree.map(lambda s: tuple(s) if is_spec(s) else (), specs, is_leaf=is_spec)

    def init(self, rng: jax.Array, x: jax.Array) -> tuple[PyTree, PyTree]:
        # Parameters annotated with logical axes (nn.with_logical_partitioning) come boxed;
        # the ensemble stacks and shards plain arrays (the names are read separately).
        variables = dict(nn.meta.unbox(self.module.init({"params": rng}, x, **self._kwargs(False))))
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


def _collection(var_type: type) -> str:
    """Linen-style collection name of an NNX variable type (``BatchStat``: ``batch_stats``)."""
    try:
        return nnx.variable_name_from_type(var_type)
    except ValueError:  # a user type without a registered name
        return var_type.__name__


def _typed_key(rng: jax.Array) -> jax.Array:
    """``rng`` as a typed key (legacy ``uint32`` keys are wrapped)."""
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return rng
    return jax.random.wrap_key_data(rng)


@dataclasses.dataclass(frozen=True)
class NNXModel:
    """Adapter for Flax NNX modules, built per member by a factory.

    An NNX module instance is one initialised model, so the ensemble needs a way to make
    one per member: ``factory(rngs)`` builds the module from an ``nnx.Rngs``. For member
    ``i`` (key ``k = jax.random.split(key, M)[i]``) ``init`` builds
    ``factory(nnx.Rngs(default=fold_in(k, 0), params=k, dropout=fold_in(k, 1)))`` (one
    more stream ``fold_in(k, j + 1)`` per extra name in ``rng_streams``), then splits it:

    * ``params``: the variables ``params_filter`` selects (``nnx.Param``), as nested
      dicts of arrays keyed by attribute names (``nnx.to_pure_dict``);
    * ``model_state``: the other variables (BatchNorm's ``nnx.BatchStat`` ...), grouped
      by collection like Linen's, e.g. ``{"batch_stats": {"bn": {"mean": ..., "var":
      ...}}}``; ``{}`` when there are none;
    * RNG streams (``nnx.RngState``) are not kept: ``apply`` rebuilds them from its
      ``rng`` (the ensemble's key of this member, step and data shard), so each member
      draws its own dropout masks at every step. Each stream key is ``fold_in(rng, j)``
      (``j`` its index) with its count reset; in evaluation they get a fixed key.

    ``apply`` merges these into the module (the graph definition is computed once, from
    ``nnx.eval_shape``, and shared by all members), puts it in training mode
    (``module.train()``) or evaluation mode (``module.eval()``) and calls it, passing
    ``train`` (or ``deterministic``/``use_running_average``) when ``__call__`` takes it,
    and ``rngs=nnx.Rngs(...)`` (streams ``default`` and ``rng_streams``, from the same
    key) when it takes ``rngs``; it returns the updated ``model_state``. Everything is a
    pure function of its arguments, so it runs under ``jax.vmap`` over members, ``jit``
    and ``shard_map``. Values sown with ``sow`` (``nnx.Intermediate``) are dropped;
    variables first created during a call are not supported.

    Args:
      factory: ``factory(rngs: nnx.Rngs) -> nnx.Module``; a module class is called as
        ``factory(rngs=rngs)``.
      params_filter: NNX filter of the trained variables (default ``nnx.Param``); the
        other variables go to ``model_state``.
      rng_streams: RNG stream names besides ``params`` and ``default`` to give the
        factory (the streams modules fork at construction, like ``Dropout``'s).

    Attributes:
      graphdef: the ``nnx.GraphDef`` shared by all members (static, hashable).

    Raises:
      TypeError: ``factory`` is not callable, is a module instance, or does not return
        an ``nnx.Module``.

    Example:
      >>> class Net(nnx.Module):
      ...     def __init__(self, rngs: nnx.Rngs):
      ...         self.linear = nnx.Linear(784, 10, rngs=rngs)
      ...     def __call__(self, x):
      ...         return self.linear(x.reshape(x.shape[0], -1))
      >>> model = me.NNXModel(lambda rngs: Net(rngs))  # or me.NNXModel(Net)
      >>> ens = me.Ensemble(model, optax.adam(1e-3), num_members=8)
    """

    factory: Callable[..., nnx.Module]
    params_filter: Any = nnx.Param
    rng_streams: tuple[str, ...] = ("dropout",)

    def __post_init__(self) -> None:
        if isinstance(self.factory, nnx.Module) or not callable(self.factory):
            raise TypeError(
                f"NNXModel takes a factory, not a {type(self.factory).__name__}; pass "
                "me.NNXModel(lambda rngs: MyModule(..., rngs=rngs))"
            )
        abstract = nnx.eval_shape(lambda: self._build(jax.random.key(0)))
        graphdef, params, rngs, _, state = self._split(abstract)
        object.__setattr__(self, "graphdef", graphdef)
        object.__setattr__(self, "_params", tuple(nnx.to_flat_state(params)))
        object.__setattr__(self, "_rngs", tuple(nnx.to_flat_state(rngs)))
        object.__setattr__(
            self,
            "_state",
            tuple(((_collection(type(v)), *path), v) for path, v in nnx.to_flat_state(state)),
        )
        object.__setattr__(self, "_call", type(abstract).__call__)
        object.__setattr__(self, "_takes_rngs", "rngs" in _parameters(type(abstract).__call__))

    def _build(self, rng: jax.Array) -> nnx.Module:
        streams = {name: jax.random.fold_in(rng, i + 1) for i, name in enumerate(self.rng_streams)}
        rngs = nnx.Rngs(**{"default": jax.random.fold_in(rng, 0), **streams, "params": rng})
        factory = self.factory
        if inspect.isclass(factory):
            _check_rngs_only(factory)
            module = factory(rngs=rngs)
        else:
            module = factory(rngs)
        if not isinstance(module, nnx.Module):
            raise TypeError(
                f"NNXModel's factory returned a {type(module).__name__}, not an nnx.Module; "
                "pass a factory like lambda rngs: MyModule(..., rngs=rngs)"
            )
        return module

    def _split(self, module: nnx.Module) -> tuple[Any, ...]:
        """``(graphdef, params, rng_state, intermediates, model_state)`` of ``module``."""
        return nnx.split(module, self.params_filter, nnx.RngState, nnx.Intermediate, ...)

    def _pure_state(self, state: Any) -> PyTree:
        values = dict(nnx.to_flat_state(state))
        return unflatten_dict({path: values[path[1:]].get_value() for path, _ in self._state})

    @staticmethod
    def _fill(template: tuple[tuple[Any, Any], ...], tree: PyTree, what: str) -> Any:
        values = flatten_dict(tree)
        missing = [path for path, _ in template if path not in values]
        if missing:
            raise ValueError(
                f"NNX {what} lack {'/'.join(map(str, missing[0]))}; give the tree init made"
            )
        return [(path, var.replace(values[path])) for path, var in template]

    def _rng_state(self, key: jax.Array) -> Any:
        flat = []
        for j, (path, var) in enumerate(self._rngs):
            value = var.get_value()
            if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
                new = jax.random.fold_in(key, j)
                new = jax.random.split(new, value.shape) if value.shape else new
            else:  # the stream's count
                new = jnp.zeros(value.shape, value.dtype)
            flat.append((path, var.replace(new)))
        return nnx.from_flat_state(flat)

    def init(self, rng: jax.Array, x: jax.Array) -> tuple[PyTree, PyTree]:
        """``(params, model_state)`` of the module the factory builds from ``rng``.

        Args:
          rng: this member's key.
          x: a sample batch (unused: NNX modules know their shapes at construction).

        Returns:
          ``(params, model_state)`` as nested dicts of arrays.
        """
        del x
        _, params, _, _, state = self._split(self._build(rng))
        return nnx.to_pure_dict(params), self._pure_state(state)

    def apply(
        self, params: PyTree, model_state: PyTree, x: jax.Array, train: bool, rng: jax.Array
    ) -> tuple[jax.Array, PyTree]:
        """Calls the module in training or evaluation mode.

        Args:
          params: from :meth:`init` (or updated by the optimizer).
          model_state: from :meth:`init` or a previous call.
          x: the input batch.
          train: training mode (dropout on, batch statistics used and updated).
          rng: the key the RNG streams are rebuilt from in training.

        Returns:
          ``(logits, new_model_state)``; ``model_state`` is returned unchanged in
          evaluation.

        Raises:
          ValueError: ``params`` or ``model_state`` lack a variable of the module.
        """
        key = _typed_key(rng) if train else jax.random.key(0)
        state_flat = self._fill(self._state, model_state, "model_state")
        module = nnx.merge(
            self.graphdef,
            nnx.from_flat_state(self._fill(self._params, params, "params")),
            self._rng_state(key),
            nnx.from_flat_state([(path[1:], var) for path, var in state_flat]),
        )
        if train:
            module.train()
        else:
            module.eval()
        kwargs: dict[str, Any] = _mode_kwargs(self._call, train)
        if self._takes_rngs:  # call-time streams, after the indices the state keys used
            names = ("default", *self.rng_streams)
            n = len(self._rngs)
            kwargs["rngs"] = nnx.Rngs(
                **{name: jax.random.fold_in(key, n + i) for i, name in enumerate(names)}
            )
        logits = module(x, **kwargs)
        if not train:
            return logits, model_state
        return logits, self._pure_state(self._split(module)[-1])


@dataclasses.dataclass(frozen=True)
class FunctionModel:
    """Adapter for a pair of plain functions.

    ``params`` may be any pytree of arrays. Member ``i`` starts from
    ``init_fn(jax.random.split(key, M)[i], sample)``. Passing the pair itself,
    ``Ensemble((init_fn, apply_fn), ...)`` or ``as_model((init_fn, apply_fn))``, makes a
    stateless ``FunctionModel`` (no ``model_state``, no ``train`` flag or ``rng``); use
    ``stateful=True`` for BatchNorm-like state or dropout.

    Args:
      init_fn: ``init_fn(rng, x) -> params`` or, with ``stateful=True``,
        ``-> (params, model_state)``.
      apply_fn: ``apply_fn(params, x) -> logits [B, classes]``; with ``stateful=True`` it
        is ``apply_fn(params, model_state, x, train, rng) -> (logits, new_model_state)``,
        where ``rng`` is this member's key for this step and data shard in training.
      stateful: whether the functions carry a model state.

    Example:
      >>> init = lambda rng, x: {"w": jax.random.normal(rng, (x.shape[-1], 10))}
      >>> model = me.FunctionModel(init, lambda p, x: x @ p["w"])
      >>> same = me.as_model((init, lambda p, x: x @ p["w"]))  # a stateless FunctionModel
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


def _check_rngs_only(cls: type) -> None:
    """Raises a one-line TypeError when NNX class ``cls`` needs arguments besides ``rngs``."""
    params = list(_parameters(cls.__init__).values())[1:]  # none: nothing is needed
    needed = [
        p.name
        for p in params
        if p.name != "rngs"
        and p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if needed:
        raise TypeError(
            f"NNX module {cls.__name__} needs {', '.join(needed)} besides rngs; pass a factory: "
            f"me.NNXModel(lambda rngs: {cls.__name__}({', '.join(f'{n}=...' for n in needed)}, "
            "rngs=rngs))"
        )


def as_model(model: Any) -> Model:
    """Wraps ``model`` in the core's :class:`Model` interface.

    * a Flax Linen module instance -> :class:`LinenModel`;
    * a Flax NNX module class (constructible as ``cls(rngs=rngs)``) ->
      :class:`NNXModel` of it; for modules needing arguments pass
      ``NNXModel(lambda rngs: MyModule(..., rngs=rngs))``;
    * an ``(init_fn, apply_fn)`` pair -> a stateless :class:`FunctionModel`
      (``init_fn(rng, x) -> params``, ``apply_fn(params, x) -> logits``);
    * a :class:`LinenModel`, :class:`NNXModel`, :class:`FunctionModel` or any object
      with ``init`` and ``apply`` of the :class:`Model` signatures -> itself.

    Args:
      model: one of the above.

    Returns:
      A :class:`Model`.

    Raises:
      TypeError: ``model`` is none of these; a Linen module class (pass an instance); an
        NNX module instance (one initialised model: the ensemble needs a factory to build
        one per member); an NNX class whose constructor needs more than ``rngs``.

    Example:
      >>> m = me.as_model(me.models.CNN())
      >>> from flax import nnx
      >>> m = me.as_model(me.NNXModel(lambda rngs: nnx.Linear(784, 10, rngs=rngs)))
      >>> init_fn = lambda key, x: {"w": jax.random.normal(key, (x.shape[-1], 10))}
      >>> apply_fn = lambda params, x: x @ params["w"]
      >>> m = me.as_model((init_fn, apply_fn))
      >>> type(m).__name__
      'FunctionModel'
    """
    if isinstance(model, nn.Module):
        return LinenModel(model)
    if isinstance(model, nnx.Module):
        raise TypeError(
            f"model is an nnx.Module instance ({type(model).__name__}), i.e. one initialised "
            "model; the ensemble builds one per member from a factory: pass "
            f"me.NNXModel(lambda rngs: {type(model).__name__}(..., rngs=rngs))"
        )
    if inspect.isclass(model) and issubclass(model, nnx.Module):
        _check_rngs_only(model)
        return NNXModel(model)
    if inspect.isclass(model) and issubclass(model, nn.Module):
        raise TypeError(
            f"model is the Linen class {model.__name__}, not a module; pass an instance: "
            f"{model.__name__}(...)"
        )
    if isinstance(model, tuple) and len(model) == 2 and all(map(callable, model)):
        return FunctionModel(*model)
    if isinstance(model, Model):  # LinenModel, NNXModel, FunctionModel or any alike
        return model
    raise TypeError(
        f"model {type(model).__name__} is not supported; pass a flax.linen.Module, "
        "me.NNXModel(lambda rngs: MyNNXModule(..., rngs=rngs)), an (init_fn, apply_fn) "
        "pair, or an object with init(rng, x) and apply(params, model_state, x, train, rng)"
    )
