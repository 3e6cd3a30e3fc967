"""One member's forward pass on its device: keys, augmentation, input transform, dtype.

The per-device steps (:mod:`meshensemble.core.steps`) call these on a member's local view
(leaves without the member axis) inside ``jax.shard_map`` or ``jax.pmap``; nothing here
communicates between devices (the collectives are all in ``steps``). They read the mesh
axis ``data``'s index and size only to place this device's rows in the global batch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from meshensemble.core import keys
from meshensemble.core.mesh import DATA
from meshensemble.core.state import EnsembleState

PyTree = Any


def wrap_key(cfg: Any, raw: jax.Array) -> jax.Array:
    """A member's raw ``uint32`` key words as a key of the implementation they name.

    Args:
      cfg: the :class:`~meshensemble.core.steps.StepConfig` (its ``rng_impl``).
      raw: ``[words]`` key data.

    Returns:
      A typed key, or ``raw`` itself for the default implementation's legacy raw keys.

    Example:
      >>> k = wrap_key(ens.step_config(), jax.random.key_data(jax.random.key(0)))
    """
    impl = keys.impl_for(raw.shape[-1], cfg.rng_impl)  # from the state given, at trace time
    return raw if impl is None else jax.random.wrap_key_data(raw, impl=impl)


def member_key(cfg: Any, raw: jax.Array, step: jax.Array) -> jax.Array:
    """The key of a member's step on this ``data`` shard: ``fold_in(fold_in(k, step), shard)``.

    Args:
      cfg: the step configuration.
      raw: the member's key words; step: its step count (scalar).

    Returns:
      The key its model's stochastic layers (dropout) draw from in this step.
    """
    key = wrap_key(cfg, raw)
    return jax.random.fold_in(jax.random.fold_in(key, step), lax.axis_index(DATA))


def augmented(cfg: Any, state: EnsembleState, x: jax.Array) -> jax.Array:
    """``x`` (this data shard's rows) augmented as part of the global batch.

    Args:
      cfg: the step configuration (its ``augment``; None: ``x`` is returned).
      state: one member's state (its key and step).
      x: ``[b, ...]`` this device's rows of the batch.

    Returns:
      ``[b, ...]``: each row augmented with the key of its index in the global batch, so
      the result does not depend on how the batch is split over ``data``.
    """
    if cfg.augment is None:
        return x
    b = x.shape[0]
    start, total = lax.axis_index(DATA) * b, b * lax.axis_size(DATA)
    key = wrap_key(cfg, state.rng)
    return keys.augment_batch(cfg.augment, key, state.step, x, start, total)


def to_compute(cfg: Any, tree: PyTree) -> PyTree:
    """Casts the floating leaves of ``tree`` to ``cfg.compute_dtype`` (when set).

    Example:
      >>> to_compute(ens.step_config(), {"w": jnp.ones(2)})["w"].dtype  # no compute dtype
      dtype('float32')
    """
    if cfg.compute_dtype is None:
        return tree
    cast = lambda a: a.astype(cfg.compute_dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a
    return jax.tree.map(cast, tree)


def prepare(cfg: Any, images: jax.Array) -> jax.Array:
    """The images as the model takes them: ``cfg.input_transform``, then the compute dtype.

    Example:
      >>> prepare(ens.step_config(), images).dtype  # uint8 normalised to float32
      dtype('float32')
    """
    x = images if cfg.input_transform is None else cfg.input_transform(images)
    return to_compute(cfg, x)


def apply_model(
    cfg: Any, params: PyTree, model_state: PyTree, x: jax.Array, train: bool, rng: Any
) -> tuple[jax.Array, PyTree]:
    """The model in the compute dtype; float32 outputs, model state in its own dtypes.

    Args:
      cfg: the step configuration.
      params: one member's whole parameters (gathered, with FSDP).
      model_state: its model state (BatchNorm statistics), or an empty dict.
      x: ``[b, ...]`` prepared inputs; train: training mode; rng: the member's key.

    Returns:
      ``(outputs [b, classes], new_model_state)``.
    """
    out, new_model_state = cfg.model.apply(to_compute(cfg, params), model_state, x, train, rng)
    if cfg.compute_dtype is not None:
        out = out.astype(jnp.float32)
        new_model_state = jax.tree.map(lambda n, o: n.astype(o.dtype), new_model_state, model_state)
    return out, new_model_state
