"""The layouts case: one ensemble on E x D x P meshes, with and without sharded members.

For each layout (``ensemble`` x ``data`` x ``model`` and whether ``shard_members`` is on)
the same ensemble (same members, optimizer and batch) is built, and measured:

* ``state_bytes``: the state's bytes on one device (its addressable shards there,
  summed: :func:`meshensemble.core.sharding.state_bytes_per_device`);
* ``compile_s``: lowering and compiling :meth:`meshensemble.Ensemble.train_step_fn`;
* ``step_s``: the median of ``steps`` timed calls of the compiled step (after one
  untimed call), with the interquartile range.

Run it with :func:`measure_layouts` (``docs/sharding.md`` shows the numbers on the
8-fake-device CPU VM); :func:`format_layouts` prints the table.

Example:
  >>> two = [(2, 2, 1, False), (2, 2, 1, True)]   # 2 members on ensemble=2 x data=2, FSDP off/on
  >>> rows = measure_layouts(me.models.MLP((8,)), two, members=2, steps=1)
  >>> print(format_layouts(rows))
  layout state/device x less compile s step ms
  ...
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

from meshensemble.bench.timing import stats
from meshensemble.core.ensemble import Ensemble
from meshensemble.core.mesh import make_mesh
from meshensemble.core.sharding import state_bytes_per_device

Layout = tuple[int, int, int, bool]

LAYOUTS: tuple[Layout, ...] = (
    (8, 1, 1, False),
    (2, 4, 1, False),
    (2, 4, 1, True),
    (2, 1, 4, False),
    (2, 2, 2, True),
)
"""``(ensemble, data, model, shard_members)`` of the default layouts (8 devices):
members whole on every device of a group (8x1, 2x4), FSDP over ``data`` (2x4 fsdp),
tensor parallelism only (2x1x4) and both (2x2x2 fsdp)."""

LAYOUT_MEMBERS = 8
"""Members of the ensemble ``meshensemble bench --layouts`` measures (``ensemble`` divides it)."""

LAYOUT_DEVICES = max(e * d * p for e, d, p, _ in LAYOUTS)
"""Devices the default layouts need."""


def layout_name(layout: Layout) -> str:
    """A short name such as ``"2x2x2 fsdp"``.

    Args:
      layout: ``(ensemble, data, model, shard_members)``.

    Returns:
      ``"ExDxP"`` plus ``" fsdp"`` when members are sharded over ``data``.

    Example:
      >>> layout_name((2, 4, 1, True))
      '2x4x1 fsdp'
    """
    e, d, p, shard = layout
    return f"{e}x{d}x{p}" + (" fsdp" if shard else "")


def measure_layout(
    model: Any,
    layout: Layout,
    members: int = 8,
    batch_size: int = 32,
    steps: int = 5,
    optimizer: optax.GradientTransformation | None = None,
    image_shape: Sequence[int] = (28, 28, 1),
    seed: int = 0,
) -> dict[str, Any]:
    """State bytes per device, compile time and step time of one layout.

    Args:
      model: a Flax Linen module (or anything :class:`meshensemble.Ensemble` takes).
      layout: ``(ensemble, data, model, shard_members)``; ``model=1`` makes a 2-axis mesh.
      members: ensemble size (a multiple of ``ensemble``).
      batch_size: global batch (a multiple of ``data``).
      steps: timed steps.
      optimizer: default ``optax.adam(1e-3)``.
      image_shape: one image's shape.
      seed: seeds the members and the batch.

    Returns:
      ``{"layout", "state_bytes", "compile_s", "step_s", "step_iqr_s", "loss"}``.

    Raises:
      ValueError: the layout needs more devices than exist, or does not fit ``members``
        / ``batch_size``.

    Example:
      >>> row = measure_layout(me.models.MLP((8,)), (2, 2, 1, True), members=2, steps=1)
      >>> row["layout"], row["state_bytes"]   # bytes of the state on one device
      ('2x2x1 fsdp', 38236)
    """
    e, d, p, shard = layout
    mesh = make_mesh(e, d, p if p > 1 else None, devices=jax.devices()[: e * d * p])
    rng = np.random.default_rng(seed)
    x = rng.random((batch_size, *image_shape), np.float32)
    y = rng.integers(0, 10, batch_size).astype(np.int32)
    tx = optimizer or optax.adam(1e-3)
    ens = Ensemble(model, tx, members, mesh, shard_members=shard, sample=x[:1])
    state = ens.init(jax.random.key(seed), x[:1])
    nbytes = state_bytes_per_device(state)
    x, y = ens.place(x), ens.place(y)
    t = time.perf_counter()
    step = ens.train_step_fn().lower(state, x, y).compile()
    compile_s = time.perf_counter() - t
    state, metrics = step(state, x, y)
    jax.block_until_ready(metrics)
    samples = []
    for _ in range(steps):
        t = time.perf_counter()
        state, metrics = step(state, x, y)
        jax.block_until_ready((state, metrics))
        samples.append(time.perf_counter() - t)
    return {
        "layout": layout_name(layout),
        "state_bytes": nbytes,
        "compile_s": compile_s,
        "step_s": statistics.median(samples),
        "step_iqr_s": stats(samples)["iqr"],
        "loss": float(np.mean(jax.device_get(metrics["loss"]))),
    }


def measure_layouts(
    model: Any, layouts: Sequence[Layout] = LAYOUTS, **kwargs: Any
) -> list[dict[str, Any]]:
    """:func:`measure_layout` for each layout (same ensemble, same batch).

    Args:
      model: the member model.
      layouts: default :data:`LAYOUTS` (8 devices).
      **kwargs: passed on (``members``, ``batch_size``, ``steps`` ...).

    Returns:
      One row per layout.

    Example:
      >>> two = [(2, 2, 1, False), (2, 2, 1, True)]
      >>> rows = measure_layouts(me.models.MLP((8,)), two, members=2, steps=1)
      >>> [r["layout"] for r in rows]
      ['2x2x1', '2x2x1 fsdp']
    """
    return [measure_layout(model, layout, **kwargs) for layout in layouts]


def format_layouts(rows: Sequence[dict[str, Any]]) -> str:
    """A text table of :func:`measure_layouts` rows, state bytes relative to the first.

    Args:
      rows: the rows.

    Returns:
      The table, one line per layout.

    Example:
      >>> rows = [{"layout": "2x2x1", "state_bytes": 4096, "compile_s": 0.5, "step_s": 0.002,
      ...          "step_iqr_s": 0.0001, "loss": 2.3}]
      >>> print(format_layouts(rows))
      layout         state/device  x less  compile s   step ms
      2x2x1                 4,096    1.00       0.50       2.0
    """
    base = rows[0]["state_bytes"] if rows else 1
    lines = [f"{'layout':<12} {'state/device':>14} {'x less':>7} {'compile s':>10} {'step ms':>9}"]
    for r in rows:
        lines.append(
            f"{r['layout']:<12} {r['state_bytes']:>14,} {base / r['state_bytes']:>7.2f} "
            f"{r['compile_s']:>10.2f} {1e3 * r['step_s']:>9.1f}"
        )
    return "\n".join(lines)
