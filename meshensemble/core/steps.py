"""Per-device step functions: what one device computes for its local members.

Every function here runs with the mesh axes ``ensemble`` and ``data`` bound (inside
``jax.shard_map``, or inside ``jax.pmap`` for the legacy backend) and sees local views:
state leaves ``[m, ...]`` (its ``m`` members), a batch ``[b, ...]`` (its part of the
batch) or per-member batches ``[m, b, ...]``. This is where the collectives live:

* gradients (and the loss, a task's member metrics, BatchNorm running statistics) are
  averaged over ``data``; a BatchNorm normalises with the whole batch's statistics only
  when the model itself reduces them over ``data`` (``nn.BatchNorm(axis_name=
  me.models.batch_axis())``, as the zoo's ResNet does): each device sees only its part;
* the task (:class:`meshensemble.core.tasks.Task`) says how the members combine, what a
  train step reports, what an evaluation sums and what ``predict`` serves; it reduces with
  a :class:`MeshReducer`, whose methods are these collectives: ``pmean``/``psum``/``pmax``/
  ``pmin`` over ``ensemble`` after the local members' mean, sum, max or min (the mean of
  the members' softmax for classification; a Gaussian mixture's moments, its log-mean-exp
  density and bisected quantiles for regression), ``pmean``/``psum`` over ``data``, and the
  members passed round the ``ensemble`` ring (``ppermute``) for pairwise terms, so no
  device gathers all members.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from meshensemble.core import forward
from meshensemble.core.adapters import Model
from meshensemble.core.layout import combine, frozen_split, is_none, partition
from meshensemble.core.members import map_members as map_members
from meshensemble.core.mesh import DATA, ENSEMBLE
from meshensemble.core.ordering import ordered_after
from meshensemble.core.state import (
    EnsembleState,
    member_part,
    shared_part,
    whole_params,
    with_shared,
)
from meshensemble.core.tasks import EvalSums
from meshensemble.core.tasks import softmax_cross_entropy as softmax_cross_entropy

PyTree = Any
LossFn = Callable[[jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What the local step functions need besides arrays (static under ``jit``).

    Attributes:
      model: the model interface.
      tx: the optax optimizer of one member.
      loss_fn: per-example loss ``loss_fn(outputs [b, W], targets [b, ...]) -> [b]`` (the
        task's, unless the Ensemble was given one).
      strategy: how the local members are computed, ``"vmap"`` or ``"loop"``.
      grad_mode: ``"vma"`` (shard_map with ``check_vma``: the loss is averaged over
        ``data`` inside the differentiated function, and the transposed collectives
        average the gradients) or ``"pmean"`` (pmap, or shard_map without ``check_vma``
        on a mesh whose ``data`` axis has size 1: ``pmean`` the gradients; collectives
        over an axis of size 1 are skipped, see :func:`reduce_over`).
      rng_impl: the ensemble's declared key implementation (``key_impl``), or None: the
        state's keys say theirs by their word count (:func:`meshensemble.core.keys.impl_for`).
      input_transform: applied to inputs on device before the model (e.g. uint8 to
        float); None for none.
      compute_dtype: mixed precision: the model computes with its floating parameters
        and inputs cast to this dtype (e.g. ``jnp.bfloat16``); the parameters, optimizer
        state and gradients stay in their own dtype (float32 master weights), and the
        outputs are cast to float32 before the loss and the task's predictions. None: no
        casting.
      augment: ``fn(key, image) -> image``, one training example's augmentation, applied
        in each member's step after the input transform, with keys drawn for the whole
        global batch from the member's key and step (see :mod:`meshensemble.data.augment`:
        the same on any mesh, resume-exact); None for none.
      gather_axes: FSDP (``shard_members``): for each parameter leaf (flattening order)
        the dimension split over ``data``, or None; see :func:`gather_params`. None
        (the default): parameters are whole on every device.
      task: the :class:`~meshensemble.core.tasks.Task`.
      frozen: a member layout's frozen leaves: one bool per leaf of a member's whole
        parameters (flattening order), or None (every leaf trained). Shared leaves come
        with the state (:class:`~meshensemble.core.state.SharedState`).
    """

    model: Model
    tx: optax.GradientTransformation
    loss_fn: LossFn
    strategy: str
    grad_mode: str
    rng_impl: Any = None
    input_transform: Callable[[jax.Array], jax.Array] | None = None
    compute_dtype: Any = None
    augment: Callable[[jax.Array, jax.Array], jax.Array] | None = None
    gather_axes: tuple[int | None, ...] | None = None
    task: Any = None
    frozen: tuple[bool, ...] | None = None


