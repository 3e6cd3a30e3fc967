"""Helpers for users' tests of their own ensembles: fake devices, parity and sharding checks.

Chex-assisted, for pytest on simulated CPU devices: set the device count in ``conftest.py``,
skip what needs more devices, and check what an ensemble guarantees: member ``i`` is the
single model from ``jax.random.split(key, M)[i]``, at init and after training; results do
not depend on the mesh's shape; the state stays split over ``ensemble``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import Any

import chex
import einops
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshensemble.core.adapters import as_model
from meshensemble.core.ensemble import Ensemble
from meshensemble.core.mesh import ENSEMBLE, make_mesh, use_fake_cpu_devices
from meshensemble.core.steps import softmax_cross_entropy
from meshensemble.runtime.distributed import fetch

PyTree = Any

__all__ = [
    "assert_members_equal_single_models",
    "assert_members_match_single_model_training",
    "assert_mesh_invariant",
    "assert_sharded_over_members",
    "assert_trees_close",
    "learnable_dataset",
    "member_stream_keys",
    "need_devices",
    "set_fake_cpu_devices",
    "single_model_train_step",
]


# ------------------------------------------------------------------ devices
def set_fake_cpu_devices(n: int) -> None:
    """Makes JAX run on ``n`` simulated CPU devices; for ``conftest.py``, before JAX starts.

    Sets ``JAX_PLATFORMS=cpu`` and ``jax_num_cpu_devices`` with
    :func:`meshensemble.use_fake_cpu_devices` (the modern chex ``set_n_cpu_devices``).
    Importing ``jax`` or ``meshensemble`` first is fine; running a computation is not.
    Asking again for the count JAX already has does nothing.

    Args:
      n: number of CPU devices, at least 1.

    Raises:
      ValueError: ``n`` is not a positive integer.
      RuntimeError: JAX's backends already started with another device count.

    Example:
      >>> # conftest.py
      >>> from meshensemble.testing import set_fake_cpu_devices
      >>> set_fake_cpu_devices(8)
    """
    try:
        use_fake_cpu_devices(n)
    except RuntimeError:
        raise RuntimeError(
            f"too late: JAX already started with {jax.device_count()} devices; call "
            f"set_fake_cpu_devices({n}) in conftest.py before anything imports jax.numpy "
            "or runs a computation"
        ) from None


def need_devices(n: int) -> None:
    """Skips the calling pytest test when fewer than ``n`` devices exist.

    Args:
      n: the devices the test needs.

    Raises:
      pytest.skip.Exception: fewer than ``n`` devices (the test is reported skipped).

    Example:
      >>> def test_two_by_four():
      ...     need_devices(8)
      ...     mesh = me.make_mesh(ensemble=2, data=4)
      >>> test_two_by_four()   # 8 devices here: runs (with fewer, pytest skips it)
    """
    have = jax.device_count()
    if have < n:
        import pytest  # only needed to skip; the module imports without pytest

        pytest.skip(
            f"needs {n} devices, have {have}; set_fake_cpu_devices({n}) in conftest.py "
            "makes them on CPU"
        )


# ------------------------------------------------------------------ trees
def _close(actual: PyTree, expected: PyTree, rtol: float, atol: float, context: str) -> None:
    """chex's all-close on host copies, the failure prefixed by ``context``."""
    actual, expected = fetch(actual), fetch(expected)
    try:
        chex.assert_trees_all_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as err:
        detail = str(err).replace("[Chex] Assertion assert_trees_all_close failed:", "").strip()
        raise AssertionError(f"{context}: {detail}") from None


