"""Per-device step functions: what one device computes for its local members.

Every function here runs with the mesh axes ``ensemble`` and ``data`` bound (inside
``jax.shard_map``, or inside ``jax.pmap`` for the legacy backend) and sees local views:
state leaves ``[m, ...]`` (its ``m`` members), a batch ``[b, ...]`` (its part of the
batch) or per-member batches ``[m, b, ...]``. This is where the collectives live:

* gradients (and the loss, accuracies, BatchNorm running statistics) are averaged over
  ``data``; a BatchNorm normalises with the whole batch's statistics only when the model
  itself reduces them over ``data`` (``nn.BatchNorm(axis_name=me.models.batch_axis())``,
  as the zoo's ResNet does): each device sees only its part of the batch;
* the ensemble prediction is the mean of the members' softmax: first over the local
  members, then ``lax.pmean`` over ``ensemble``;
* for a regression task (``cfg.task.kind == "regression"``) the ensemble is the uniform
  mixture of the members' Gaussians: its moments are ``pmean``-ed over ``ensemble``, its
  log density is a log-mean-exp (``pmax`` then ``psum`` of ``exp``) over ``ensemble``, its
  quantiles are bisected on the ``pmean``-ed CDF, and the CRPS's pairwise term passes the
  members round the ``ensemble`` ring (``ppermute``), so no device gathers all members.
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
from meshensemble.core.members import map_members as map_members
from meshensemble.core.mesh import DATA, ENSEMBLE
from meshensemble.core.ordering import ordered_after
from meshensemble.core.state import EnsembleState
from meshensemble.core.tasks import softmax_cross_entropy as softmax_cross_entropy
from meshensemble.numerics import gaussian, statmath
from meshensemble.numerics import sums as sums_lib

PyTree = Any
LossFn = Callable[[jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What the local step functions need besides arrays (static under ``jit``).

    Attributes:
      model: the model interface.
      tx: the optax optimizer of one member.
      loss_fn: per-example loss ``loss_fn(logits [b, C], labels [b]) -> [b]``.
      strategy: how the local members are computed, ``"vmap"`` or ``"loop"``.
      grad_mode: ``"vma"`` (shard_map with ``check_vma``: the loss is averaged over
        ``data`` inside the differentiated function, and the transposed collectives
        average the gradients) or ``"pmean"`` (pmap, or shard_map without ``check_vma``
        on a mesh whose ``data`` axis has size 1: ``pmean`` the gradients; collectives
        over an axis of size 1 are skipped, see :func:`reduce_over`).
      rng_impl: the ensemble's declared key implementation (``key_impl``), or None: the
        state's keys say theirs by their word count (:func:`meshensemble.core.keys.impl_for`).
      input_transform: applied to images on device before the model (e.g. uint8 to
        float); None for none.
      compute_dtype: mixed precision: the model computes with its floating parameters
        and inputs cast to this dtype (e.g. ``jnp.bfloat16``); the parameters, optimizer
        state and gradients stay in their own dtype (float32 master weights), and the
        logits are cast to float32 before the loss and the softmax. None: no casting.
      augment: ``fn(key, image) -> image``, one training example's augmentation, applied
        in each member's step after the input transform, with keys drawn for the whole
        global batch from the member's key and step (see :mod:`meshensemble.data.augment`:
        the same on any mesh, resume-exact); None for none.
      gather_axes: FSDP (``shard_members``): for each parameter leaf (flattening order)
        the dimension split over ``data``, or None; see :func:`gather_params`. None
        (the default): parameters are whole on every device.
      task: the task (:mod:`meshensemble.core.tasks`); None: classification.
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


def _member_step(cfg: StepConfig, state: EnsembleState, x: jax.Array, y: jax.Array):
    """One member's step on its local batch; ``state`` leaves have no member axis."""
    rng = forward.member_key(cfg, state.rng, state.step)
    x = forward.augmented(cfg, state, x)

    def loss_of(params):
        whole = gather_params(cfg, params)
        logits, new_model_state = forward.apply_model(cfg, whole, state.model_state, x, True, rng)
        loss = jnp.mean(cfg.loss_fn(logits, y))
        # Under check_vma, the gradient of data-invariant params is summed over `data`
        # by the transposed collectives; differentiating the data-mean gives the mean.
        objective = lax.pmean(loss, DATA) if cfg.grad_mode == "vma" else loss
        return objective, (loss, logits, new_model_state)

    (_, (loss, logits, new_model_state)), grads = jax.value_and_grad(loss_of, has_aux=True)(
        state.params
    )
    if cfg.grad_mode == "pmean":
        grads = reduce_over(cfg, lax.pmean, grads, DATA)
    new_model_state = reduce_over(cfg, lax.pmean, new_model_state, DATA)
    probs = jax.nn.softmax(logits.astype(jnp.float32))
    accuracy = jnp.mean(jnp.argmax(logits, -1) == y)
    loss, accuracy = reduce_over(cfg, lax.pmean, (loss, accuracy), DATA)
    updates, opt_state = cfg.tx.update(grads, state.opt_state, state.params)
    updates = ordered_after((grads, loss, probs, accuracy), updates)
    params = optax.apply_updates(state.params, updates)
    new_state = state.replace(
        step=state.step + 1, params=params, opt_state=opt_state, model_state=new_model_state
    )
    return new_state, loss, accuracy, probs