def reduce_over(cfg: StepConfig, reduce: Callable[..., Any], x: PyTree, axis: str) -> PyTree:
    """``reduce(x, axis)`` (``lax.pmean`` or ``lax.psum``), or ``x`` where ``axis`` has size 1.

    A reduction over a size-1 axis is the identity, but XLA:CPU still runs it as an
    all-reduce, a rendezvous of every device's thread: on 8 fake devices it cost the step
    about a fifth of its time. Under ``check_vma`` (``grad_mode="vma"``) the reduction is
    kept (it makes the value invariant over ``axis``, which the specs check).

    Args:
      cfg: the static configuration (its ``grad_mode``).
      reduce: ``lax.pmean`` or ``lax.psum``.
      x: a pytree of arrays.
      axis: a mesh axis name.

    Returns:
      ``x`` reduced over ``axis``, same shapes.

    Example:
      >>> from meshensemble.core.mesh import DATA
      >>> cfg, rows = ens.step_config(), me.make_mesh(ensemble=1, data=2)
      >>> f = jax.shard_map(lambda loss: reduce_over(cfg, lax.pmean, loss, DATA), mesh=rows,
      ...                   in_specs=P(DATA), out_specs=P())
      >>> f(jax.device_put(jnp.array([1.0, 3.0]), me.batch_sharding(rows)))  # the mean
      Array([2.], dtype=float32)
    """
    if cfg.grad_mode != "vma" and lax.axis_size(axis) == 1:
        return x
    return reduce(x, axis)


@dataclasses.dataclass(frozen=True)
class MeshReducer:
    """The :class:`~meshensemble.core.tasks.Reducer` a task's per-device methods get here.

    Every method is the local reduction over a device's ``m`` members (axis 0) followed by
    the collective over ``ensemble`` (:func:`reduce_over`), or a collective over ``data``.

    Attributes:
      cfg: the static configuration.
      members: ``M``, the ensemble's size (local members times the ``ensemble`` axis).

    Example:
      >>> f = jax.shard_map(lambda v: reducer(ens.step_config(), 1).mean(v), mesh=mesh,
      ...                   in_specs=P("ensemble"), out_specs=P())
      >>> f(jax.device_put(jnp.array([[1.0], [3.0]]), me.member_sharding(mesh)))  # 2 members
      Array([2.], dtype=float32)
    """

    cfg: StepConfig
    members: int

    def _over(self, local: Callable, collective: Callable, x: PyTree) -> PyTree:
        return reduce_over(self.cfg, collective, jax.tree.map(lambda v: local(v, 0), x), ENSEMBLE)

    def mean(self, x: PyTree) -> PyTree:
        """The mean over every member; leaves ``[m, ...]`` -> ``[...]``."""
        return self._over(jnp.mean, lax.pmean, x)

    def sum(self, x: PyTree) -> PyTree:
        """The sum over every member; leaves ``[m, ...]`` -> ``[...]``."""
        return self._over(jnp.sum, lax.psum, x)

    def max(self, x: PyTree) -> PyTree:
        """The maximum over every member; leaves ``[m, ...]`` -> ``[...]``."""
        return self._over(jnp.max, lax.pmax, x)

    def min(self, x: PyTree) -> PyTree:
        """The minimum over every member; leaves ``[m, ...]`` -> ``[...]``."""
        return self._over(jnp.min, lax.pmin, x)

    def pool(self, x: PyTree) -> PyTree:
        """The mean over ``ensemble`` of a statistic already averaged over local members."""
        return reduce_over(self.cfg, lax.pmean, x, ENSEMBLE)

    def data_mean(self, x: PyTree) -> PyTree:
        """The mean over ``data`` (the parts of the batch)."""
        return reduce_over(self.cfg, lax.pmean, x, DATA)

    def data_sum(self, x: PyTree) -> PyTree:
        """The sum over ``data`` (the parts of the batch)."""
        return reduce_over(self.cfg, lax.psum, x, DATA)

    def pairs(self, fn: Callable[[PyTree, PyTree], jax.Array], x: PyTree) -> jax.Array:
        """``sum`` over every ordered pair of devices' member stacks of ``fn(own, other)``.

        Each device pairs its members with every ``ensemble`` device's in turn, the
        visiting members moving one step round the ring (``ppermute``) each time; the sums
        are ``psum``-ed over ``ensemble``.
        """
        e = lax.axis_size(ENSEMBLE)
        total, visiting = fn(x, x), x
        ring = [(i, (i + 1) % e) for i in range(e)]
        for _ in range(e - 1):
            visiting = lax.ppermute(visiting, ENSEMBLE, ring)
            total = total + fn(x, visiting)
        return reduce_over(self.cfg, lax.psum, total, ENSEMBLE)