def assert_trees_close(
    actual: PyTree, expected: PyTree, rtol: float = 1e-5, atol: float = 1e-5
) -> None:
    """Asserts two pytrees are element-wise close, global (sharded) arrays included.

    Both trees are brought to the host as numpy (arrays on other processes' devices are
    gathered), then compared by ``chex.assert_trees_all_close``: same structure and
    shapes, ``|actual - expected| <= atol + rtol * |expected|``.

    Args:
      actual: a pytree of ``jax.Array`` (any sharding), numpy arrays or numbers.
      expected: a pytree of the same structure.
      rtol: relative tolerance.
      atol: absolute tolerance (``rtol=atol=0``: exactly equal).

    Raises:
      AssertionError: the structures differ, or a leaf differs; the message names the
        leaf's path (e.g. ``params/Dense_0/kernel``).

    Example:
      >>> reference_params = jax.tree.map(np.asarray, state.params)   # e.g. a saved copy
      >>> assert_trees_close(state.params, reference_params, atol=1e-5)
    """
    _close(actual, expected, rtol, atol, "trees differ")


def assert_sharded_over_members(state: PyTree, mesh: Mesh, specs: Any = None) -> None:
    """Asserts every leaf is a ``jax.Array`` split over ``ensemble`` on its leading axis.

    The invariant of a state through ``init``, steps and restores: each leaf's leading
    (member) axis is split over ``ensemble`` and over nothing else. Its other dimensions
    may be split over ``data`` (FSDP, ``shard_members=True``) and ``model`` (a mesh with
    a ``model`` axis), never over ``ensemble``. A member layout's shared leaves
    (``SharedState.shared`` and ``shared_opt_state``) have no member axis and must not be
    split over ``ensemble`` at all (one copy per device of each group). With ``specs``
    (``ens.state_specs(images[:1])``) each leaf must be placed exactly as its spec says.

    Args:
      state: an :class:`~meshensemble.EnsembleState` or any pytree of stacked leaves.
      mesh: the ensemble's mesh.
      specs: optional: one ``PartitionSpec`` for every leaf, or a tree of them like
        ``state`` (``ens.state_specs(images[:1])``); None checks the member axis only.

    Raises:
      AssertionError: a leaf is not a ``jax.Array``, has no leading axis, lives on
        another mesh, or is placed otherwise; the message names the leaf's path, its
        sharding and what was expected.

    Example:
      >>> state = ens.init(jax.random.key(0), images[:1])
      >>> assert_sharded_over_members(state, ens.mesh)
      >>> specs = ens.state_specs(images[:1])  # FSDP: the exact specs
      >>> assert_sharded_over_members(state, ens.mesh, specs)
    """
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    is_spec = lambda v: isinstance(v, P)
    if specs is None or isinstance(specs, P):
        wanted = [specs] * len(flat)
    else:
        wanted = jax.tree.structure(state).flatten_up_to(
            jax.tree.map(lambda v: v, specs, is_leaf=is_spec)
        )
    for (path, leaf), spec in zip(flat, wanted):
        where = jax.tree_util.keystr(path) or "the state"
        if where.startswith(".shared"):
            _check_shared_leaf(where, leaf, mesh, spec)
        else:
            _check_member_leaf(where, leaf, mesh, spec)


def _check_shared_leaf(where: str, leaf: Any, mesh: Mesh, spec: P | None) -> None:
    """A shared leaf: on ``mesh``, split over no ``ensemble`` (and as ``spec`` says, if given)."""
    sharding = getattr(leaf, "sharding", None)
    have = getattr(sharding, "spec", None)
    names = lambda entry: () if entry is None else entry if isinstance(entry, tuple) else (entry,)
    if have is None or any(ENSEMBLE in names(e) for e in have):
        raise AssertionError(
            f"{where} of shape {np.shape(leaf)} is a shared leaf with sharding {sharding}: it "
            "must be whole on every 'ensemble' device (no member axis, not split over 'ensemble')"
        )
    if sharding.mesh.shape_tuple != mesh.shape_tuple or (
        spec is not None and not sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim)
    ):
        raise AssertionError(
            f"{where} of shape {leaf.shape} has sharding {sharding}, not NamedSharding(mesh, "
            f"{spec if spec is not None else have})"
        )


