"""How members are laid out inside their devices: FSDP over ``data``, tensor over ``model``.

Without ``shard_members`` and without a ``model`` axis every state leaf ``[members, ...]``
is split over ``ensemble`` only (``P("ensemble")``): a member lives whole on every
device of its ``data`` group. This module decides the per-leaf ``PartitionSpec`` s when
members are sharded inside their group:

* **FSDP** (``shard_members=True``): every parameter and optimizer-state leaf of a member
  is split over ``data`` along **its largest dimension that the ``data`` size divides**
  (the first such dimension on ties; a dimension already split over ``model`` is not
  taken). On a mesh with a ``model`` axis, a leaf that ``model`` does not split
  otherwise (unannotated, or its names map to no mesh axis) is split over ``data`` x
  ``model`` (``P(..., ("data", "model"))``) when ``data * model`` divides a dimension,
  so state bytes fall by ``data * model`` for every leaf that divides. Leaves without
  such a dimension (biases of odd size, scalars like Adam's ``count``, per-member
  hyperparameters), the model state (BatchNorm statistics, averaged over ``data``
  every step), the step counters and the keys stay replicated over ``data``.
  The per-device step all-gathers the split parameters before the forward pass; the
  transpose of that all-gather reduce-scatters the gradients
  (:func:`meshensemble.core.steps.gather_params`).
* **Tensor parallelism** (a mesh with a ``model`` axis): a parameter's dimension is split
  over ``model`` when the model names it with a logical axis (Flax
  ``nn.with_logical_partitioning``) that the rules table (:data:`DEFAULT_RULES`, or the
  ensemble's ``axis_rules``) maps to ``"model"`` and the ``model`` size divides it.
  Without FSDP, unannotated parameters stay replicated over ``model``. The compiler partitions the
  computation over ``model`` (the steps are manual over ``ensemble`` and ``data`` only).

An optimizer-state leaf takes the spec of the parameter whose tree path ends its own
path and whose shape it has (Adam's ``mu``/``nu`` follow their parameters); any other
optimizer-state leaf follows the FSDP rule only.

The optimizer then updates each device's slice of each leaf: element-wise optimizers
(SGD, momentum, Adam(W), RMSProp ...) give the same result as unsharded; transforms
that look at whole tensors or the whole tree (``clip_by_global_norm``, LAMB's trust
ratio, Shampoo) would see only the slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshensemble.core.layout import combine
from meshensemble.core.mesh import DATA, ENSEMBLE, MODEL
from meshensemble.core.state import EnsembleState, shared_part, whole_params, with_shared

PyTree = Any
Rules = Sequence[tuple[str, str | None]]

DEFAULT_RULES: tuple[tuple[str, str | None], ...] = (
    ("heads", MODEL),
    ("mlp", MODEL),
)
"""Logical axis name -> mesh axis, the default for a ``model`` axis (Megatron style).

Attention heads and the MLP's hidden layer are split over ``model``; every other
logical name (``embed``, ``kv``, ``patch``, ``position``, ``classes`` ...) stays
replicated. The same as ``me.models.LOGICAL_AXIS_RULES`` for the zoo's ViT."""


def fsdp_axis(shape: Sequence[int], size: int, taken: Sequence[int] = ()) -> int | None:
    """The dimension of one member's leaf that FSDP splits over ``data``.

    Args:
      shape: the leaf's shape without the member axis.
      size: the ``data`` axis size.
      taken: dimensions already split over another axis (``model``).

    Returns:
      The largest dimension that ``size`` divides (the first on ties), or None when
      ``size == 1`` or no dimension qualifies (the leaf stays replicated over ``data``).

    Example:
      >>> fsdp_axis((3136, 256), 4)
      0
      >>> fsdp_axis((10,), 4) is None
      True
    """
    if size <= 1:
        return None
    best = None
    for k, n in enumerate(shape):
        if k in taken or n < size or n % size:
            continue
        if best is None or n > shape[best]:
            best = k
    return best


