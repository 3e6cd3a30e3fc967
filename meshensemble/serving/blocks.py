"""Per-example results that do not depend on the batch: a program run in fixed blocks of rows.

XLA chooses its matrix-product and convolution kernels, and the order in which they add
up, from the shapes of the call: the same image gets probabilities that differ in their
last bits between a batch of 1,000, of 7 and of 1 (up to 3.6e-7 on the README's 8-member
CNN, in every one of 1,000 test images). A decision on a threshold then depends on the
batch: 2-4% of APS sets differed at ``alpha = 0.1``, whose threshold sits within 1e-6 of 1
on that run, and summing the scores in float64 does not help (the probabilities differ
before any score is taken). :func:`in_blocks` runs a per-device function on blocks of
:data:`BLOCK_ROWS` rows, one after another (``lax.map``): every example is computed by the
same program of the same shape whatever the batch it came in, its position in it or its
neighbours, so its outputs are the same bits alone or in any batch (on one platform, mesh
and jaxlib; the pooled mean over ``ensemble`` still depends on the mesh).

Example:
  >>> fn = in_blocks(lambda state, x: {"twice": 2 * x}, rows=4)
  >>> fn(None, jnp.arange(8.0))["twice"].tolist()
  [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

BLOCK_ROWS = 32
"""Rows per device in one block of a predictor's program: a batch's rows per device are a
multiple of it (the padding repeats a row). The README's CNN on the project's 2-core CPU
(busy with other jobs) predicted 1,000 images in 2.7-3.8 s in blocks of 32, 2.0-2.8 s in
one batch and 6.1-7.3 s in blocks of 8; one image in about 120 ms (blocks of 128: 1,000
in 2.7-3.3 s, one in 500-570 ms)."""

MIN_BLOCKS = 2
"""Blocks one call runs at least (a lone block is run twice, so one example costs 64 rows
per device): XLA replaces a loop of one trip by its body, which it then compiles with the
code around it, and the tempered probabilities of one block came out 1 ulp apart from
those of the same rows in a loop."""


def in_blocks(
    per_device: Callable[..., Mapping[str, jax.Array]],
    rows: int = BLOCK_ROWS,
    axes: Mapping[str, int] | None = None,
) -> Callable[..., dict[str, jax.Array]]:
    """``per_device(state, x, *args)`` computed on blocks of ``rows`` rows of ``x``, then joined.

    Args:
      per_device: ``fn(state, x [b, ...], *args) -> {key: array or pytree of arrays}``,
        each array with the batch on axis 0 (or ``axes[key]``); rows must not interact
        (collectives over the mesh's other axes are fine: every device runs the same
        number of blocks); ``args`` are passed to every block whole.
      rows: the block's rows; ``b`` must be a multiple of it.
      axes: the batch axis of keys that do not have it first (e.g. ``{"member_probs": 1}``;
        a key's every array).

    Returns:
      ``fn(state, x [b, ...], *args)`` with the same outputs as ``per_device`` on the whole batch
      (up to float rounding), each row's bits independent of ``b`` and of the other rows.

    Raises:
      ValueError: (while tracing) ``b`` is not a multiple of ``rows``.

    Example:
      >>> fn = in_blocks(lambda s, x: {"sum": x.sum(-1), "m": {"x": x[None]}}, 2, axes={"m": 1})
      >>> out = fn(None, jnp.ones((4, 3)))
      >>> out["sum"].shape, out["m"]["x"].shape
      ((4,), (1, 4, 3))
    """
    axes = dict(axes or {})

    def blocked(state: Any, x: jax.Array, *args: Any) -> dict[str, jax.Array]:
        b = x.shape[0]
        if b % rows:
            raise ValueError(f"a batch of {b} rows per device is not a multiple of {rows}")
        n = b // rows
        blocks = x.reshape(n, rows, *x.shape[1:])
        if n < MIN_BLOCKS:  # a loop that runs once is inlined, and compiled otherwise
            blocks = jnp.concatenate([blocks] * MIN_BLOCKS)
        out = lax.map(lambda block: dict(per_device(state, block, *args)), blocks)

        def join(v: jax.Array, axis: int) -> jax.Array:  # [blocks, ..., rows, ...] -> [..., b, ...]
            v = jnp.moveaxis(v[:n], 0, axis)
            return v.reshape(*v.shape[:axis], b, *v.shape[axis + 2 :])

        return {
            key: jax.tree.map(functools.partial(join, axis=axes.get(key, 0)), tree)
            for key, tree in out.items()
        }

    return blocked