def _check_member_leaf(where: str, leaf: Any, mesh: Mesh, spec: P | None) -> None:
    """One leaf of :func:`assert_sharded_over_members`."""
    if not isinstance(leaf, jax.Array):
        raise AssertionError(f"{where} is a {type(leaf).__name__}, not a jax.Array on the mesh")
    sharding = leaf.sharding
    if leaf.ndim == 0 or not isinstance(sharding, NamedSharding):
        raise AssertionError(
            f"{where} of shape {leaf.shape} has sharding {sharding}, not a NamedSharding "
            "split over 'ensemble' on its leading (member) axis"
        )
    have = tuple(sharding.spec) + (None,) * (leaf.ndim - len(sharding.spec))
    names = lambda entry: () if entry is None else entry if isinstance(entry, tuple) else (entry,)
    if spec is None:
        rest = have[1:]
        if any(ENSEMBLE in names(e) for e in rest):
            raise AssertionError(
                f"{where} of shape {leaf.shape} has spec {sharding.spec}: 'ensemble' splits a "
                "dimension other than the leading (member) axis"
            )
        spec = P(ENSEMBLE, *rest)
        what = "P('ensemble', ...) on its leading (member) axis"
    else:
        what = f"{spec} (the state's spec)"
    if sharding.mesh.shape_tuple != mesh.shape_tuple:
        raise AssertionError(
            f"{where} of shape {leaf.shape} is on another mesh, {dict(sharding.mesh.shape)}, "
            f"not the given {dict(mesh.shape)}"
        )
    if not sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim):
        raise AssertionError(
            f"{where} of shape {leaf.shape} has sharding {sharding}, not NamedSharding(mesh, "
            f"{what})"
        )


# ------------------------------------------------------------------ members vs single models
def assert_members_equal_single_models(
    ens: Ensemble,
    state: PyTree,
    key: jax.Array,
    sample: Any,
    rtol: float = 0.0,
    atol: float = 0.0,
) -> None:
    """Asserts member ``i`` is the single model initialised from ``split(key, M)[i]``.

    ``ens.model.init(jax.random.split(key, M)[i], x)`` (``x``: the sample after
    ``ens.input_transform``) must give member ``i``'s ``params`` and ``model_state``: the
    Flax HOWTO's convention, which makes members comparable with separate models.

    Args:
      ens: the ensemble.
      state: its state, e.g. from ``ens.init(key, sample)``.
      key: the key given to ``ens.init``.
      sample: the sample batch given to ``ens.init``.
      rtol: relative tolerance (default 0: bit for bit).
      atol: absolute tolerance (default 0).

    Raises:
      AssertionError: a member differs; the message names the member and the leaf path.

    Example:
      >>> state = ens.init(jax.random.key(0), images[:1])
      >>> assert_members_equal_single_models(ens, state, jax.random.key(0), images[:1])
    """
    x = jnp.asarray(sample)
    x = x if ens.input_transform is None else ens.input_transform(x)
    got = fetch({"params": state.params, "model_state": state.model_state})
    for i, k in enumerate(jax.random.split(key, ens.num_members)):
        params, model_state = ens.model.init(k, x)
        want = {"params": params, "model_state": model_state}
        context = f"member {i} is not the single model from split(key, {ens.num_members})[{i}]"
        _close(jax.tree.map(itemgetter(i), got), want, rtol, atol, context)


STREAM_FOLD = 1
"""The documented constant of a member's stochastic stream: ``fold_in(key_i, 1)``."""


def member_stream_keys(key: jax.Array, num_members: int) -> jax.Array:
    """Each member's stochastic-stream (dropout) key, by the documented rule alone.

    Member ``i`` of ``ens.init(key, ...)`` draws its randomness from
    ``jax.random.fold_in(jax.random.split(key, M)[i], 1)``; step ``s`` of it uses
    ``fold_in(that, s)``. Computed here from ``key`` without the ensemble, so a check
    built on it notices an ensemble that derives or shares its members' keys otherwise.

    Args:
      key: the key given to ``ens.init`` (typed, ``jax.random.key``, or raw,
        ``jax.random.PRNGKey``).
      num_members: ``M``.

    Returns:
      ``[M]`` typed keys, or ``[M, 2]`` raw uint32 keys, as ``key`` is.

    Example:
      >>> keys = member_stream_keys(jax.random.key(0), 4)  # keys[i]: member i's stream
      >>> keys.shape
      (4,)
    """
    return jax.vmap(lambda k: jax.random.fold_in(k, STREAM_FOLD))(
        jax.random.split(key, num_members)
    )


