"""The device mesh: axis names, mesh construction and the shardings users need.

The mesh has two named axes, and optionally a third:

* ``ensemble`` (outer): members are split over it. Members talk only when their
  predictions are averaged, so this axis may span hosts or slices.
* ``data`` (inner, fast interconnect): the batch is split over it and the
  gradients are all-reduced over it every step (with ``shard_members=True`` each
  member's parameters and optimizer state are split over it too: FSDP).
* ``model`` (innermost, only when ``make_mesh(model=P)`` asks for it): tensor
  parallelism inside a member, driven by the model's logical axis annotations
  (see :mod:`meshensemble.core.sharding` and ``docs/sharding.md``).

The Flax HOWTO "Ensembling on multiple devices" is the mesh ``ensemble=N, data=1``;
data-parallel training of one model is ``ensemble=1, data=N``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

ENSEMBLE = "ensemble"
"""Name of the mesh axis that members are split over."""
DATA = "data"
"""Name of the mesh axis that the batch is split over."""
MODEL = "model"
"""Name of the optional third mesh axis: tensor parallelism inside a member."""
AXES = (ENSEMBLE, DATA)
"""Mesh axis names, outer to inner (a mesh with a ``model`` axis has ``AXES + (MODEL,)``)."""

# Partition specs, built from the axis names in one place.
MEMBERS = P(ENSEMBLE)
"""Spec of stacked member leaves ``[members, ...]``: split over ``ensemble``."""
BATCH = P(DATA)
"""Spec of a batch ``[N, ...]``: split over ``data``, copied over ``ensemble``."""
MEMBER_BATCH = P(ENSEMBLE, DATA)
"""Spec of per-member batches ``[members, N, ...]``."""
REPLICATED = P()
"""Spec of a value every device holds whole."""


def make_mesh(
    ensemble: int | None = None,
    data: int = 1,
    model: int | None = None,
    *,
    devices: Sequence[jax.Device] | None = None,
    axis_types: str | AxisType | tuple[AxisType, AxisType] = "explicit",
) -> Mesh:
    """Builds a ``jax.sharding.Mesh`` with axes ``("ensemble", "data")`` (and ``"model"``).

    ``data`` is the inner axis: devices that share a ``data`` group are neighbours in
    the device order (the same host, the fastest links), because gradients are
    all-reduced over ``data`` every step while ``ensemble`` talks only to average
    predictions. A ``model`` axis, when asked for, is innermost (tensor parallelism
    talks inside every layer) and always of type ``Auto``: the steps are manual over
    ``ensemble`` and ``data`` and leave ``model`` to the compiler.

    Args:
      ensemble: size of the ``ensemble`` axis. Default: all devices not used by
        ``data`` and ``model``.
      data: size of the ``data`` axis. Default 1.
      model: size of the ``model`` axis; None (default) makes a 2-axis mesh.
      devices: the devices to use, in order. Default: ``jax.devices()`` (all processes).
      axis_types: ``"explicit"`` (the default of ``jax.make_mesh``), ``"auto"``, a
        ``jax.sharding.AxisType`` or a pair of them, for ``ensemble`` and ``data``.

    Returns:
      A ``Mesh`` of shape ``{"ensemble": ensemble, "data": data}``, or with
      ``"model": model`` appended.

    Raises:
      ValueError: a size is not a positive whole number, the mesh needs more devices
        than exist, or the device count is not divisible by ``data``.

    Example:
      >>> mesh = me.make_mesh(ensemble=4, data=2)
      >>> dict(mesh.shape)
      {'ensemble': 4, 'data': 2}
      >>> dict(me.make_mesh(ensemble=2, data=2, model=2).shape)
      {'ensemble': 2, 'data': 2, 'model': 2}
    """
    devs = list(jax.devices() if devices is None else devices)
    _check_size("data", data)
    if model is not None:
        _check_size("model", model)
    inner = data * (model or 1)
    if ensemble is None:
        if len(devs) % inner:
            raise ValueError(
                f"data={data} x model={model or 1} does not divide the {len(devs)} devices; "
                f"pass ensemble= explicitly or pick sizes from the divisors of {len(devs)}"
            )
        ensemble = len(devs) // inner
    _check_size("ensemble", ensemble)
    need = ensemble * inner
    if need > len(devs):
        raise ValueError(
            f"mesh ensemble={ensemble} x data={data} x model={model or 1} needs {need} "
            f"devices but only {len(devs)} exist; use a smaller mesh (or more fake CPU "
            f"devices: me.use_fake_cpu_devices({need}) before JAX starts)"
        )
    types = _axis_types(axis_types)
    if model is not None:
        grid = np.asarray(devs[:need], dtype=object).reshape(ensemble, data, model)
        return Mesh(grid, (*AXES, MODEL), axis_types=(*types, AxisType.Auto))
    slices = len({getattr(d, "slice_index", 0) for d in devs[:need]})
    if slices > 1 and ensemble % slices == 0:
        # Multi-slice (TPU pods over DCN): `ensemble` spans slices, `data` stays in one.
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_hybrid_device_mesh(
            (ensemble // slices, data), (slices, 1), devs[:need]
        )
        return Mesh(grid, AXES, axis_types=types)
    if devices is None and need == len(devs):
        # Devices come in process order, so each `data` group stays inside one host
        # whenever `data` divides the devices per host.
        return jax.make_mesh((ensemble, data), AXES, axis_types=types)
    grid = np.asarray(devs[:need], dtype=object).reshape(ensemble, data)
    return Mesh(grid, AXES, axis_types=types)


def _check_size(name: str, value: object) -> None:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} is not a positive whole number; give e.g. {name}=1")


def _axis_types(axis_types: str | AxisType | tuple[AxisType, ...]) -> tuple[AxisType, ...]:
    if isinstance(axis_types, tuple):
        if len(axis_types) != 2:
            raise ValueError(f"axis_types={axis_types!r} needs one type per axis {AXES}")
        return axis_types
    if isinstance(axis_types, AxisType):
        return (axis_types, axis_types)
    table = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}
    if axis_types not in table:
        raise ValueError(f"axis_types={axis_types!r} is unknown; use 'explicit' or 'auto'")
    return (table[axis_types],) * 2


def parse_mesh(spec: str) -> dict[str, int]:
    """Parses a mesh description such as ``"ensemble=4,data=2"``.

    Args:
      spec: comma-separated ``axis=size`` pairs over the axes ``ensemble``, ``data``
        and ``model``; a missing axis is left out of the result.

    Returns:
      A dict such as ``{"ensemble": 4, "data": 2}``, ready for ``make_mesh(**d)``.

    Raises:
      ValueError: an unknown axis, a repeated axis or a size that is not a positive integer.

    Example:
      >>> me.parse_mesh("ensemble=4,data=2")
      {'ensemble': 4, 'data': 2}
    """
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in (*AXES, MODEL) or name in out:
            raise ValueError(
                f"mesh {spec!r}: bad part {part!r}; write e.g. 'ensemble=4,data=2' "
                f"(axes {', '.join((*AXES, MODEL))}, each once)"
            )
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1:
            raise ValueError(f"mesh {spec!r}: {name}={value.strip()!r} is not a positive integer")
        out[name] = size
    return out


def describe_mesh(mesh: Mesh) -> str:
    """The mesh's three axes, ``model=1`` included when the mesh has no ``model`` axis.

    Args:
      mesh: an ensemble mesh (with or without a ``model`` axis).

    Returns:
      ``"ensemble=E x data=D x model=M"``.

    Example:
      >>> describe_mesh(me.make_mesh(ensemble=2, data=4))
      'ensemble=2 x data=4 x model=1'
    """
    sizes = (mesh.shape[ENSEMBLE], mesh.shape[DATA], mesh.shape.get(MODEL, 1))
    return " x ".join(f"{name}={n}" for name, n in zip((*AXES, MODEL), sizes))


def idle_devices(mesh: Mesh) -> int:
    """How many of the runtime's devices (every process's) the mesh leaves unused.

    Args:
      mesh: an ensemble mesh.

    Returns:
      ``jax.device_count() - mesh.devices.size`` (0 when the mesh uses them all).

    Example:
      >>> idle_devices(me.make_mesh(ensemble=2, data=1))  # on 8 devices
      6
    """
    return max(jax.device_count() - int(mesh.devices.size), 0)


def members_per_device(mesh: Mesh, num_members: int) -> int:
    """Number of members each device holds: ``num_members / mesh.shape["ensemble"]``.

    Args:
      mesh: a mesh with an ``ensemble`` axis.
      num_members: total members.

    Returns:
      The positive whole number of members per device.

    Raises:
      ValueError: ``num_members`` is not a positive multiple of the ``ensemble`` axis.

    Example:
      >>> me.members_per_device(me.make_mesh(ensemble=4, data=2), 8)
      2
    """
    e = mesh.shape[ENSEMBLE]
    if (
        not isinstance(num_members, int | np.integer)
        or isinstance(num_members, bool)
        or num_members < 1
        or num_members % e
    ):
        raise ValueError(
            f"num_members={num_members!r} is not a positive multiple of the mesh's "
            f"ensemble axis ({e}); use num_members={e}, {2 * e}, ... or a mesh with "
            f"ensemble dividing {num_members}"
        )
    return int(num_members) // e


def member_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of stacked member leaves ``[members, ...]``: split over ``ensemble``.

    Args:
      mesh: the ensemble mesh.

    Returns:
      ``NamedSharding(mesh, P("ensemble"))``.

    Example:
      >>> me.member_sharding(me.make_mesh()).spec
      P('ensemble',)
    """
    return NamedSharding(mesh, MEMBERS)