def logical_axes(model: Any, sample: Any) -> PyTree | None:
    """The logical axis names of a model's parameters, as the model tells them.

    Args:
      model: a :class:`meshensemble.Model`; one with a ``logical_axes(sample)`` method
        (:class:`~meshensemble.LinenModel`) names its dimensions, others give None.
      sample: a sample input ``[1, ...]`` (array or ``jax.ShapeDtypeStruct``).

    Returns:
      A tree like the parameters with a tuple of logical names (``None`` for unnamed
      dimensions) per leaf, ``()`` for unannotated leaves; None when the model names none.

    Example:
      >>> logical_axes(me.as_model(me.models.ViT()), images[:1])["head"]["kernel"]
      ('embed', 'classes')
    """
    named = getattr(model, "logical_axes", None)
    return named(sample) if callable(named) else None


def param_spec(
    shape: Sequence[int],
    mesh: Mesh,
    shard_members: bool,
    names: Sequence[str | None] = (),
    rules: Rules = DEFAULT_RULES,
) -> P:
    """The ``PartitionSpec`` of one stacked leaf ``[members, *shape]``.

    Args:
      shape: the member's leaf shape (no member axis).
      mesh: the ensemble mesh (its ``model`` axis, if any, is used with ``names``).
      shard_members: whether FSDP splits the leaf over ``data``.
      names: the leaf's logical axis names (one per dimension), or ``()``.
      rules: logical name -> mesh axis pairs.

    Returns:
      ``P("ensemble", ...)`` with ``"data"`` and/or ``"model"`` on member dimensions.

    Example:
      >>> param_spec((64, 4, 16), me.make_mesh(2, 2, model=2), True, ("embed", "heads", "kv"))
      P('ensemble', 'data', 'model')
    """
    dims: list[str | None] = [None] * len(shape)
    table = dict(rules)
    m = int(mesh.shape.get(MODEL, 1))
    if m > 1 and len(names) == len(shape):
        for k, name in enumerate(names):
            if name is not None and table.get(name) == MODEL and shape[k] % m == 0:
                dims[k] = MODEL
    if shard_members:
        taken = [k for k, a in enumerate(dims) if a is not None]
        d = int(mesh.shape[DATA])
        k = None if taken or m == 1 else fsdp_axis(shape, d * m)
        if k is not None:  # a leaf that `model` does not split: FSDP over data x model
            dims[k] = (DATA, MODEL)
        elif (k := fsdp_axis(shape, d, taken)) is not None:
            dims[k] = DATA
    while dims and dims[-1] is None:
        dims.pop()
    return P(ENSEMBLE, *dims)


def state_specs(
    shapes: EnsembleState,
    mesh: Mesh,
    shard_members: bool,
    names: PyTree | None = None,
    rules: Rules = DEFAULT_RULES,
) -> EnsembleState:
    """The ``PartitionSpec`` of every leaf of an ensemble state (see the module's rules).

    A :class:`~meshensemble.core.state.SharedState`'s shared leaves (no member axis) get
    the same rules without the ``ensemble`` entry: replicated over ``ensemble``, split over
    ``data`` (FSDP) and ``model`` as a member's leaf of their shape would be.

    Args:
      shapes: the state (arrays or ``jax.ShapeDtypeStruct``), leaves ``[members, ...]``.
      mesh: the ensemble mesh.
      shard_members: FSDP over ``data``.
      names: :func:`logical_axes` of the model (None: no names; nothing over ``model``).
      rules: logical name -> mesh axis pairs.

    Returns:
      An :class:`EnsembleState` (or ``SharedState``) with a ``PartitionSpec`` per leaf.

    Example:
      >>> shapes = jax.eval_shape(lambda: ens.init(key, images[:1]))
      >>> specs = state_specs(shapes, me.make_mesh(ensemble=2, data=4), True)
      >>> specs.params["Dense_0"]["kernel"]   # [members, 784, 8]: FSDP over data
      P('ensemble', 'data')
    """
    sharing = shared_part(shapes)
    whole = whole_params(
        jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape[1:], v.dtype), shapes.params),
        None if sharing is None else sharing[0],
    )
    leaf_names: dict[tuple[Any, ...], Any] = {}
    if names is not None:
        found = jax.tree.structure(whole).flatten_up_to(names)
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(whole)[0]]
        leaf_names = dict(zip(paths, found))

    def specs_of(tree: PyTree, opt: PyTree, member: bool) -> tuple[PyTree, PyTree]:
        by_path: dict[tuple[Any, ...], tuple[tuple[int, ...], P]] = {}

        def spec(shape: tuple[int, ...], leaf_names: Any = ()) -> P:
            one = param_spec(shape[1:] if member else shape, mesh, shard_members, leaf_names, rules)
            return one if member else P(*tuple(one)[1:])

        def one_param(path: tuple[Any, ...], leaf: Any) -> P:
            one = spec(leaf.shape, tuple(leaf_names.get(path) or ()))
            by_path[tuple(path)] = (tuple(leaf.shape), one)
            return one

        params = jax.tree_util.tree_map_with_path(one_param, tree)
        lengths = sorted({len(p) for p in by_path}, reverse=True)

        def one_opt(path: tuple[Any, ...], leaf: Any) -> P:
            for n in lengths:
                hit = by_path.get(tuple(path[-n:])) if len(path) >= n else None
                if hit is not None and hit[0] == tuple(leaf.shape):
                    return hit[1]
            return spec(leaf.shape)

        return params, jax.tree_util.tree_map_with_path(one_opt, opt)

    params, opt_state = specs_of(shapes.params, shapes.opt_state, True)
    members = lambda tree: jax.tree.map(lambda _: P(ENSEMBLE), tree)
    specs = EnsembleState(
        step=P(ENSEMBLE),
        params=params,
        opt_state=opt_state,
        model_state=members(shapes.model_state),
        rng=P(ENSEMBLE),
    )
    return with_shared(specs, sharing and specs_of(*sharing, False))