def single_model_train_step(
    model: Any,
    optimizer: optax.GradientTransformation,
    *,
    loss_fn: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
    input_transform: Callable[[jax.Array], jax.Array] | None = None,
    data_shards: int = 1,
) -> Callable[..., tuple[PyTree, PyTree, PyTree, jax.Array]]:
    """A plain jitted optax step of one model: the reference a member must match.

    The ensemble's contract for one member, without meshes or collectives: the batch is
    cut into ``data_shards`` equal consecutive parts (the ``data`` shards); part ``j`` of
    step ``s`` runs the model in training mode with key ``fold_in(fold_in(rng, s), j)``
    (dropout draws one mask per member, step and shard); the loss is the mean of the
    parts' mean losses, the new ``model_state`` (BatchNorm statistics) the parts' mean.

    Args:
      model: a Linen module, an NNX factory, a function pair or a Model, e.g. ``ens.model``.
      optimizer: the optax optimizer of one member.
      loss_fn: per-example loss ``(logits [b, C], labels [b]) -> [b]``; default cross-entropy.
      input_transform: applied to the images first; default none.
      data_shards: parts the batch is cut into (the ensemble's ``data`` axis size).

    Returns:
      ``step(params, model_state, opt_state, images [B, ...], labels [B], rng, step) ->
      (params, model_state, opt_state, loss)``, jitted; ``rng`` is the member's stream
      key (``member_stream_keys(key, M)[i]``: row ``i`` of ``EnsembleState.rng``, as a
      key) and ``step`` its step count.

    Raises:
      ValueError: ``data_shards`` is not a positive integer; (when called) the batch is
        not divisible by it.

    Example:
      >>> step = single_model_train_step(ens.model, ens.optimizer, data_shards=2)
      >>> params, model_state = ens.model.init(jax.random.key(1), images[:1])
      >>> rng = member_stream_keys(jax.random.key(0), 2)[0]   # member 0's stream
      >>> out = step(params, model_state, ens.optimizer.init(params), images, labels, rng, 0)
      >>> params, model_state, opt_state, loss = out
      >>> loss.shape
      ()
    """
    model = as_model(model)
    loss_fn = loss_fn or softmax_cross_entropy
    if not isinstance(data_shards, int | np.integer) or data_shards < 1:
        raise ValueError(f"data_shards={data_shards!r} is not a positive integer; give e.g. 1")

    def objective(params, model_state, x, y, key):
        losses, states = [], []
        if x.shape[0] % data_shards:
            raise ValueError(
                f"a batch of {x.shape[0]} does not split into data_shards={data_shards} equal "
                "parts; use a batch size divisible by the mesh's data axis"
            )
        # the global batch is the data shards one after another: [(d b), ...] -> [d, b, ...]
        x = einops.rearrange(x, "(d b) ... -> d b ...", d=data_shards)
        y = einops.rearrange(y, "(d b) ... -> d b ...", d=data_shards)
        for j, (xj, yj) in enumerate(zip(x, y)):
            shard_key = jax.random.fold_in(key, j)
            logits, new_state = model.apply(params, model_state, xj, True, shard_key)
            losses.append(jnp.mean(loss_fn(logits, yj)))
            states.append(new_state)
        mean = lambda *v: (sum(v) / len(v)).astype(v[0].dtype)
        return sum(losses) / len(losses), jax.tree.map(mean, *states)

    @jax.jit
    def step(params, model_state, opt_state, images, labels, rng, step_index):
        x = images if input_transform is None else input_transform(images)
        key = jax.random.fold_in(rng, step_index)
        (loss, model_state), grads = jax.value_and_grad(objective, has_aux=True)(
            params, model_state, x, labels, key
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), model_state, opt_state, loss

    return step