def batch_sharding(mesh: Mesh, per_member: bool = False) -> NamedSharding:
    """Sharding of a batch: split over ``data`` (and over ``ensemble`` when per member).

    Args:
      mesh: the ensemble mesh.
      per_member: True for per-member batches ``[members, B, ...]``.

    Returns:
      ``NamedSharding(mesh, P("data"))`` for ``[B, ...]``, or
      ``NamedSharding(mesh, P("ensemble", "data"))`` for ``[members, B, ...]``.

    Example:
      >>> me.batch_sharding(me.make_mesh()).spec
      P('data',)
    """
    return NamedSharding(mesh, MEMBER_BATCH if per_member else BATCH)


def replicated_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a value copied whole to every device of ``mesh``.

    Args:
      mesh: the ensemble mesh.

    Returns:
      ``NamedSharding(mesh, P())``.

    Example:
      >>> me.replicated_sharding(me.make_mesh()).spec
      P()
    """
    return NamedSharding(mesh, REPLICATED)


def varying_axes(x: jax.Array) -> frozenset[str]:
    """The mesh axes a value varies over inside ``jax.shard_map`` (with ``check_vma``).

    Args:
      x: an array or tracer.

    Returns:
      The axis names, e.g. ``frozenset({"data"})``; empty outside ``shard_map`` or for a
      value replicated over every axis.

    Example:
      >>> seen, rows = [], me.make_mesh(ensemble=1, data=2)
      >>> f = jax.shard_map(lambda x: seen.append(varying_axes(x)) or x, mesh=rows,
      ...                   in_specs=P("data"), out_specs=P("data"))
      >>> _ = f(jax.device_put(jnp.zeros(4), me.batch_sharding(rows)))  # x split over data
      >>> seen
      [frozenset({'data'})]
      >>> varying_axes(jnp.zeros(4))   # outside
      frozenset()
    """
    t = jax.typeof(x)
    manual = getattr(t, "manual_axis_type", None)  # JAX >= 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(t, "vma", ()))


def use_fake_cpu_devices(n: int) -> None:
    """Makes JAX run on ``n`` simulated CPU devices; call before JAX starts its backends.

    Sets ``JAX_PLATFORMS=cpu`` and the number of CPU devices (``jax_num_cpu_devices``),
    the modern form of ``--xla_force_host_platform_device_count``.

    Args:
      n: number of CPU devices, at least 1.

    Raises:
      ValueError: ``n`` is not a positive integer.
      RuntimeError: JAX's backends already started with a different device count.

    Example:
      >>> me.use_fake_cpu_devices(8)  # first thing in a script or conftest.py
    """
    _check_size("fake devices", n)
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
    try:
        jax.config.update("jax_num_cpu_devices", int(n))
    except RuntimeError as err:
        if jax.device_count() != n:
            raise RuntimeError(
                f"JAX already started with {jax.device_count()} devices, cannot switch to "
                f"{n} fake CPU devices; call use_fake_cpu_devices before any JAX computation"
            ) from err
