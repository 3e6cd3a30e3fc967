"""Backends: turn a per-device function into a global one over the mesh.

Both backends take the same per-device function (from :mod:`meshensemble.core.steps`) and
the same ``PartitionSpec`` of each argument and result, and return a callable on global
arrays laid out as the specs say. They differ only in the machinery:

* :class:`ShardMapBackend`: ``jax.jit(jax.shard_map(...))``, the modern path, any 2-D mesh;
  on a mesh with a ``model`` axis the ``shard_map`` is manual over ``ensemble`` and
  ``data`` only and the compiler partitions ``model`` (``axis_names=``).
* :class:`PmapBackend`: ``jax.pmap`` over the devices, the legacy path kept for parity
  tests; meshes ``ensemble=N, data=1`` or ``ensemble=1, data=N``. The mesh axis that
  ``pmap`` does not map is bound by a size-1 ``vmap`` so both axis names exist.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshensemble.core.mesh import DATA, ENSEMBLE, MODEL
from meshensemble.core.sharding import manual_spec

BACKENDS = ("shard_map", "pmap")
"""Backend names accepted by :class:`meshensemble.Ensemble`."""


def put(x: Any, mesh: Mesh, spec: P) -> jax.Array:
    """Places ``x`` on ``mesh`` as ``spec`` says, without copying what is already there.

    Every process passes the same global value (numpy or ``jax.Array``); a
    ``jax.Array`` already laid out as ``spec`` is returned as is. A
    ``jax.ShapeDtypeStruct`` (lowering ahead of time) gets the sharding, nothing placed.
    """
    sharding = NamedSharding(mesh, spec)
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    if isinstance(x, jax.Array):
        if _same_layout(x.sharding, sharding):
            return x
        if x.is_fully_addressable or not sharding.is_fully_addressable:
            return jax.device_put(x, sharding)
    x = np.asarray(x)
    if jax.process_count() > 1:
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])
    return jax.device_put(x, sharding)


def _same_layout(have: Any, want: NamedSharding) -> bool:
    """Equal mesh and spec: with Explicit axes shard_map checks specs, not only layouts."""
    if not isinstance(have, NamedSharding) or have.mesh != want.mesh:
        return False
    trim = lambda spec: tuple(spec)[: max((i + 1 for i, a in enumerate(spec) if a), default=0)]
    return trim(have.spec) == trim(want.spec)


class ShardMapBackend:
    """The modern backend: ``jax.jit`` of ``jax.shard_map`` over the 2-D mesh.

    Args:
      mesh: a mesh with axes ``("ensemble", "data")``.
    """

    name = "shard_map"

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        # With data=1 no gradient crosses devices: without check_vma the steps skip every
        # reduction over a size-1 axis (steps.reduce_over), which XLA:CPU would still run
        # as a rendezvous of all devices. FSDP and the model axis keep check_vma, except on
        # a mesh whose manual axes (ensemble, data) are both of size 1: there XLA's SPMD
        # partitioner refuses any all-reduce ("Cross-partition allreduce must be in
        # (partial) manual partitioning mode"), so the steps must skip them all.
        unchecked = mesh.shape[DATA] == 1 and (
            MODEL not in mesh.axis_names or mesh.shape[ENSEMBLE] == 1
        )
        self.grad_mode = "pmean" if unchecked else "vma"

    def build(
        self,
        fn: Callable[..., Any],
        in_specs: Sequence[Any],
        out_specs: Any,
        donate_argnums: tuple[int, ...] = (),
    ) -> Callable[..., Any]:
        """Returns ``jit(shard_map(fn))`` taking and returning global arrays.

        Specs may name the ``model`` axis (on a mesh that has one): arguments are placed
        with it, results come back with it, and ``fn`` sees those dimensions whole (the
        compiler splits them).
        """
        manual = MODEL in self.mesh.axis_names  # ensemble and data manual, model automatic
        spec_of = manual_spec if manual else (lambda s: s)
        mapped = jax.shard_map(
            fn,
            mesh=self.mesh,
            in_specs=spec_of(tuple(in_specs)),
            out_specs=spec_of(out_specs),
            check_vma=self.grad_mode == "vma",
            **({"axis_names": {ENSEMBLE, DATA}} if manual else {}),
        )
        is_spec = lambda s: isinstance(s, P)
        out = jax.tree.map(lambda s: NamedSharding(self.mesh, s), out_specs, is_leaf=is_spec)
        placed = {"out_shardings": out} if manual else {}  # results come back with `model`
        jitted = jax.jit(mapped, donate_argnums=donate_argnums, **placed)
        specs = tuple(in_specs)

        def call(*args: Any) -> Any:
            return jitted(*_put_all(args, specs, self.mesh))

        call.jitted = jitted  # type: ignore[attr-defined]
        call.lower = lambda *args: jitted.lower(*_put_all(args, specs, self.mesh))  # type: ignore[attr-defined]
        return call


class PmapBackend:
    """The legacy backend: ``jax.pmap`` over the mesh's devices, for parity tests.

    Inputs are laid out for ``pmap`` by stacking each device's local shard (what the
    per-device function sees under ``shard_map`` too); outputs are put back on the mesh
    from the per-device results, so users see the same global arrays as with
    ``shard_map``.

    Args:
      mesh: a mesh with ``ensemble == 1`` or ``data == 1``.

    Raises:
      ValueError: both mesh axes are larger than 1.
    """

    name = "pmap"
    grad_mode = "pmean"

    def __init__(self, mesh: Mesh):
        if MODEL in mesh.axis_names:
            raise ValueError(
                "backend='pmap' (legacy) has no 'model' axis; use backend='shard_map' for a "
                "mesh made with make_mesh(..., model=P)"
            )
        e, d = mesh.shape[ENSEMBLE], mesh.shape[DATA]
        if e > 1 and d > 1:
            raise ValueError(
                f"backend='pmap' maps one axis, but the mesh is ensemble={e} x data={d}; "
                f"use backend='shard_map' for 2-D meshes, or a mesh with ensemble=1 or data=1"
            )
        self.mesh = mesh
        self.axis = DATA if d > 1 else ENSEMBLE
        self.other = ENSEMBLE if self.axis == DATA else DATA
        self.devices = list(mesh.devices.flat)
        self._line = NamedSharding(Mesh(np.asarray(self.devices), ("_pmap",)), P("_pmap"))
        self._stack = jax.jit(lambda leaves: [v[None] for v in leaves])
        self._unstack = jax.jit(lambda leaves: [v[0] for v in leaves])
        self._cache: dict[int, tuple[Any, Any]] = {}

    def build(
        self,
        fn: Callable[..., Any],
        in_specs: Sequence[Any],
        out_specs: Any,
        donate_argnums: tuple[int, ...] = (),
    ) -> Callable[..., Any]:
        """Returns a callable on global arrays that runs ``fn`` under ``jax.pmap``."""
        other = self.other

        def per_device(*args: Any) -> Any:
            # Bind the unmapped mesh axis with size 1, so collectives over it are no-ops.
            out = jax.vmap(lambda *a: fn(*a), in_axes=None, axis_name=other, axis_size=1)(*args)
            return jax.tree.map(lambda v: v[0], out)

        pmapped = jax.pmap(
            per_device, axis_name=self.axis, devices=self.devices, donate_argnums=donate_argnums
        )
        specs = tuple(in_specs)

        def call(*args: Any) -> Any:
            placed = _put_all(args, specs, self.mesh)
            local = [self._to_pmap(a, s) for a, s in zip(placed, specs)]
            return self._from_pmap(pmapped(*local), out_specs)

        return call

    def _to_pmap(self, tree: Any, spec: Any) -> Any:
        leaves, treedef = jax.tree.flatten(tree)
        if spec == P() and len(leaves) == 1 and id(leaves[0]) in self._cache:
            src, out = self._cache[id(leaves[0])]
            if src is leaves[0]:
                return out
        per_device = [self._shards(v) for v in leaves]
        pieces = [self._stack(list(col)) for col in zip(*per_device)]
        stacked = [
            jax.make_array_from_single_device_arrays(
                (len(self.devices), *per_device[i][0].shape), self._line, [p[i] for p in pieces]
            )
            for i in range(len(leaves))
        ]
        out = jax.tree.unflatten(treedef, stacked)
        if spec == P() and len(leaves) == 1:
            self._cache = {id(leaves[0]): (leaves[0], out)}
        return out

    def _shards(self, x: jax.Array) -> list[jax.Array]:
        by_device = {s.device: s.data for s in x.addressable_shards}
        return [by_device[d] for d in self.devices]

    def _from_pmap(self, out: Any, specs: Any) -> Any:
        flat_specs = _broadcast_specs(specs, out)
        leaves, treedef = jax.tree.flatten(out)
        per_device = [self._shards(v) for v in leaves]
        pieces = [self._unstack(list(col)) for col in zip(*per_device)]
        result = []
        for i, (leaf, spec) in enumerate(zip(leaves, flat_specs)):
            local = leaf.shape[1:]
            shape = tuple(n * _spec_size(self.mesh, spec, k) for k, n in enumerate(local))
            result.append(
                jax.make_array_from_single_device_arrays(
                    shape, NamedSharding(self.mesh, spec), [p[i] for p in pieces]
                )
            )
        return jax.tree.unflatten(treedef, result)


def _spec_size(mesh: Mesh, spec: P, dim: int) -> int:
    if dim >= len(spec) or spec[dim] is None:
        return 1
    names = spec[dim] if isinstance(spec[dim], tuple) else (spec[dim],)
    return math.prod(mesh.shape[n] for n in names)


def _broadcast_specs(specs: Any, tree: Any) -> list[P]:
    """One spec per leaf of ``tree`` from a spec tree that is a prefix of it."""
    is_spec = lambda s: isinstance(s, P)
    out: list[P] = []
    jax.tree.map(
        lambda spec, sub: out.extend([spec] * len(jax.tree.leaves(sub))),
        specs,
        tree,
        is_leaf=is_spec,
    )
    return out


def _put_all(args: Sequence[Any], specs: Sequence[Any], mesh: Mesh) -> list[Any]:
    out = []
    for arg, spec in zip(args, specs):
        flat = _broadcast_specs(spec, arg)
        leaves, treedef = jax.tree.flatten(arg)
        out.append(jax.tree.unflatten(treedef, [put(v, mesh, s) for v, s in zip(leaves, flat)]))
    return out


def make_backend(
    name: str, mesh: Mesh, shard_members: bool = False
) -> ShardMapBackend | PmapBackend:
    """Returns the backend called ``name`` for ``mesh``.

    Args:
      name: ``"shard_map"`` or ``"pmap"``.
      mesh: the ensemble mesh.
      shard_members: whether members are FSDP-sharded over ``data`` (shard_map only).

    Returns:
      The backend.

    Raises:
      ValueError: an unknown name, or ``"pmap"`` on a 2-D mesh, with a ``model`` axis
        or with ``shard_members``.

    Example:
      >>> make_backend("shard_map", me.make_mesh(ensemble=4, data=2)).grad_mode
      'vma'
    """
    if name == "shard_map":
        return ShardMapBackend(mesh)
    if name == "pmap":
        if shard_members:
            raise ValueError(
                "shard_members=True needs backend='shard_map'; the legacy pmap backend "
                "keeps members whole"
            )
        return PmapBackend(mesh)
    raise ValueError(f"backend={name!r} is unknown; choose one of {', '.join(BACKENDS)}")
