"""Ordering an optimizer's updates after what still reads the old state (in-place updates).

:func:`ordered_after` is used by the per-device steps of :mod:`meshensemble.core.steps`
(which re-exports it); it has no collective.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from meshensemble.core.mesh import varying_axes

PyTree = Any

__all__ = ["ordered_after"]


def ordered_after(done: PyTree, updates: PyTree) -> PyTree:
    """``updates``, unchanged, but computed only once every leaf of ``done`` is.

    A parameter's update needs only its own gradient, so XLA may order it before the
    step has finished reading the parameter (a layer's input gradient reads its weights;
    the metrics recompute the logits from the last bias). With the state donated, the old
    buffers are then still needed when the update would overwrite them, and XLA copies
    those parameters and optimizer leaves every step. Adding ``0 * isfinite(sum of one
    element of each leaf of done)`` (an exact zero, never NaN, that XLA does not fold
    away) makes every update wait, so the updates write in place.
    ``lax.optimization_barrier`` does not do this on CPU (XLA removes it before it
    inserts copies). On CPU this took the copies in the training loop's body from 17 to
    2 (one member per device) and from 6 to 2 (two, vmapped). Under ``shard_map``'s
    ``check_vma``, a leaf's zero comes from the leaves of ``done`` that vary over no more
    mesh axes than it does.

    Args:
      done: what the updates must wait for: the gradient and the step's metrics.
      updates: the optimizer's updates (or any pytree).

    Returns:
      ``updates`` with the same values (floating leaves ``u + 0.0``).

    Example:
      >>> grads, probs = {"w": jnp.ones(3)}, jnp.full((2,), 0.5)
      >>> updates = ordered_after((grads, probs), {"w": -0.1 * grads["w"]})
      >>> updates["w"]   # the same values, computed after grads and probs
      Array([-0.1, -0.1, -0.1], dtype=float32)
    """
    leaves = [v for v in jax.tree.leaves(done) if v.size]
    zeros: dict[frozenset, jax.Array | None] = {}

    def zero_for(vma: frozenset) -> jax.Array | None:
        if vma not in zeros:
            firsts = [jnp.ravel(v)[0].astype(jnp.float32) for v in leaves if varying_axes(v) <= vma]
            zeros[vma] = 0.0 * jnp.isfinite(sum(firsts)).astype(jnp.float32) if firsts else None
        return zeros[vma]

    def tie(u: jax.Array) -> jax.Array:
        if not jnp.issubdtype(u.dtype, jnp.floating):
            return u
        zero = zero_for(varying_axes(u))
        return u if zero is None else u + zero.astype(u.dtype)

    return jax.tree.map(tie, updates)