def train_step(
    cfg: StepConfig, state: EnsembleState, images: jax.Array, labels: jax.Array
) -> tuple[EnsembleState, dict[str, jax.Array]]:
    """One step of every local member.

    Args:
      cfg: the static configuration.
      state: local state, leaves ``[m, ...]``.
      images: ``[b, ...]`` (shared by all members) or ``[m, b, ...]`` (per member).
      labels: ``[b]`` or ``[m, b]`` integers.

    Returns:
      ``(state, metrics)``: ``metrics["loss"]``, ``metrics["accuracy"]`` are ``[m]``
      (averaged over ``data``); ``metrics["ensemble_accuracy"]`` and
      ``metrics["ensemble_nll"]`` are scalars from the members' softmax averaged over
      all members (NaN for per-member batches, where members see different examples).
      A regression task returns :func:`regression_train_step`'s metrics instead.
    """
    if is_regression(cfg):
        return regression_train_step(cfg, state, images, labels)
    per_member = labels.ndim == 2
    axes = (0, 0 if per_member else None, 0 if per_member else None)
    x = forward.prepare(cfg, images)
    fn = lambda s, xb, yb: _member_step(cfg, s, xb, yb)
    state, loss, accuracy, probs = map_members(fn, cfg.strategy, axes, state, x, labels)
    metrics = {"loss": loss, "accuracy": accuracy}
    if per_member:
        nan = jnp.full((), jnp.nan, jnp.float32)
        metrics.update(ensemble_accuracy=nan, ensemble_nll=nan)
    else:
        # The ensemble's all-reduce after the updates: the devices meet once, at the end
        # of the step, not also midway (on 8 CPU devices sharing 2 cores, each meeting
        # idles cores while the last device catches up: ~1% of the user CNN's step).
        probs = ordered_after(state.params, probs)
        ens_probs = reduce_over(cfg, lax.pmean, jnp.mean(probs, axis=0), ENSEMBLE)
        accuracy = jnp.mean(jnp.argmax(ens_probs, -1) == labels)
        nll = jnp.mean(_nll(ens_probs, labels))
        accuracy, nll = reduce_over(cfg, lax.pmean, (accuracy, nll), DATA)
        metrics.update(ensemble_accuracy=accuracy, ensemble_nll=nll)
    return state, metrics


def _nll(probs: jax.Array, labels: jax.Array) -> jax.Array:
    p = jnp.take_along_axis(probs, labels[:, None], axis=-1)[:, 0]
    return -jnp.log(jnp.maximum(p, jnp.finfo(probs.dtype).tiny))