def reducer(cfg: StepConfig, local_members: int) -> MeshReducer:
    """The :class:`MeshReducer` of a device holding ``local_members`` members (in a step).

    Example:
      >>> members = lambda v: jnp.float32(reducer(ens.step_config(), 1).members)
      >>> f = jax.shard_map(members, mesh=mesh, in_specs=P("ensemble"), out_specs=P())
      >>> int(f(jax.device_put(jnp.zeros(2), me.member_sharding(mesh))))   # 1 per device
      2
    """
    return MeshReducer(cfg, int(local_members) * lax.axis_size(ENSEMBLE))


def gather_params(cfg: StepConfig, params: PyTree) -> PyTree:
    """One member's whole parameters from this device's FSDP slices (``all_gather`` over ``data``).

    Each leaf that ``cfg.gather_axes`` splits is ``lax.all_gather(..., tiled=True)`` along
    its dimension; others pass through. Differentiated, the all-gather's transpose is a
    reduce-scatter (``psum_scatter`` over ``data``): with the loss averaged over ``data``
    (``grad_mode="vma"``), each device gets its slice of the data-mean gradient.

    Args:
      cfg: the static configuration.
      params: one member's parameters, FSDP leaves split (no member axis).

    Returns:
      The parameters with every leaf whole.
    """
    if cfg.gather_axes is None:
        return params
    leaves, treedef = jax.tree.flatten(params)
    whole = [
        v if a is None else lax.all_gather(v, DATA, axis=a, tiled=True)
        for v, a in zip(leaves, cfg.gather_axes)
    ]
    return jax.tree.unflatten(treedef, whole)


def _member_step(
    cfg: StepConfig, state: EnsembleState, shared: PyTree, x: jax.Array, y: jax.Array
) -> tuple[EnsembleState, jax.Array, PyTree, PyTree, PyTree]:
    """One member's step on its local batch; ``state`` leaves have no member axis.

    ``shared`` holds the shared leaves (None: no layout); the member's model runs on its
    own leaves with them. Frozen leaves (``cfg.frozen``) are not differentiated. The
    member's own trained leaves are updated here with the gradient of its own loss; the
    gradient of its loss for the shared trained leaves is returned (None at the others)
    for :func:`train_step` to gather over every member.
    """
    rng = forward.member_key(cfg, state.rng, state.step)
    x = forward.augmented(cfg, state, x)
    trained, frozen = frozen_split(whole_params(state.params, shared), cfg.frozen)

    def loss_of(params):
        whole = gather_params(cfg, combine(params, frozen))
        out, new_model_state = forward.apply_model(cfg, whole, state.model_state, x, True, rng)
        loss = jnp.mean(cfg.loss_fn(out, y))
        # Under check_vma, the gradient of data-invariant params is summed over `data`
        # by the transposed collectives; differentiating the data-mean gives the mean.
        objective = lax.pmean(loss, DATA) if cfg.grad_mode == "vma" else loss
        return objective, (loss, out, new_model_state)

    (_, (loss, out, new_model_state)), grads = jax.value_and_grad(loss_of, has_aux=True)(trained)
    if cfg.grad_mode == "pmean":
        grads = reduce_over(cfg, lax.pmean, grads, DATA)
    new_model_state = reduce_over(cfg, lax.pmean, new_model_state, DATA)
    preds = cfg.task.member_predictions(out)
    one = MeshReducer(cfg, 1)  # one member: only its data reductions apply here
    loss, metrics = reduce_over(cfg, lax.pmean, loss, DATA), cfg.task.member_metrics(out, y, one)
    own, shared_grads = _own_and_shared(grads, shared)
    updates, opt_state = cfg.tx.update(own, state.opt_state, _like(state.params, own))
    updates = ordered_after((grads, loss, preds, metrics), updates)
    params = optax.apply_updates(_like(state.params, own), updates)
    if shared is not None or cfg.frozen is not None:  # the frozen own leaves, unchanged
        params = combine(params, state.params)
    new_state = state.replace(
        step=state.step + 1, params=params, opt_state=opt_state, model_state=new_model_state
    )
    return new_state, loss, metrics, preds, shared_grads