def _with_member_hyperparams(opt_state: Any, hyperparams: Mapping[str, Any], i: int) -> Any:
    """``opt_state`` (of ``optax.inject_hyperparams``) with member ``i``'s own values."""
    if not hyperparams:
        return opt_state
    values = dict(opt_state.hyperparams)
    for name, v in hyperparams.items():
        values[name] = jnp.asarray(np.asarray(v)[i], values[name].dtype)
    return opt_state._replace(hyperparams=values)


def assert_members_match_single_model_training(
    ens: Ensemble,
    key: jax.Array,
    images: Any,
    labels: Any,
    steps: int = 3,
    rtol: float = 1e-5,
    atol: float = 1e-5,
) -> PyTree:
    """Asserts that training the ensemble equals training each member alone.

    Runs ``ens.init(key, images[:1])`` and ``steps`` calls of ``ens.train_step(state,
    images, labels)``; trains each member ``i`` alone from ``ens.model.init(split(key,
    M)[i], ...)`` and ``ens.optimizer.init`` (with its ``hyperparams``) by
    :func:`single_model_train_step` (``ens.loss_fn``, ``ens.input_transform``, the
    ``data`` axis as shards, and member ``i``'s stream key derived from ``key`` by the
    documented rule, :func:`member_stream_keys`, never read back from the state under
    test); parameters, model state and per-step losses must agree. An ensemble whose
    members share a dropout key, or derive it otherwise, fails.

    Args:
      ens: the ensemble (``compute_dtype`` None; shared, not per-member, batches).
      key: the key for ``ens.init``.
      images: one batch ``[B, ...]``, used at every step.
      labels: ``[B]`` integer labels.
      steps: number of steps.
      rtol: relative tolerance.
      atol: absolute tolerance.

    Returns:
      The ensemble's state after the steps.

    Raises:
      ValueError: ``ens`` computes in mixed precision (compare in float32).
      AssertionError: a member differs; the message names the member and the leaf path.

    Example:
      >>> key = jax.random.key(0)   # `ens`: 2 MLP members on an ensemble=2 mesh
      >>> trained = assert_members_match_single_model_training(ens, key, images, labels, steps=2)
      >>> trained.step.tolist()   # each member took the same steps as its single model
      [2, 2]
    """
    if ens.compute_dtype is not None:
        raise ValueError(
            f"ens has compute_dtype={ens.compute_dtype}; check parity on an ensemble without "
            "compute_dtype (the single-model reference computes in the parameters' dtype)"
        )
    state = ens.init(key, images[:1])
    streams = member_stream_keys(key, ens.num_members)
    losses = []
    for _ in range(steps):
        state, metrics = ens.train_step(state, images, labels)
        losses.append(fetch(metrics["loss"]))
    got = fetch({"params": state.params, "model_state": state.model_state})
    hooks = {"loss_fn": ens.loss_fn, "input_transform": ens.input_transform}
    step = single_model_train_step(ens.model, ens.optimizer, **hooks, data_shards=ens.data_size)
    x = jnp.asarray(images[:1])
    x = x if ens.input_transform is None else ens.input_transform(x)
    for i, k in enumerate(jax.random.split(key, ens.num_members)):
        params, model_state = ens.model.init(k, x)
        opt_state = _with_member_hyperparams(ens.optimizer.init(params), ens.hyperparams, i)
        ref_losses = []
        for s in range(steps):
            params, model_state, opt_state, loss = step(
                params, model_state, opt_state, images, labels, streams[i], s
            )
            ref_losses.append(loss)
        want = {"params": params, "model_state": model_state}
        context = f"member {i} after {steps} steps differs from the single model trained alone"
        _close(jax.tree.map(itemgetter(i), got), want, rtol, atol, context)
        _close(np.stack(losses)[:, i], np.stack(fetch(ref_losses)), rtol, atol, f"{context} (loss)")
    return state