def member_logits(cfg: StepConfig, state: EnsembleState, images: jax.Array) -> jax.Array:
    """The logits of every local member in inference mode.

    Args:
      cfg: the static configuration.
      state: local state, leaves ``[m, ...]`` (with FSDP, gathered over ``data`` here).
      images: ``[b, ...]``.

    Returns:
      ``[m, b, classes]`` float32 logits.
    """
    x = forward.prepare(cfg, images)

    def one(s: EnsembleState, xb: jax.Array) -> jax.Array:
        logits, _ = forward.apply_model(
            cfg, gather_params(cfg, s.params), s.model_state, xb, False, s.rng
        )
        return logits.astype(jnp.float32)

    return map_members(one, cfg.strategy, (0, None), state, x)


def member_probs(cfg: StepConfig, state: EnsembleState, images: jax.Array) -> jax.Array:
    """Softmax of every local member in inference mode (of :func:`member_logits`).

    Args:
      cfg: the static configuration.
      state: local state, leaves ``[m, ...]``.
      images: ``[b, ...]``.

    Returns:
      ``[m, b, classes]`` float32 probabilities.
    """
    return jax.nn.softmax(member_logits(cfg, state, images))


def ensemble_probs(cfg: StepConfig, state: EnsembleState, images: jax.Array) -> jax.Array:
    """The ensemble's prediction: mean over local members, then ``pmean`` over ``ensemble``.

    Returns:
      ``[b, classes]`` probabilities.
    """
    return reduce_over(cfg, lax.pmean, jnp.mean(member_probs(cfg, state, images), axis=0), ENSEMBLE)


def prediction_summaries(
    cfg: StepConfig, with_members: bool, state: EnsembleState, images: jax.Array
) -> dict[str, jax.Array]:
    """The ensemble's prediction and the members' mean entropy, from one forward pass.

    Each device averages its local members' softmax and entropies, then ``pmean`` over
    ``ensemble`` (the ``probs`` of :func:`ensemble_probs`); the mutual information is
    ``entropy(probs) - expected_entropy``.

    Args:
      cfg: the static configuration.
      with_members: also return the local members' softmax.
      state: local state, leaves ``[m, ...]``.
      images: ``[b, ...]``.

    Returns:
      ``{"probs": [b, classes], "expected_entropy": [b]}`` (the same on every device of
      an ``ensemble`` group), with ``with_members`` also ``"member_probs": [m, b, classes]``.
    """
    probs = member_probs(cfg, state, images)
    local = {
        "probs": jnp.mean(probs, axis=0),
        "expected_entropy": jnp.mean(sums_lib.shannon_entropy(probs), axis=0),
    }
    out = reduce_over(cfg, lax.pmean, local, ENSEMBLE)
    if with_members:
        out["member_probs"] = probs
    return out