def _own_and_shared(tree: PyTree, shared: PyTree) -> tuple[PyTree, PyTree]:
    """A whole-parameter tree split into the member's own leaves and the shared ones."""
    if shared is None:
        return tree, None
    return partition(tree, jax.tree.map(lambda v: v is not None, shared, is_leaf=is_none))


def _like(values: PyTree, present: PyTree) -> PyTree:
    """``values``' leaves where ``present`` has one (None elsewhere); ``values`` if all are."""
    if values is present or jax.tree.structure(values) == jax.tree.structure(present):
        return values
    return jax.tree.map(lambda p, v: None if p is None else v, present, values, is_leaf=is_none)


def shared_update(
    cfg: StepConfig, shared: tuple[PyTree, PyTree], grads: PyTree, local_members: int
) -> tuple[PyTree, PyTree]:
    """One optimizer step of the shared leaves on the gradient of the members' mean loss.

    The local members' gradients are summed, then ``psum``-ed over ``ensemble`` and
    divided by ``M``: every device holds the same mean of all members' gradients (each
    already averaged over ``data``) and applies the same update to its copy.

    Args:
      cfg: the static configuration.
      shared: ``(shared, shared_opt_state)``, leaves without the member axis.
      grads: each local member's gradient of its loss, leaves ``[m, ...]`` (None at frozen
        leaves and at the members' own leaves).
      local_members: ``m``, the members on this device.

    Returns:
      The new ``(shared, shared_opt_state)``.
    """
    params, opt_state = shared
    sums = jax.tree.map(lambda g: jnp.sum(g, 0), grads)
    if not jax.tree.leaves(sums):  # every shared leaf frozen (an adapters' backbone)
        return params, opt_state
    total = reduce_over(cfg, lax.psum, sums, ENSEMBLE)
    count = local_members * lax.axis_size(ENSEMBLE)
    mean = jax.tree.map(lambda g: g / count, total)
    trained = _like(params, mean)
    updates, opt_state = cfg.tx.update(mean, opt_state, trained)
    return combine(optax.apply_updates(trained, updates), params), opt_state


def _varying_shared(cfg: StepConfig, shared: PyTree) -> PyTree:
    """The shared leaves as varying over ``ensemble`` (under ``check_vma``), so each
    member's gradient of them stays its own until :func:`shared_update` sums them."""
    if shared is None or cfg.grad_mode != "vma":
        return shared
    return jax.tree.map(lambda v: lax.pcast(v, (ENSEMBLE,), to="varying"), shared)


def train_step(
    cfg: StepConfig, state: EnsembleState, images: jax.Array, labels: jax.Array
) -> tuple[EnsembleState, dict[str, jax.Array]]:
    """One step of every local member (and of the shared leaves, with a member layout).

    Args:
      cfg: the static configuration.
      state: local state, leaves ``[m, ...]`` (a :class:`~meshensemble.core.state.SharedState`'s
        shared leaves without the member axis).
      images: inputs ``[b, ...]`` (shared by all members) or ``[m, b, ...]`` (per member).
      labels: targets ``[b, ...]`` or ``[m, b, ...]`` (the task's, e.g. integer classes).

    Returns:
      ``(state, metrics)``: ``metrics["loss"]`` and the task's member metrics (e.g.
      ``accuracy``) are ``[m]`` (averaged over ``data``); ``ensemble_<name>`` for each of
      the task's ensemble metrics (e.g. ``ensemble_accuracy``, ``ensemble_nll``) are
      scalars over all members (NaN for per-member batches, where members see different
      examples).
    """
    task = cfg.task
    per_member = labels.ndim > task.target_ndim + 1
    axes = (0, None, 0 if per_member else None, 0 if per_member else None)
    x = forward.prepare(cfg, images)
    sharing = shared_part(state)
    shared = None if sharing is None else _varying_shared(cfg, sharing[0])
    fn = lambda s, sh, xb, yb: _member_step(cfg, s, sh, xb, yb)
    members, loss, member, preds, grads = map_members(
        fn, cfg.strategy, axes, member_part(state), shared, x, labels
    )
    m = members.step.shape[0]
    state = with_shared(members, sharing and shared_update(cfg, sharing, grads, m))
    metrics = {"loss": loss, **member}
    if per_member:
        nan = jnp.full((), jnp.nan, jnp.float32)
        metrics.update({f"ensemble_{k}": nan for k in task.ensemble_metric_names})
    else:
        # The ensemble's all-reduce after the updates: the devices meet once, at the end
        # of the step, not also midway (on 8 CPU devices sharing 2 cores, each meeting
        # idles cores while the last device catches up: ~1% of the user CNN's step).
        preds = ordered_after((state.params, sharing and shared_part(state)[0]), preds)
        together = task.ensemble_metrics(preds, labels, reducer(cfg, state.step.shape[0]))
        metrics.update({f"ensemble_{k}": v for k, v in together.items()})
    return state, metrics