# ------------------------------------------------------------------ mesh invariance
def assert_mesh_invariant(
    fn: Callable[[Mesh], PyTree],
    mesh_shapes: Sequence[tuple[int, int] | Mapping[str, int]],
    rtol: float = 1e-5,
    atol: float = 1e-5,
) -> PyTree:
    """Asserts ``fn(mesh)`` gives the same pytree on meshes of every shape.

    ``fn`` runs on ``me.make_mesh(*shape)`` (``make_mesh(**shape)`` for a dict) for each
    shape; its results, as numpy on the host, must all be close to the first shape's.

    Args:
      fn: ``fn(mesh) -> pytree`` of arrays (global ``jax.Array`` included), e.g. train a
        few steps and return the state and metrics.
      mesh_shapes: ``(ensemble, data)`` pairs or dicts, at least one.
      rtol: relative tolerance.
      atol: absolute tolerance.

    Returns:
      The first shape's result, as numpy.

    Raises:
      ValueError: no shapes, or a shape ``make_mesh`` rejects.
      AssertionError: a result differs; the message names both mesh shapes and the leaf.

    Example:
      >>> def train(mesh):
      ...     ens = me.Ensemble(me.models.MLP((8,)), optax.sgd(0.1), 2, mesh,
      ...                       input_transform=me.data.normalize)
      ...     state, _ = ens.train_step(ens.init(jax.random.key(0), images[:1]), images, labels)
      ...     return state.params
      >>> params = assert_mesh_invariant(train, [(2, 1), (1, 2)])   # (ensemble, data)
    """
    shapes = list(mesh_shapes)
    if not shapes:
        raise ValueError("mesh_shapes is empty; give e.g. [(8, 1), (4, 2)]")
    first, ref = None, None
    for shape in shapes:
        mesh = make_mesh(**shape) if isinstance(shape, Mapping) else make_mesh(*shape)
        name, out = "x".join(map(str, mesh.shape.values())), fetch(fn(mesh))
        if ref is None:
            first, ref = name, out
        else:
            where = f"fn(mesh) on the mesh ensemble x data = {name} differs from {first}"
            _close(out, ref, rtol, atol, where)
    return ref


# ------------------------------------------------------------------ data
def learnable_dataset(
    n: int,
    image_shape: tuple[int, int, int] = (8, 8, 1),
    num_classes: int = 10,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """A tiny synthetic image set that a small net learns in a few dozen steps.

    Images are Gaussian noise (std 0.3) with the class written as a bright row
    (``y % height``) and a bright column (``y // height + max(width // 2 - 1, 0)``), +1.5
    in every channel, so each class has its own pattern.

    Args:
      n: number of examples.
      image_shape: ``(height, width, channels)``.
      num_classes: number of classes, at most the ``(row, column)`` pairs the image has.
      seed: numpy seed; the same arguments give the same arrays.

    Returns:
      ``(images [n, *image_shape] float32, labels [n] int32)``.

    Raises:
      ValueError: ``image_shape`` is not 3 sizes, ``n`` < 1, or ``num_classes`` too many.

    Example:
      >>> images, labels = learnable_dataset(32)
      >>> images.shape, labels.dtype
      ((32, 8, 8, 1), dtype('int32'))
    """
    h, w = tuple(image_shape)[:2] if len(image_shape) == 3 else (0, 0)
    first_column = max(w // 2 - 1, 0)
    capacity = h * (w - first_column)
    if n < 1 or not 1 <= num_classes <= capacity or min(image_shape, default=0) < 1:
        raise ValueError(
            f"n={n}, image_shape={image_shape!r}, num_classes={num_classes}: give n >= 1, "
            f"(height, width, channels) and 1 <= num_classes <= height * (width - {first_column})"
        )
    rng = np.random.default_rng(seed)
    y = rng.integers(0, num_classes, n)
    x = rng.normal(0, 0.3, (n, *image_shape)).astype(np.float32)
    x[np.arange(n), y % h, :, :] += 1.5
    x[np.arange(n), :, y // h + first_column, :] += 1.5
    return x, y.astype(np.int32)
