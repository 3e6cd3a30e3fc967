"""The order in which an epoch visits the training examples: shuffles and bagging.

Everything is drawn on device from the run's order key, so the order is the same on any
mesh and after a resume:

* shared (``members=0``): one permutation ``[N]`` per epoch, from ``fold_in(key, epoch)``;
* per member: member ``i`` permutes with ``split(fold_in(key, epoch), members)[i]``;
* bootstrap (bagging, per member): member ``i`` trains on its bag, ``N`` indices drawn
  uniformly WITH replacement once per run (from ``split(fold_in(key, BAG_SALT),
  members)[i]``), visited each epoch in that epoch's per-member permutation, so about
  ``1 - 1/e ~ 63%`` of the examples are in a member's bag, some of them several times.

Example:
  >>> order = epoch_order(jax.random.key(0), 1, 600, members=8, bootstrap=True)  # [8, N]
  >>> order.shape
  (8, 600)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BAG_SALT = 0x62616721
"""Folded into the order key for the bags (epochs are folded in from 1, far below it)."""


def bags(order_key: jax.Array, n: int, members: int) -> jax.Array:
    """Each member's bootstrap resample of ``range(n)``: fixed for the whole run.

    Args:
      order_key: the run's order key.
      n: training examples.
      members: ensemble size.

    Returns:
      int32 ``[members, n]``, entries uniform in ``[0, n)``, drawn with replacement.

    Example:
      >>> bags(jax.random.key(0), 10, 2).shape
      (2, 10)
    """
    keys = jax.random.split(jax.random.fold_in(order_key, BAG_SALT), members)
    return jax.vmap(lambda k: jax.random.randint(k, (n,), 0, n, dtype=jnp.int32))(keys)


def epoch_order(
    order_key: jax.Array, epoch: jax.Array | int, n: int, members: int, bootstrap: bool = False
) -> jax.Array:
    """The order of the training examples in ``epoch`` (jit-able; ``epoch`` may be traced).

    Args:
      order_key: the run's order key.
      epoch: the epoch, from 1.
      n: training examples.
      members: 0 for one order shared by all members, else the ensemble size (one order
        per member).
      bootstrap: each member visits its bag (:func:`bags`) instead of ``range(n)``; needs
        ``members > 0``.

    Returns:
      int32 ``[n]`` (shared) or ``[members, n]`` (per member).

    Raises:
      ValueError: ``bootstrap`` with ``members=0``.

    Example:
      >>> epoch_order(jax.random.key(0), 1, 10, 0).shape
      (10,)
    """
    key = jax.random.fold_in(order_key, epoch)
    if not members:
        if bootstrap:
            raise ValueError("bootstrap=True needs per-member orders; pass members > 0")
        return jax.random.permutation(key, n)
    keys = jax.random.split(key, members)
    perms = jax.vmap(lambda kk: jax.random.permutation(kk, n))(keys)
    if not bootstrap:
        return perms
    return jnp.take_along_axis(bags(order_key, n, members), perms, axis=1)