def member_logits(cfg: StepConfig, state: EnsembleState, images: jax.Array) -> jax.Array:
    """The outputs of every local member in inference mode (logits, for classification).

    Args:
      cfg: the static configuration.
      state: local state, leaves ``[m, ...]`` (with FSDP, gathered over ``data`` here; a
        member layout's shared leaves joined to each member's own).
      images: inputs ``[b, ...]``.

    Returns:
      ``[m, b, W]`` float32 outputs.
    """
    x = forward.prepare(cfg, images)
    sharing = shared_part(state)

    def one(s: EnsembleState, shared: PyTree, xb: jax.Array) -> jax.Array:
        whole = gather_params(cfg, whole_params(s.params, shared))
        out, _ = forward.apply_model(cfg, whole, s.model_state, xb, False, s.rng)
        return out.astype(jnp.float32)

    shared = None if sharing is None else sharing[0]
    return map_members(one, cfg.strategy, (0, None, None), member_part(state), shared, x)


def member_predictions(cfg: StepConfig, state: EnsembleState, images: jax.Array) -> PyTree:
    """Every local member's prediction (the task's, e.g. its softmax), leaves ``[m, b, ...]``."""
    return cfg.task.member_predictions(member_logits(cfg, state, images))


def ensemble_prediction(cfg: StepConfig, state: EnsembleState, images: jax.Array) -> PyTree:
    """The ensemble's prediction: the task's combination of every member's, leaves ``[b, ...]``.

    For classification the mean of the members' softmax: the mean over local members,
    then ``pmean`` over ``ensemble``.
    """
    preds = member_predictions(cfg, state, images)
    return cfg.task.combine(preds, reducer(cfg, state.step.shape[0]))


def served(
    cfg: StepConfig, members: bool, state: EnsembleState, images: jax.Array
) -> tuple[PyTree, PyTree]:
    """What ``predict`` serves for a batch: the task's ``(per_example, per_member)`` outputs.

    Returns:
      :meth:`meshensemble.core.tasks.Task.serve` of the members' outputs: leaves ``[b,
      ...]`` (the same on every ``ensemble`` device) and, with ``members``, ``[m, b, ...]``.
    """
    z = member_logits(cfg, state, images)
    return cfg.task.serve(z, reducer(cfg, state.step.shape[0]), members)


def eval_stats(
    cfg: StepConfig,
    options: tuple[tuple[str, Any], ...],
    state: EnsembleState,
    images: jax.Array,
    labels: jax.Array,
    mask: jax.Array,
) -> EvalSums:
    """The task's sums of one evaluation batch, reduced on the mesh.

    The members' outputs never leave the devices: the task's
    :meth:`~meshensemble.core.tasks.Task.eval_sums` reduces them over ``ensemble`` and
    ``data`` with the :class:`MeshReducer`.

    Args:
      cfg: the static configuration.
      options: the evaluation's keywords as ``(name, value)`` pairs (e.g. ``num_bins``).
      state: local state.
      images: ``[b, ...]``; labels ``[b, ...]``; mask ``[b]`` (0 for padding).

    Returns:
      An :class:`~meshensemble.core.tasks.EvalSums`.
    """
    z = member_logits(cfg, state, images)
    return cfg.task.eval_sums(z, labels, mask, reducer(cfg, state.step.shape[0]), **dict(options))