def whole_param_specs(specs: EnsembleState) -> PyTree:
    """The specs of a member's whole parameters: its own leaves' and the shared ones'.

    A shared leaf's spec gets a leading ``None`` in place of the member axis's
    ``ensemble``, so every entry reads as a member leaf's (:func:`gather_axes`).

    Args:
      specs: a state of ``PartitionSpec`` s (:func:`state_specs`).

    Returns:
      A tree of the model's parameter structure with a ``PartitionSpec`` per leaf.

    Example:
      >>> whole_param_specs(state_specs(jax.eval_shape(lambda: ens.init(key, images[:1])),
      ...                               mesh, False))["Dense_0"]["kernel"]
      P('ensemble',)
    """
    sharing = shared_part(specs)
    if sharing is None:
        return specs.params
    return combine(specs.params, jax.tree.map(lambda s: P(None, *s), sharing[0]))


def gather_axes(specs: PyTree) -> tuple[int | None, ...]:
    """For each parameter leaf (flattening order), the member dimension split over ``data``.

    Args:
      specs: the ``params`` part of :func:`state_specs`.

    Returns:
      One entry per leaf: the dimension of the member's leaf (no member axis) to
      all-gather over ``data``, or None.

    Example:
      >>> gather_axes({"w": P("ensemble", None, "data"), "b": P("ensemble")})
      (None, 1)
    """
    leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    return tuple(_data_dim(s) for s in leaves)


def _data_dim(spec: P) -> int | None:
    """The member dimension (no member axis) that ``spec`` splits over ``data``, or None."""
    for k, a in enumerate(tuple(spec)[1:]):
        if a == DATA or (isinstance(a, tuple) and DATA in a):
            return k
    return None


def manual_spec(spec: Any) -> Any:
    """``spec`` (or a tree of specs) without the ``model`` axis: what ``shard_map`` sees.

    Args:
      spec: a ``PartitionSpec`` or a tree of them.

    Returns:
      The same with ``"model"`` dropped from every entry (None where nothing is left).

    Example:
      >>> manual_spec(P("ensemble", "data", "model"))
      P('ensemble', 'data', None)
    """
    is_spec = lambda s: isinstance(s, P)
    strip = lambda s: P(*(_without_model(a) for a in s))
    return jax.tree.map(strip, spec, is_leaf=is_spec)


def _without_model(entry: Any) -> Any:
    if isinstance(entry, tuple):
        rest = tuple(a for a in entry if a != MODEL)
        return rest[0] if len(rest) == 1 else (rest or None)
    return None if entry == MODEL else entry


