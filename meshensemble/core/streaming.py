"""The host streaming engine: a dataset through the mesh in padded, masked batches.

:func:`stream` is the one host loop that feeds a (possibly huge, memory-mapped) array of
examples to a compiled program batch after batch: it reads one batch at a time from the
host array, pads the last one to the batch size (a multiple of the mesh's ``data`` axis)
by repeating its first row, passes a mask of the real rows, keeps a bounded number of
batches in flight on the devices (the next batch is read and dispatched while the
devices compute the previous ones), then brings each result to the host, drops the
padding and hands it to a sink. Only one batch of input and ``in_flight`` batches of
output are held at a time, so memory stays bounded whatever the dataset's size.

:func:`batch_size_for` rounds a requested batch size to what the mesh can split;
:func:`pad` and :func:`pad_to` are the one way a batch is padded (the single-call
predictions pad with them too).

Example:
  >>> probs = np.zeros((len(images), 10), np.float32)          # the host's result
  >>> def sink(start, out):
  ...     probs[start : start + len(out["probs"])] = out["probs"]
  >>> stream(lambda x, mask: {"probs": ens.predict(state, x)}, images, 12, 1, sink)
  32
  >>> np.allclose(probs, ens.predict(state, images), atol=1e-6)  # 3 batches, the last padded
  True
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshensemble.core.backends import put
from meshensemble.core.mesh import ENSEMBLE
from meshensemble.runtime.distributed import fetch

IN_FLIGHT = 2
"""Batches dispatched to the devices and not yet brought back, by default."""


def batch_size_for(batch_size: int, n: int, multiple: int) -> int:
    """The batch size :func:`stream` uses: ``min(batch_size, n)`` rounded up to ``multiple``.

    Args:
      batch_size: the requested examples per call (> 0).
      n: the number of examples (> 0).
      multiple: what the batch must divide into (the mesh's ``data`` axis).

    Returns:
      The batch size, a positive multiple of ``multiple``.

    Raises:
      ValueError: a value that is not a positive integer.

    Example:
      >>> batch_size_for(1000, 7, 2), batch_size_for(1000, 5000, 8)
      (8, 1000)
    """
    for name, value in (("batch_size", batch_size), ("n", n), ("multiple", multiple)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    b = min(int(batch_size), int(n))
    return b + (-b % int(multiple))


def pad(x: Any, multiple: int) -> Any:
    """``x`` ``[k, ...]`` padded to the next multiple of ``multiple`` rows (see :func:`pad_to`).

    Example:
      >>> pad(np.arange(5), 4).tolist()
      [0, 1, 2, 3, 4, 0, 0, 0]
    """
    n = int(np.shape(x)[0])
    return pad_to(x, n + (-n % multiple))


def pad_to(x: Any, size: int) -> Any:
    """``x`` ``[k, ...]`` padded to ``[size, ...]`` by repeating its first row (a valid input).

    A ``jax.Array`` stays on its devices (gathered whole first when it is split over a mesh,
    so the rows can be joined); anything else becomes numpy.

    Example:
      >>> pad_to(np.arange(3), 4).tolist()
      [0, 1, 2, 0]
    """
    extra = size - int(np.shape(x)[0])
    if not extra:
        return x
    if isinstance(x, jax.Array):
        if isinstance(x.sharding, NamedSharding):  # concatenate along a whole axis
            x = put(x, x.sharding.mesh, P())
        return jnp.concatenate([x, jnp.repeat(x[:1], extra, axis=0)])
    x = np.asarray(x)
    return np.concatenate([x, np.repeat(x[:1], extra, axis=0)])


def unpad_on_mesh(out: Any, n: int, mesh: Any, members: bool) -> Any:
    """A mesh result cut to its first ``n`` examples (the padding of :func:`pad` dropped).

    Args:
      out: an array or dict of arrays ``[N', ...]`` (``[members, N', ...]`` with
        ``members``), examples split over ``data``.
      n: the real examples.
      mesh: the ensemble's mesh.
      members: whether the leaves have a leading member axis (split over ``ensemble``).

    Returns:
      ``out`` as it is when nothing was padded; else each leaf made whole over ``data``
      (``n`` need not divide it) with members still split over ``ensemble``, then cut.

    Example:
      >>> unpad_on_mesh(ens.place(np.zeros((4, 3))), 3, ens.mesh, members=False).shape
      (3, 3)
    """

    def cut(v: jax.Array) -> jax.Array:
        if v.shape[int(members)] == n:
            return v
        v = put(v, mesh, P(ENSEMBLE) if members else P())
        return v[:, :n] if members else v[:n]

    return jax.tree.map(cut, out)


def unpad(tree: Any, k: int, axes: Mapping[str, int] | None = None) -> Any:
    """The first ``k`` rows of every leaf of a host result (``axes[key]``: its batch axis).

    Args:
      tree: a dict of numpy arrays (or one array), batch on axis 0 unless ``axes`` says.
      k: the real rows.
      axes: per key of ``tree``, the batch axis (e.g. ``{"member_probs": 1}``), or None
        for a value the batch was reduced to (bin sums): it is passed on as it is.

    Returns:
      The same structure cut to ``k`` rows.

    Example:
      >>> unpad({"p": np.zeros((4, 3)), "m": np.zeros((2, 4, 3))}, 3, {"m": 1})["m"].shape
      (2, 3, 3)
    """
    axes = axes or {}
    if not isinstance(tree, Mapping):
        return tree[:k]
    take = lambda axis: lambda v: np.take(v, np.arange(k), axis=axis)
    cut = lambda v, axis: v if axis is None else jax.tree.map(take(axis), v)
    return {key: cut(v, axes.get(key, 0)) for key, v in tree.items()}


class HostSum:
    """A :func:`stream` sink that adds the batches' reduced results on the host, in order.

    Example:
      >>> add = HostSum()
      >>> stream(lambda x, m: {"n": m.sum()}, images, 12, 1, add, axes={"n": None})
      32
      >>> int(add.total["n"])   # 12 + 12 + 8 real rows
      32
    """

    def __init__(self) -> None:
        self.total: Any = None

    def __call__(self, start: int, sums: Any) -> None:
        self.total = sums if self.total is None else jax.tree.map(np.add, self.total, sums)


def _rows(a: Any, start: int, b: int) -> Any:
    """Rows ``start:start + b`` of ``a``: a ``jax.Array`` stays on device, the rest is numpy."""
    x = a[start : start + b]
    return x if isinstance(x, jax.Array) else np.asarray(x)


def stream(
    fn: Callable[..., Any],
    images: Any,
    batch_size: int,
    multiple: int,
    sink: Callable[[int, Any], Any],
    *,
    axes: Mapping[str, int] | None = None,
    in_flight: int = IN_FLIGHT,
    progress: Callable[[int], Any] | None = None,
    prepare: Callable[[np.ndarray], np.ndarray] | None = None,
) -> int:
    """Streams ``images`` through ``fn`` in padded, masked batches; results go to ``sink``.

    Args:
      fn: ``fn(x [b, ...], mask [b] bool) -> result`` (``fn(x, y, ..., mask)`` when
        ``images`` is a tuple): dispatches the batch (asynchronously, e.g. a jitted or
        mesh program) and returns a dict of arrays (or one array) whose batch axis is 0
        unless ``axes`` says otherwise. Padding rows repeat the batch's first row;
        ``mask`` is False there.
      images: ``[N, ...]``: anything sliceable with ``len``-able rows (numpy, a
        ``np.memmap``, a lazy reader); only ``images[i:j]`` is read. A tuple of such
        arrays of one length (e.g. ``(images, labels)``) is read row-aligned, each padded.
      batch_size: examples per call (rounded with :func:`batch_size_for`).
      multiple: the batch size's multiple (the mesh's ``data`` axis).
      sink: ``sink(start, result)`` gets each batch's host result (numpy, padding
        dropped) in order; ``start`` is the index of its first example.
      axes: the batch axis of result keys that do not have it first (None: a value the
        batch was reduced to, e.g. masked sums, passed to ``sink`` whole).
      in_flight: batches dispatched before the oldest is brought back (>= 1).
      progress: called with the number of examples done after each batch.
      prepare: applied to each batch read from ``images`` (its first array, on the host)
        before padding.

    Returns:
      ``N``, the number of examples streamed.

    Raises:
      ValueError: no examples, arrays of different lengths, or a bad batch size or
        ``in_flight``.

    Example:
      >>> parts = []
      >>> sink = lambda start, probs: parts.append((start, probs.shape))
      >>> stream(lambda x, m: ens.predict(state, x), images, 12, ens.data_size, sink)
      32
      >>> parts   # the last batch was padded to 12 rows and unpadded to 8
      [(0, (12, 10)), (12, (12, 10)), (24, (8, 10))]
      >>> stream(lambda x, y, m: {"y": y}, (images, labels), 12, 1, lambda s, o: None)
      32
    """
    arrays = images if isinstance(images, tuple) else (images,)
    n = len(arrays[0])
    if n == 0:
        raise ValueError("no examples to stream; give at least one")
    if any(len(a) != n for a in arrays):
        lengths = [len(a) for a in arrays]
        raise ValueError(f"arrays of lengths {lengths} streamed together; give one row each")
    if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
        raise ValueError(f"in_flight={in_flight!r} must be a positive integer")
    b = batch_size_for(batch_size, n, multiple)
    queue: collections.deque[tuple[int, int, Any]] = collections.deque()

    def drain(keep: int) -> None:
        while len(queue) > keep:
            start, k, out = queue.popleft()
            sink(start, unpad(fetch(out), k, axes))
            if progress is not None:
                progress(k)

    for start in range(0, n, b):
        parts = [_rows(a, start, b) for a in arrays]
        if prepare is not None:
            parts[0] = prepare(parts[0])
        k = len(parts[0])
        queue.append((start, k, fn(*(pad_to(x, b) for x in parts), np.arange(b) < k)))
        drain(in_flight)
    drain(0)
    return n