def eval_stats(
    cfg: StepConfig,
    num_bins: int,
    state: EnsembleState,
    images: jax.Array,
    labels: jax.Array,
    mask: jax.Array,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """Sums of evaluation statistics over this batch, reduced on the mesh.

    The members' softmax never leaves the devices: each device computes
    :func:`meshensemble.numerics.sums.member_summaries` of its members and reduces them over
    ``ensemble`` (``pmean`` of the mean softmax and of the mean clipped log-softmax,
    ``psum`` of the per-class argmax counts), then
    :func:`meshensemble.numerics.sums.streaming_stats` for its members on its part of the
    batch; the sums are ``psum``-ed over ``data``. ``member_*`` sums stay split over
    ``ensemble`` (``[m, ...]``); the ensemble's sums (pairwise ones included) use only the
    reduced summaries and so are the same on every device. Per example, only the
    ensemble's confidence, correctness and the mask leave (for the adaptive ECE).

    Args:
      cfg: the static configuration.
      num_bins: calibration bins.
      state: local state.
      images: ``[b, ...]``; labels ``[b]``; mask ``[b]`` (0 for padding).

    Returns:
      ``(sums, examples)``: the dict of :func:`meshensemble.numerics.sums.streaming_stats`,
      summed over ``data``, and the dict of :func:`meshensemble.numerics.sums.example_stats`
      of this device's ``[b]`` examples (split over ``data``, not summed).
    """
    probs = member_probs(cfg, state, images)
    local = sums_lib.member_summaries(probs)
    ens = reduce_over(cfg, lax.pmean, local["probs"], ENSEMBLE)
    votes = reduce_over(cfg, lax.psum, local["votes"], ENSEMBLE)
    log_probs = reduce_over(cfg, lax.pmean, local["log_probs"], ENSEMBLE)
    mask = mask.astype(jnp.float32)
    sums = sums_lib.streaming_stats(
        probs,
        ens,
        labels,
        mask,
        num_bins,
        ensemble_votes=votes,
        ensemble_log_probs=log_probs,
    )
    return reduce_over(cfg, lax.psum, sums, DATA), sums_lib.example_stats(ens, labels, mask)


def ood_stats(
    cfg: StepConfig,
    num_bins: int,
    state: EnsembleState,
    images: jax.Array,
    labels: jax.Array,
    mask: jax.Array,
) -> dict[str, Any]:
    """Per-example OOD scores and reliability-diagram bin sums of this batch, on the mesh.

    Each device takes :func:`meshensemble.numerics.statmath.logit_summaries` of its local
    members' logits and ``pmean`` s them over ``ensemble``; the ensemble's scores
    (:data:`~meshensemble.numerics.statmath.OOD_SCORE_KINDS`) follow from those means, each
    member's own scores (``MEMBER_OOD_KINDS``) from its logits alone. The bin sums of
    the ensemble's prediction are ``psum`` -ed over ``data``; the members' are summed over
    all members too (``psum`` over ``ensemble``: the pooled "mean member" curve).

    Args:
      cfg, num_bins, state: the static configuration, the bins, the local state.
      images: ``[b, ...]``; labels ``[b]`` (any integers if none); mask ``[b]`` (0: padding).

    Returns:
      ``scores`` ``[kinds, b]`` (split over ``data``), ``member_scores`` ``[kinds, m, b]``
      (members over ``ensemble``), and ``ensemble`` / ``member``: dicts of
      ``statmath.OOD_BIN_KEYS``, ``[num_bins]`` each (replicated).
    """
    z = member_logits(cfg, state, images)
    pooled = reduce_over(cfg, lax.pmean, statmath.logit_summaries(z), ENSEMBLE)
    alone = jax.vmap(lambda zm: statmath.logit_summaries(zm[None]))(z)  # [m, b, ...] each
    w = mask.astype(jnp.float32)

    def bins(probs: jax.Array) -> dict[str, jax.Array]:  # [..., b, C] -> [..., num_bins]
        ex = statmath.per_example(probs, labels, num_bins)
        sums = statmath.bin_sums(ex["conf"], ex["correct"], ex["bin"], w, num_bins)
        return dict(zip(statmath.OOD_BIN_KEYS, sums))

    member_bins = jax.tree.map(lambda v: jnp.sum(v, axis=0), bins(jax.nn.softmax(z, axis=-1)))
    member_bins = reduce_over(cfg, lax.psum, member_bins, ENSEMBLE)
    return {
        "scores": jnp.stack([statmath.ood_score_of(k, pooled) for k in statmath.OOD_SCORE_KINDS]),
        "member_scores": jnp.stack(
            [statmath.ood_score_of(k, alone) for k in statmath.MEMBER_OOD_KINDS]
        ),
        "ensemble": reduce_over(cfg, lax.psum, bins(pooled["probs"]), DATA),
        "member": reduce_over(cfg, lax.psum, member_bins, DATA),
    }


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


# ------------------------------------------------------------------ regression
def is_regression(cfg: StepConfig) -> bool:
    """Whether ``cfg``'s task is a regression (its members predict Gaussians)."""
    return getattr(cfg.task, "kind", "classification") == "regression"


def _regression_member_step(cfg: StepConfig, state: EnsembleState, x: jax.Array, y: jax.Array):
    """One regression member's step on its local batch (Gaussian NLL, ``cfg.loss_fn``)."""
    rng = forward.member_key(cfg, state.rng, state.step)
    x = forward.augmented(cfg, state, x)

    def loss_of(params):
        whole = gather_params(cfg, params)
        out, new_model_state = forward.apply_model(cfg, whole, state.model_state, x, True, rng)
        loss = jnp.mean(cfg.loss_fn(out, y))
        objective = lax.pmean(loss, DATA) if cfg.grad_mode == "vma" else loss
        return objective, (loss, out, new_model_state)

    (_, (loss, out, new_model_state)), grads = jax.value_and_grad(loss_of, has_aux=True)(
        state.params
    )
    if cfg.grad_mode == "pmean":
        grads = reduce_over(cfg, lax.pmean, grads, DATA)
    new_model_state = reduce_over(cfg, lax.pmean, new_model_state, DATA)
    mean, variance = cfg.task.moments(out)
    loss, sq = reduce_over(cfg, lax.pmean, (loss, jnp.mean((mean - y) ** 2)), DATA)
    updates, opt_state = cfg.tx.update(grads, state.opt_state, state.params)
    updates = ordered_after((grads, loss, sq, mean, variance), updates)
    params = optax.apply_updates(state.params, updates)
    new_state = state.replace(
        step=state.step + 1, params=params, opt_state=opt_state, model_state=new_model_state
    )
    return new_state, loss, jnp.sqrt(sq), (mean, variance)


def regression_train_step(
    cfg: StepConfig, state: EnsembleState, x: jax.Array, y: jax.Array
) -> tuple[EnsembleState, dict[str, jax.Array]]:
    """One step of every local regression member.

    Args:
      cfg: the static configuration (a regression task).
      state: local state, leaves ``[m, ...]``.
      x: ``[b, ...]`` (shared) or ``[m, b, ...]`` (per member).
      y: float targets ``[b, T]`` or ``[m, b, T]``.

    Returns:
      ``(state, metrics)``: ``loss`` (Gaussian NLL) and ``rmse`` (of the member's mean)
      ``[m]``, averaged over ``data``; ``ensemble_nll`` (the mixture's, by
      :func:`mixture_log_density`) and ``ensemble_rmse`` (of the mixture's mean) scalars
      (NaN for per-member batches).
    """
    axes = (0, 0, 0) if y.ndim == 3 else (0, None, None)
    fn = lambda s, xb, yb: _regression_member_step(cfg, s, xb, yb)
    state, loss, rmse, moments = map_members(
        fn, cfg.strategy, axes, state, forward.prepare(cfg, x), y
    )
    metrics = {"loss": loss, "rmse": rmse}
    if y.ndim == 3:  # per-member batches: no ensemble over different examples
        nan = jnp.full((), jnp.nan, jnp.float32)
        return state, metrics | {"ensemble_nll": nan, "ensemble_rmse": nan}
    (mean, variance), y = ordered_after(state.params, moments), y.astype(jnp.float32)
    nll = -jnp.mean(mixture_log_density(cfg, mean, variance, y))
    mixture_mean = reduce_over(cfg, lax.pmean, jnp.mean(mean, axis=0), ENSEMBLE)
    nll, sq = reduce_over(cfg, lax.pmean, (nll, jnp.mean((mixture_mean - y) ** 2)), DATA)
    metrics.update(ensemble_nll=nll, ensemble_rmse=jnp.sqrt(sq))
    return state, metrics


def member_moments(cfg: StepConfig, state: EnsembleState, x: jax.Array) -> dict[str, jax.Array]:
    """Each local regression member's Gaussian: ``{"mean", "variance"}``, ``[m, b, T]``."""
    mean, variance = cfg.task.moments(member_logits(cfg, state, x))
    return {"mean": mean, "variance": variance}


def _mixture_moments(cfg: StepConfig, mean: jax.Array, variance: jax.Array) -> dict[str, jax.Array]:
    mu = reduce_over(cfg, lax.pmean, jnp.mean(mean, axis=0), ENSEMBLE)
    aleatoric = reduce_over(cfg, lax.pmean, jnp.mean(variance, axis=0), ENSEMBLE)
    epistemic = reduce_over(cfg, lax.pmean, jnp.mean((mean - mu[None]) ** 2, axis=0), ENSEMBLE)
    return {"mean": mu, "variance": aleatoric + epistemic, "aleatoric": aleatoric,
            "epistemic": epistemic}  # fmt: skip


def mixture_moments(cfg: StepConfig, state: EnsembleState, x: jax.Array) -> dict[str, jax.Array]:
    """The mixture's moments, ``pmean`` over ``ensemble`` (no device gathers the members).

    ``mean = E_m[mu_m]``; ``aleatoric = E_m[var_m]``; ``epistemic = E_m[(mu_m - mean)^2]``
    (the members' mean around the mixture mean, the second ``pmean`` after the first, not
    ``E[mu^2] - mean^2``, which cancels catastrophically in float32); ``variance =
    aleatoric + epistemic``, equal to ``E_m[var_m + mu_m^2] - mean^2``.

    Returns:
      ``{"mean", "variance", "aleatoric", "epistemic"}``, each ``[b, T]``.
    """
    m = member_moments(cfg, state, x)
    return _mixture_moments(cfg, m["mean"], m["variance"])


def mixture_log_density(
    cfg: StepConfig, mean: jax.Array, variance: jax.Array, y: jax.Array
) -> jax.Array:
    """``log (1/M sum_m N(y; mu_m, var_m))`` by a stable log-mean-exp over ``ensemble``.

    The largest member log density (``pmax`` over ``ensemble``, held constant for the
    gradient) is taken out before ``exp``; the rest is ``psum``-ed over ``ensemble``.

    Args:
      cfg: the static configuration.
      mean, variance: local members' ``[m, b, T]``.
      y: ``[b, T]``.

    Returns:
      ``[b, T]`` log densities of the mixture, the same on every ``ensemble`` device.
    """
    log_p = gaussian.log_density(mean, variance, y[None])
    top = lax.stop_gradient(reduce_over(cfg, lax.pmax, jnp.max(log_p, axis=0), ENSEMBLE))
    total = reduce_over(cfg, lax.psum, jnp.sum(jnp.exp(log_p - top[None]), axis=0), ENSEMBLE)
    return top + jnp.log(total) - jnp.log(float(mean.shape[0] * lax.axis_size(ENSEMBLE)))


def mixture_quantiles(
    cfg: StepConfig, mean: jax.Array, variance: jax.Array, levels: tuple[float, ...]
) -> jax.Array:
    """The mixture's quantiles by bisection on its CDF (``pmean`` of the members' CDFs).

    The bracket is every member's ``mu +/- 10 sigma`` (``pmin`` / ``pmax`` over
    ``ensemble``); :data:`~meshensemble.numerics.gaussian.BISECTION_STEPS` halvings follow.
    Returns ``[b, T, len(levels)]`` quantiles.
    """
    sd = jnp.sqrt(variance)
    lo = reduce_over(cfg, lax.pmin, jnp.min(mean - gaussian.BRACKET_SDS * sd, 0), ENSEMBLE)
    hi = reduce_over(cfg, lax.pmax, jnp.max(mean + gaussian.BRACKET_SDS * sd, 0), ENSEMBLE)
    p = jnp.asarray(levels, jnp.float32)
    lo, hi = (jnp.broadcast_to(v[..., None], (*v.shape, p.size)) for v in (lo, hi))

    def halve(_, bracket):
        lo, hi = bracket
        mid = 0.5 * (lo + hi)
        local = jnp.mean(gaussian.cdf(mean[..., None], variance[..., None], mid[None]), axis=0)
        below = reduce_over(cfg, lax.pmean, local, ENSEMBLE) < p[None, None]
        return jnp.where(below, mid, lo), jnp.where(below, hi, mid)

    lo, hi = lax.fori_loop(0, gaussian.BISECTION_STEPS, halve, (lo, hi))
    return 0.5 * (lo + hi)


def mixture_pair_term(cfg: StepConfig, mean: jax.Array, variance: jax.Array) -> jax.Array:
    """``E|X - X'|`` of the mixture: ``1/M^2 sum_{i,j} E|X_i - X_j|``, members passed round.

    Each device pairs its members with every ``ensemble`` device's in turn, the visiting
    members moving one step round the ring (``ppermute``) each time; the pair sums are
    ``psum``-ed over ``ensemble``. Returns ``[b, T]``.
    """
    e, own = lax.axis_size(ENSEMBLE), (mean, variance)
    total, visiting, ring = (
        gaussian.pair_abs_sum(own, own),
        own,
        [(i, (i + 1) % e) for i in range(e)],
    )
    for _ in range(e - 1):
        visiting = lax.ppermute(visiting, ENSEMBLE, ring)
        total = total + gaussian.pair_abs_sum(own, visiting)
    total = reduce_over(cfg, lax.psum, total, ENSEMBLE)
    return total / float(mean.shape[0] * e) ** 2


def regression_eval_stats(
    cfg: StepConfig, state: EnsembleState, x: jax.Array, y: jax.Array, mask: jax.Array
) -> dict[str, jax.Array]:
    """Sums of the regression scores over this batch, reduced on the mesh.

    Per example and target: the mixture's log density (:func:`mixture_log_density`), its
    mean's squared and absolute errors, its CRPS ``E|X - y| - E|X - X'| / 2`` (closed form
    for Gaussian mixtures, the pair term by :func:`mixture_pair_term`), whether ``y`` lies
    in its central 50/90/95% intervals and their widths (:func:`mixture_quantiles`), and
    whether its PIT ``F(y)`` is below each calibration level. Masked (padding 0), summed
    over the batch, then ``psum`` over ``data``.

    Returns:
      The dict of :data:`~meshensemble.numerics.gaussian.SUM_KEYS` (replicated).
    """
    m = member_moments(cfg, state, x)
    mean, variance, y = m["mean"], m["variance"], y.astype(jnp.float32)
    mix = _mixture_moments(cfg, mean, variance)
    w = mask.astype(jnp.float32)[:, None]
    cdf_y = reduce_over(
        cfg, lax.pmean, jnp.mean(gaussian.cdf(mean, variance, y[None]), 0), ENSEMBLE
    )
    to_y = reduce_over(
        cfg, lax.pmean, jnp.mean(gaussian.abs_moment(y[None] - mean, variance), 0), ENSEMBLE
    )
    crps = to_y - 0.5 * mixture_pair_term(cfg, mean, variance)
    q = mixture_quantiles(cfg, mean, variance, gaussian.QUANTILE_LEVELS)
    lo, hi = q[..., 0::2], q[..., 1::2]
    inside = ((lo <= y[..., None]) & (y[..., None] <= hi)).astype(jnp.float32)
    below = (cdf_y[..., None] <= jnp.asarray(gaussian.CALIBRATION_LEVELS)[None, None]).astype(
        jnp.float32
    )
    total = lambda v: jnp.sum(v * w, axis=(0, 1))
    wide = lambda v: jnp.sum(v * w[..., None], axis=(0, 1))
    sums = {
        "count": jnp.sum(w) * y.shape[-1],
        "nll": -total(mixture_log_density(cfg, mean, variance, y)),
        "squared_error": total((mix["mean"] - y) ** 2),
        "absolute_error": total(jnp.abs(mix["mean"] - y)),
        "crps": total(crps),
        "variance": total(mix["variance"]),
        "aleatoric": total(mix["aleatoric"]),
        "epistemic": total(mix["epistemic"]),
        "covered": wide(inside),
        "width": wide(hi - lo),
        "pit_below": wide(below),
    }
    return reduce_over(cfg, lax.psum, sums, DATA)
