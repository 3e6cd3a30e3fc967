"""A 2-D mesh run through the library's loop, ``me.training.train``.

``ensemble=4, data=2`` with 8 members: the members are split over ``ensemble`` (2 per
device) and every batch is split over ``data`` (each device of a row gets half of it).
Gradients are averaged over ``data`` every step; the ensemble's prediction averages the
members' softmax over ``ensemble``. :func:`describe_mesh` draws the layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

import meshensemble as me


def resolve_mesh(cfg: me.TrainConfig) -> jax.sharding.Mesh:
    """The mesh ``cfg.mesh`` names, built as ``me.training.train`` builds it."""
    return me.make_mesh(**me.parse_mesh(cfg.mesh))


def describe_mesh(mesh: jax.sharding.Mesh, members: int, batch_size: int) -> str:
    """A text drawing of the mesh: which device holds which members and batch part.

    Example (``ensemble=4, data=2``, 8 members, batch 128)::

        mesh ensemble=4 x data=2 on 8 cpu devices: 2 member(s)/device, batch 128 = 2 x 64
                      data 0    data 1
        ensemble 0    cpu:0     cpu:1     members 0-1
        ...
    """
    e, d = mesh.shape["ensemble"], mesh.shape["data"]
    per = me.members_per_device(mesh, members)
    platform = mesh.devices.flat[0].platform
    lines = [
        f"mesh ensemble={e} x data={d} on {e * d} {platform} devices: {per} member(s)/device, "
        f"batch {batch_size} = {d} x {batch_size // d}",
        (" " * 14 + "".join(f"{'data ' + str(j):<10}" for j in range(d))).rstrip(),
    ]
    for i in range(e):
        devs = "".join(f"{dev.platform + ':' + str(dev.id):<10}" for dev in mesh.devices[i])
        first, last = i * per, (i + 1) * per - 1
        who = f"member {first}" if per == 1 else f"members {first}-{last}"
        lines.append(f"{'ensemble ' + str(i):<14}{devs}{who}")
    return "\n".join(lines)


def train_and_evaluate(
    cfg: me.TrainConfig,
    dataset: me.data.Dataset | None = None,
    log: Callable[[str], Any] = print,
) -> me.TrainResult:
    """Shows the mesh, then trains with ``me.training.train`` (which prints the final table).

    Args:
      cfg: the run's config (see ``config.py``).
      dataset: data to use instead of loading ``cfg.dataset`` from ``cfg.source``.
      log: where the lines go.

    Returns:
      The library's ``me.TrainResult``; ``result.ensemble.mesh`` is the mesh used and
      ``cfg.workdir`` holds ``config.json``, ``metrics.jsonl`` and the plots.
    """
    cfg.validate()
    log(describe_mesh(resolve_mesh(cfg), cfg.members, cfg.batch_size))
    return me.training.train(cfg, dataset=dataset, echo=log)