def ood_stats(
    cfg: StepConfig,
    options: tuple[tuple[str, Any], ...],
    state: EnsembleState,
    images: jax.Array,
    labels: jax.Array,
    mask: jax.Array,
) -> EvalSums:
    """The task's OOD scores of one batch (:meth:`~meshensemble.tasks.Classification.ood_sums`).

    Args:
      cfg, options, state: the static configuration, the keywords, the local state.
      images: ``[b, ...]``; labels ``[b]`` (any if none); mask ``[b]`` (0: padding).

    Returns:
      An :class:`~meshensemble.core.tasks.EvalSums` of per-example scores and bin sums.
    """
    z = member_logits(cfg, state, images)
    return cfg.task.ood_sums(z, labels, mask, reducer(cfg, state.step.shape[0]), **dict(options))


def gather_batch(
    images: jax.Array, labels: jax.Array, order: jax.Array, step: jax.Array, batch_size: int
) -> tuple[jax.Array, jax.Array]:
    """Gathers this device's part of batch ``step`` of an epoch from on-device data.

    Args:
      images: the whole training set ``[N, ...]`` (replicated).
      labels: ``[N]``.
      order: the epoch's permutation ``[N]`` (shared) or ``[m, N]`` (per local member).
      step: the step index within the epoch (scalar).
      batch_size: the global batch size ``B`` (divisible by the ``data`` axis).

    Returns:
      ``(images [b, ...], labels [b])`` or per member ``([m, b, ...], [m, b])`` with
      ``b = B / data``: this device's slice of the global batch.
    """
    b = batch_size // lax.axis_size(DATA)
    start = step * batch_size + lax.axis_index(DATA) * b
    idx = lax.dynamic_slice_in_dim(order, start, b, axis=order.ndim - 1)
    return images[idx], labels[idx]


def _zero_rows(num_steps: int) -> Callable[[jax.ShapeDtypeStruct], jax.Array]:
    """``[num_steps, *shape]`` zeros varying over the mesh axes a metric varies over."""

    def zeros(like: jax.ShapeDtypeStruct) -> jax.Array:
        rows = jnp.zeros((num_steps, *like.shape), like.dtype)
        manual = getattr(like, "manual_axis_type", None)  # shard_map: a loop carry's type
        axes = tuple(sorted(getattr(manual, "varying", None) or ()))
        return lax.pcast(rows, axes, to="varying") if axes else rows

    return zeros


def train_chunk(
    cfg: StepConfig,
    num_steps: int,
    batch_size: int,
    state: EnsembleState,
    images: jax.Array,
    labels: jax.Array,
    order: jax.Array,
    first_step: jax.Array,
    count: jax.Array | None = None,
) -> tuple[EnsembleState, dict[str, jax.Array]]:
    """``num_steps`` train steps on batches gathered on device (a ``lax.scan`` when > 1).

    With ``count`` the number of steps is a runtime value ``1 <= count <= num_steps``
    (a ``lax.fori_loop`` with a dynamic trip count): one compiled program runs any number
    of steps up to ``num_steps``, and each step computes exactly what it computes in a
    call of any other count.

    Args:
      cfg: the static configuration.
      num_steps: steps in this compiled call (K), or the most steps with ``count``.
      batch_size: global batch size.
      state: local state.
      images, labels: the whole training set on every device.
      order: the epoch's order, ``[N]`` or ``[m, N]``.
      first_step: index within the epoch of the first step of the chunk.
      count: int32 scalar, the steps to run (None: ``num_steps``, a ``lax.scan``).

    Returns:
      ``(state, metrics)`` with each metric stacked over the chunk's steps: ``[K, m]``
      or ``[K]``. With ``count``, the last ``count`` rows hold the steps run, in order
      (so row ``-1`` is the last step), and the rows before them are zeros.
    """

    def body(st: EnsembleState, k: jax.Array):
        batch = gather_batch(images, labels, order, first_step + k, batch_size)
        return train_step(cfg, st, *lax.optimization_barrier(batch))  # as if given the batch

    if count is not None:
        shapes = jax.eval_shape(body, state, jnp.zeros((), jnp.int32))[1]
        rows = jax.tree.map(_zero_rows(num_steps), shapes)
        skip = num_steps - count

        def step(k: jax.Array, carry):
            st, out = carry
            st, metrics = body(st, k)
            put = lambda buf, v: lax.dynamic_update_index_in_dim(buf, v, skip + k, 0)
            return st, jax.tree.map(put, out, metrics)

        return lax.fori_loop(jnp.int32(0), count, step, (state, rows))
    if num_steps == 1:
        state, metrics = body(state, jnp.zeros((), jnp.int32))
        return state, jax.tree.map(lambda v: v[None], metrics)
    return lax.scan(body, state, jnp.arange(num_steps, dtype=jnp.int32))