def state_shardings(specs: Any, mesh: Mesh, like: PyTree = None) -> PyTree:
    """``NamedSharding`` s on ``mesh`` from :func:`state_specs` (or ``ens.state_spec``).

    Args:
      specs: a state of ``PartitionSpec`` s, or one spec for every leaf (``P("ensemble")``).
      mesh: the mesh.
      like: with one spec, the tree to give it to (e.g. the state's shapes).

    Returns:
      The tree with ``NamedSharding(mesh, spec)`` leaves.

    Raises:
      ValueError: one spec and no ``like``.

    Example:
      >>> state = jax.device_put(state, state_shardings(ens.state_spec, ens.mesh, state))
      >>> jax.tree.leaves(state.params)[0].sharding.spec
      P('ensemble',)
    """
    if isinstance(specs, P):
        if like is None:
            raise ValueError("one PartitionSpec for the whole state needs like=<the state>")
        return jax.tree.map(lambda _: NamedSharding(mesh, specs), like)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def abstract_layout(specs: Any, mesh: Mesh, shapes: PyTree) -> PyTree:
    """``jax.ShapeDtypeStruct`` s of ``shapes`` placed as ``specs`` say: a restore target.

    Args:
      specs: ``ens.state_spec`` (one spec, or a state of specs).
      mesh: the mesh.
      shapes: the state's shapes (e.g. ``jax.eval_shape`` of ``ens.init``).

    Returns:
      The tree of ``jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(...))``;
      orbax restores (and reshards) a checkpoint of any layout into it.

    Example:
      >>> target = abstract_layout(ens.state_spec, ens.mesh,
      ...                          jax.eval_shape(lambda: ens.init(key, images[:1])))
      >>> leaf = jax.tree.leaves(target.params)[0]
      >>> type(leaf).__name__, leaf.shape, leaf.sharding.spec
      ('ShapeDtypeStruct', (2, 8), P('ensemble',))
    """
    placed = state_shardings(specs, mesh, shapes)
    return jax.tree.map(
        lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), shapes, placed
    )


def state_bytes_per_device(state: PyTree, device: Any = None) -> int:
    """Bytes of ``state`` held on one device: its addressable shards there, summed.

    Args:
      state: any tree of ``jax.Array`` (e.g. an :class:`EnsembleState`).
      device: the device; default the first device of the first leaf.

    Returns:
      The bytes of the shards on ``device``.

    Example:
      >>> state_bytes_per_device(state)  # 1 member of the 2 per device, fp32
      25492
    """
    leaves = [v for v in jax.tree.leaves(state) if isinstance(v, jax.Array)]
    if not leaves:
        return 0
    if device is None:
        device = leaves[0].addressable_shards[0].device
    return int(
        sum(s.data.nbytes for v in leaves for s in v.addressable_shards if s.device == device)
    )


def init_layout(
    init: Any,
    sample: Any,
    mesh: Mesh,
    model: Any,
    shard_members: bool,
    axis_rules: Rules = DEFAULT_RULES,
    input_transform: Any = None,
) -> EnsembleState:
    """The state specs of an ensemble from its init's shapes: a pure function of its pieces.

    Traces ``init`` abstractly (nothing runs), reads the model's logical axis names when
    the mesh has a ``model`` axis, and applies :func:`state_specs`. The layout does not
    depend on the key (the keys are ``P("ensemble")`` whatever their words).

    Args:
      init: ``init(key, sample) -> EnsembleState`` of a legacy key
        (:func:`~meshensemble.core.state.init_members` with ``typed=False``).
      sample: an input batch ``[B, ...]`` (array or ``jax.ShapeDtypeStruct``).
      mesh: the ensemble mesh.
      model: the :class:`meshensemble.Model` (its logical axis names, on a ``model`` axis).
      shard_members: FSDP over ``data``.
      axis_rules: logical name -> mesh axis pairs.
      input_transform: applied to the sample before the model (None: none).

    Returns:
      An :class:`EnsembleState` of ``PartitionSpec`` s.

    Example:
      >>> from meshensemble.core.state import init_members
      >>> net = me.as_model(me.models.MLP((8,)))
      >>> init = init_members(net, optax.sgd(0.1), 2, None, {}, typed=False)
      >>> specs = init_layout(init, images[:1], me.make_mesh(ensemble=2, data=4), net, True)
      >>> specs.params["Dense_0"]["kernel"]   # FSDP: the 784 rows split over data
      P('ensemble', 'data')
    """
    shapes = jax.eval_shape(init, jax.random.PRNGKey(0), sample)
    names = None
    if MODEL in mesh.axis_names:
        x = jax.eval_shape(input_transform or (lambda v: v), sample)
        names = logical_axes(model, x)
    return state_specs(shapes, mesh, shard_members, names, axis_rules)


def model_split_count(specs: Any) -> tuple[int, int]:
    """How many parameter leaves a layout splits over ``model``, of how many.

    Args:
      specs: a state of ``PartitionSpec`` s (``ens.state_specs(images[:1])``) or one spec.

    Returns:
      ``(split, total)`` over the ``params`` leaves (``(0, 0)`` for a single spec).

    Example:
      >>> vit = me.Ensemble(me.models.ViT(), optax.sgd(0.1), 2,
      ...                   me.make_mesh(ensemble=2, data=1, model=2), sample=images[:1])
      >>> model_split_count(vit.state_specs(images[:1]))  # a ViT on model=2
      (36, 68)
    """
    if isinstance(specs, P):
        return 0, 0
    leaves = jax.tree.leaves(whole_param_specs(specs), is_leaf=lambda s: isinstance(s, P))
    names = lambda a: a if isinstance(a, tuple) else (a,)
    split = sum(any(MODEL in names(a) for a in s) for s in leaves)
    return split, len(leaves)


def model_axis_note(ens: Any, state: EnsembleState, sample: Any) -> str | None:
    """One line when a ``model`` axis larger than 1 splits no parameter (every weight copied).

    Args:
      ens: the :class:`~meshensemble.Ensemble` (its ``state_specs(sample)``).
      state: its state (the parameters' shapes are read).
      sample: a sample batch ``[1, ...]`` (for the model's logical axis names).

    Returns:
      None when the mesh has no ``model`` axis of size > 1 or it splits a leaf; else a
      line naming the count and the ``model`` sizes that would split the model's named
      dimensions (or ``model=1``).

    Example:
      >>> vit = me.Ensemble(me.models.ViT(), optax.sgd(0.1), 2,
      ...                   me.make_mesh(ensemble=2, data=1, model=3), sample=images[:1])
      >>> shapes = jax.eval_shape(lambda: vit.init(key, images[:1]))
      >>> print(model_axis_note(vit, shapes, images[:1]))  # a ViT on model=3
      warning: mesh model=3 splits 0 of 68 parameter leaves (widths named for 'model': 4, 128):
      every weight is copied on the 3 devices of each member's model group; use a model size
      that divides them (model=2 or 4) or model=1
    """
    m = int(ens.mesh.shape.get(MODEL, 1))
    if m <= 1:
        return None
    split, total = model_split_count(ens.state_specs(sample))
    if split:
        return None
    x = jax.eval_shape(ens.input_transform or (lambda v: v), sample)
    names = logical_axes(ens.model, x)
    table = dict(ens.axis_rules)
    widths: set[int] = set()
    if names is not None:
        leaf_names = jax.tree.structure(state.params).flatten_up_to(names)
        for leaf, leaf_names_ in zip(jax.tree.leaves(state.params), leaf_names):
            for n, name in zip(leaf.shape[1:], leaf_names_ or ()):
                if name is not None and table.get(name) == MODEL:
                    widths.add(int(n))
    room = jax.device_count() // (int(ens.mesh.shape[ENSEMBLE]) * int(ens.mesh.shape[DATA]))
    fits = sorted({d for w in widths for d in range(2, room + 1) if w % d == 0})
    fix = (
        f"use a model size that divides them (model={' or '.join(map(str, fits[:3]))}) or model=1"
        if fits
        else "the model names no dimension for 'model': use model=1"
    )
    what = f" (widths named for 'model': {', '.join(map(str, sorted(widths)))})" if widths else ""
    return (
        f"warning: mesh model={m} splits 0 of {total} parameter leaves{what}: every weight "
        f"is copied on the {m} devices of each member's model group; {fix}"
    )
