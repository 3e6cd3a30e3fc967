"""Streaming input on Grain: each process reads only the rows of each batch its devices use.

For data that does not fit on the devices (``--input stream``), the training examples stay
in a random-access *source* on the host (or on shared storage) and every step's batch is
read there, by each process for its own devices only, a few steps ahead of the device step
(Grain worker threads and a prefetch buffer), then assembled into a global array with
``jax.make_array_from_process_local_data``.

Sources (all random access, ``len(source)`` and ``source.read(indices)``):

* :class:`ArraySource`: in-memory arrays (the npz, sample and synthetic datasets);
* :class:`ArrayRecordSource`: ArrayRecord files written by :func:`write_array_record`
  (Grain's ``ArrayRecordDataSource``; the format for pods: files on shared storage);
* :class:`TfdsSource`: a ``tfds.data_source(...)`` split (TFDS's prepared ArrayRecord data).

:class:`StreamIterator` yields, step after step, this process's part of each global batch
in the order the run's ``order(epoch)`` gives (fetched to the host once per epoch). Its
state (:meth:`StreamIterator.get_state`) is a small JSON dict saved in the run's
checkpoint. :func:`choose_input` decides ``--input auto``.

Example:
  >>> ds = me.data.synthetic(256, 16)
  >>> src = ArraySource(ds.train_images, ds.train_labels)
  >>> order_fn = lambda epoch: np.random.default_rng(epoch).permutation([np.arange(256)] * 2,
  ...                                                                axis=1)  # per member
  >>> it = StreamIterator(src, order_fn, batch=128, steps_per_epoch=2,
  ...                     block=local_block(mesh, 128, members=2))
  >>> images, labels = it.next_batch(epoch=1, step=0)   # this process's rows
  >>> images.shape, labels.shape                        # [members, batch, ...]
  ((2, 128, 28, 28, 1), (2, 128))
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from meshensemble.core.mesh import BATCH, MEMBER_BATCH
from meshensemble.data.codec import MNIST_CODEC, RecordCodec, codec_for
from meshensemble.data.dataset import IMAGE_SHAPE, DataError
from meshensemble.data.tfds import read_records
from meshensemble.runtime import storage


def _grain() -> Any:
    """Grain, imported on first use (``import meshensemble`` does not need it)."""
    try:
        import grain
    except ImportError as err:
        raise DataError(
            f"the streaming input needs grain ({err}); install it: pip install 'grain>=0.2.18'"
        ) from None
    return grain


RECORD_BYTES = 1 + int(np.prod(IMAGE_SHAPE))
"""Bytes of one MNIST record (:data:`~meshensemble.data.codec.MNIST_CODEC`): the label,
then the uint8 pixels. Other data's records follow their
:class:`~meshensemble.data.codec.RecordCodec`."""
EXAMPLE_BYTES = int(np.prod(IMAGE_SHAPE)) + 4
"""Device bytes of one training example on the on-device path (uint8 image, int32 label)."""
DEFAULT_DEVICE_BUDGET = 2 << 30
"""Bytes per device that ``--input auto`` assumes when the device does not report its
memory (``jax.Device.memory_stats()`` is None, e.g. on CPU); the environment variable
``MESHENSEMBLE_DEVICE_BUDGET`` (bytes) overrides it and any reported memory."""
DEVICE_FRACTION = 0.25
"""Share of a device's memory the replicated training set may take for ``--input auto``
to keep it on device (the rest is for parameters, optimizer state and activations)."""
INPUTS = ("device", "stream", "auto")
"""Values of ``TrainConfig.input`` / ``--input``."""


def one_target(y: Any) -> Any:
    """One example's target as a source's ``source[i]`` gives it: an int class id, or the
    float targets ``[T]`` as they are.

    Args:
      y: a class id or a float ``[T]`` row.

    Returns:
      ``int(y)`` for an integer, else ``y``.

    Example:
      >>> one_target(np.int32(3)), one_target(np.zeros(2, np.float32)).shape
      (3, (2,))
    """
    return int(y) if np.issubdtype(np.asarray(y).dtype, np.integer) else y


class ArraySource:
    """Random access to in-memory arrays (the npz, sample and synthetic datasets).

    Args:
      images: uint8 ``[N, 28, 28, 1]``.
      labels: int ``[N]``.

    Example:
      >>> ds = me.data.synthetic(64, 16)
      >>> src = ArraySource(ds.train_images, ds.train_labels)
      >>> x, y = src.read(np.array([3, 1]))
      >>> x.shape, y.tolist() == ds.train_labels[[3, 1]].tolist()
      ((2, 28, 28, 1), True)
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        if len(images) != len(labels):
            raise DataError(
                f"ArraySource: {len(images)} images but {len(labels)} labels; pass one per image"
            )
        labels = np.asarray(labels)
        self.images = images
        self.labels = labels.astype(np.int32) if np.issubdtype(labels.dtype, np.integer) else labels

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def shape(self) -> tuple[int, ...]:
        """The features' shape ``[N, ...]``."""
        return tuple(np.shape(self.images))

    @property
    def dtype(self) -> np.dtype:
        """The features' dtype."""
        return np.dtype(self.images.dtype)

    def __getitem__(self, i: int) -> tuple[np.ndarray, Any]:
        return self.images[i], one_target(self.labels[i])

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The examples at ``indices`` (any shape ``S``).

        Args:
          indices: int ``S``.

        Returns:
          ``(inputs, targets)``: e.g. uint8 ``S + [28, 28, 1]`` and int32 ``S``, or float
          ``S + [F]`` and ``S + [T]``.
        """
        return self.images[indices], self.labels[indices]


class _RecordSource:
    """Shared ``read`` of sources whose records are read one list at a time."""

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> tuple[np.ndarray, Any]:
        x, y = self.read(np.asarray([i]))
        return x[0], one_target(y[0])

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The examples at ``indices`` (any shape ``S``).

        Args:
          indices: int ``S``.

        Returns:
          ``(images, labels)``: uint8 ``S + [28, 28, 1]`` and int32 ``S``.
        """
        x, y = self.decode(read_records(self.records, np.asarray(indices).reshape(-1)))
        shape = np.shape(indices)
        return x.reshape(shape + x.shape[1:]), y.reshape(shape + y.shape[1:])


class ArrayRecordSource(_RecordSource):
    """Random access to ArrayRecord files of :func:`write_array_record` (Grain's reader).

    Args:
      paths: one file or several (their records in order form the dataset).
      counts: the record count of each file (from the dataset's manifest); with
        ``verifier``, each file is verified the first time one of its records is read.
      verifier: a :class:`meshensemble.data.manifest.FileVerifier` of the files.
      codec: the records' :class:`~meshensemble.data.codec.RecordCodec` (from the
        dataset's manifest); default MNIST's (:data:`~meshensemble.data.codec.MNIST_CODEC`).

    Raises:
      DataError: a file is missing, or its records are not ``codec.record_bytes`` long;
        from :meth:`read`: a file that cannot be read (damaged) or whose content differs
        from its manifest (one line naming the file and the fix).

    Example:
      >>> x, y = images, labels                   # uint8 [32, 28, 28, 1], [32]
      >>> src = ArrayRecordSource(write_array_record("train.array_record", x, y))
      >>> len(src), src.read(np.array([0, 5]))[1].tolist() == y[[0, 5]].tolist()
      (32, True)
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        counts: Sequence[int] | None = None,
        verifier: Any = None,
        codec: RecordCodec | None = None,
    ):
        self.codec = codec or MNIST_CODEC
        paths = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
        missing = [str(p) for p in paths if not storage.isfile(p)]
        if missing or not paths:
            raise DataError(
                f"ArrayRecordSource: no file {missing or paths}; write one with "
                "me.data.stream.write_array_record(path, images, labels)"
            )
        self.paths = [str(p) for p in paths]
        self.verifier = verifier
        self.ends = None if counts is None else np.cumsum(np.asarray(counts, np.int64))
        try:
            self.records = _grain().sources.ArrayRecordDataSource(self.paths)
            if self.ends is None and len(self.paths) > 1:  # to name a damaged file
                sizes = [len(_grain().sources.ArrayRecordDataSource([p])) for p in self.paths]
                self.ends = np.cumsum(np.asarray(sizes, np.int64))
        except Exception as err:  # e.g. a truncated file's footer
            raise DataError(_damaged(self.paths, err)) from None
        size = self.codec.record_bytes
        if len(self.records) and len(self.records[0]) != size:
            what = (
                "a label byte and 28x28 uint8 pixels"
                if self.codec == MNIST_CODEC
                else self.codec.describe()
            )
            raise DataError(
                f"{self.paths[0]}: records of {len(self.records[0])} bytes; expected "
                f"{size} ({what}, as write_array_record writes them)"
            )

    def files_of(self, indices: np.ndarray) -> list[str]:
        """The files holding the records at ``indices`` (all files when counts are unknown)."""
        if self.ends is None or len(self.ends) != len(self.paths):
            return list(self.paths)
        which = np.unique(np.searchsorted(self.ends, np.asarray(indices).ravel(), side="right"))
        return [self.paths[i] for i in which if i < len(self.paths)]

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The examples at ``indices`` (any shape ``S``), each file verified on first read.

        Args:
          indices: int ``S``.

        Returns:
          ``(images, labels)``: uint8 ``S + [28, 28, 1]`` and int32 ``S``.

        Raises:
          DataError: a file is damaged or differs from its manifest (naming the file).
        """
        files = self.files_of(indices)
        if self.verifier is not None:
            for path in files:
                self.verifier.verify(path)
        try:
            return super().read(indices)
        except DataError:
            raise
        except Exception as err:  # Riegeli's "Corrupted ... at byte N" names no file
            raise DataError(_damaged(files, err)) from None

    @property
    def shape(self) -> tuple[int, ...]:
        """``(N, *x_shape)`` of the records' features."""
        return (len(self), *self.codec.x_shape)

    @property
    def dtype(self) -> np.dtype:
        """The features' dtype."""
        return np.dtype(self.codec.x_dtype)

    def decode(self, records: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """``(features [n, *x_shape], targets [n] int32 or [n, T])`` from raw records."""
        return self.codec.decode(records)


def _damaged(paths: Sequence[str], err: BaseException) -> str:
    where = paths[0] if len(paths) == 1 else f"one of {', '.join(paths)}"
    text = " ".join(str(err).split())[:200] or type(err).__name__
    return (
        f"{where}: cannot read its records ({type(err).__name__}: {text}); the file is "
        "damaged or truncated: write the dataset again (meshensemble convert --data-file "
        "mnist.npz --out DIR --overwrite)"
    )


class TfdsSource(_RecordSource):
    """Random access to a ``tfds.data_source(name, split=...)`` (records ``image``, ``label``).

    Args:
      records: the TFDS data source of one split.
      image_shape: one image's shape (default MNIST's ``(28, 28, 1)``).
      image_key: the image feature's name.
      label_key: the label feature's name.

    Example:
      >>> import tensorflow_datasets as tfds  # doctest: +SKIP
      >>> src = TfdsSource(tfds.data_source("mnist", split="train"))  # doctest: +SKIP
    """

    def __init__(
        self,
        records: Any,
        image_shape: Sequence[int] = IMAGE_SHAPE,
        image_key: str = "image",
        label_key: str = "label",
    ):
        self.records, self.image_shape = records, tuple(image_shape)
        self.image_key, self.label_key = image_key, label_key

    @property
    def shape(self) -> tuple[int, ...]:
        """``(N, *image_shape)``."""
        return (len(self), *self.image_shape)

    dtype = np.dtype(np.uint8)

    def decode(self, records: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """``(images uint8 [n, *image_shape], labels int32 [n])`` from TFDS records."""
        x = np.stack([np.asarray(r[self.image_key], np.uint8) for r in records])
        y = np.asarray([int(r[self.label_key]) for r in records], np.int32)
        return x.reshape((len(records), *self.image_shape)), y


def write_array_record(
    path: str | os.PathLike,
    images: np.ndarray,
    labels: np.ndarray,
    shards: int = 1,
    codec: RecordCodec | None = None,
) -> list[str]:
    """Writes features and targets as ArrayRecord files for :class:`ArrayRecordSource`.

    Each record is ``codec.record_bytes`` bytes: the target, then the features (for MNIST
    the label byte, then the 784 uint8 pixels: :data:`RECORD_BYTES`).

    Args:
      path: the file (``shards == 1``) or the stem ``path-00000-of-00004`` is made from.
      images: features ``[N, ...]`` (e.g. uint8 ``[N, 28, 28, 1]``).
      labels: class ids ``[N]`` or float targets ``[N, T]``.
      shards: how many files (consecutive runs of examples).
      codec: the records' layout; default :func:`~meshensemble.data.codec.codec_for` the
        arrays (MNIST's arrays: :data:`~meshensemble.data.codec.MNIST_CODEC`).

    Returns:
      The paths written, in order.

    Raises:
      DataError: arrays that do not fit ``codec`` (another example shape, a class id
        outside its dtype's range), or not one target per example.

    Example:
      >>> paths = write_array_record("mnist_train.array_record", images, labels, shards=4)
      >>> [p.rsplit("/", 1)[-1] for p in paths][:2]
      ['mnist_train.array_record-00000-of-00004', 'mnist_train.array_record-00001-of-00004']
    """
    from array_record.python.array_record_module import ArrayRecordWriter

    images, labels = np.asarray(images), np.asarray(labels)
    codec = codec or codec_for(images, labels)
    x, y = _fit(codec, images, labels)
    path = os.fspath(path)
    names = [path] if shards == 1 else [f"{path}-{i:05d}-of-{shards:05d}" for i in range(shards)]
    for name, part in zip(names, np.array_split(np.arange(len(y)), shards), strict=True):
        writer = ArrayRecordWriter(name, "group_size:1")
        for i in part:
            writer.write(y[i].tobytes() + x[i].tobytes())
        writer.close()
    return names


def _fit(codec: RecordCodec, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The arrays in the codec's dtypes, or a one-line DataError saying why they do not fit."""
    where = f"write_array_record ({codec.describe()})"
    if len(x) != len(y) or tuple(x.shape[1:]) != tuple(codec.x_shape):
        raise DataError(
            f"{where}: features {x.shape} {x.dtype} with targets {y.shape}; pass "
            f"[N, {', '.join(map(str, codec.x_shape))}] features and one target per example"
        )
    y_dtype = np.dtype(codec.y_dtype)
    if codec.class_ids:
        low, high = np.iinfo(y_dtype).min, np.iinfo(y_dtype).max
        if y.size and (y.min() < max(low, 0) or y.max() > high):
            raise DataError(f"{where}: need one label in 0..{high} per example")
    if tuple(y.shape[1:]) != tuple(codec.y_shape):
        raise DataError(f"{where}: targets of shape {y.shape}; expected [N, *{codec.y_shape}]")
    return x.astype(np.dtype(codec.x_dtype), copy=False), y.astype(y_dtype, copy=False)


def as_source(data: Any) -> Any:
    """A random-access source from a source, a :class:`~meshensemble.data.Dataset` (its train
    split) or an ``(images, labels)`` pair.

    Args:
      data: any of those.

    Returns:
      An object with ``len()`` and ``read(indices)``.

    Raises:
      DataError: something else.

    Example:
      >>> as_source(me.data.synthetic(64, 16)).read(np.arange(4))[0].shape
      (4, 28, 28, 1)
    """
    if hasattr(data, "read") and hasattr(data, "__len__"):
        return data
    if hasattr(data, "train_images"):
        if getattr(data.train_images, "lazy", False):  # read from its source, not as arrays
            return data.train_images.source
        return ArraySource(data.train_images, data.train_labels)
    if isinstance(data, tuple) and len(data) == 2:
        return ArraySource(*data)
    raise DataError(f"cannot stream from {type(data).__name__}; pass a source or a Dataset")


@dataclasses.dataclass(frozen=True)
class Block:
    """The part of each global batch one process's devices hold.

    Attributes:
      rows: ``(lo, hi)`` of the batch's rows (along ``data``).
      members: ``(lo, hi)`` of the members (per-member batches), or None (shared batches).
    """

    rows: tuple[int, int]
    members: tuple[int, int] | None = None


def local_block(mesh: Mesh, batch: int, members: int | None = None, devices: Any = None) -> Block:
    """This process's rows (and members) of a ``[B, ...]`` or ``[members, B, ...]`` batch.

    Args:
      mesh: the ensemble mesh.
      batch: the global batch size ``B``.
      members: the member count for per-member batches; None for shared batches.
      devices: the devices whose block to give; default this process's (addressable)
        devices. Another process's devices give its block (what it would read).

    Returns:
      A :class:`Block`.

    Raises:
      ValueError: this process's devices do not hold one rectangular block (a mesh whose
        device order interleaves processes); use :func:`meshensemble.make_mesh`.

    Example:
      >>> local_block(me.make_mesh(1, 8), 128)   # one process: every row
      Block(rows=(0, 128), members=None)
      >>> local_block(me.make_mesh(1, 8), 128)   # process 0 of 2 x 4 devices  # doctest: +SKIP
      Block(rows=(0, 64), members=None)
    """
    shape = (batch,) if members is None else (members, batch)
    sharding = NamedSharding(mesh, BATCH if members is None else MEMBER_BATCH)
    if devices is None:
        held_by = sharding.addressable_devices_indices_map(shape)
    else:
        mine = set(devices)
        held_by = {d: i for d, i in sharding.devices_indices_map(shape).items() if d in mine}
    boxes = [
        tuple(s.indices(n)[:2] for s, n in zip(idx, shape, strict=False))
        for idx in held_by.values()
    ]
    lo = [min(b[d][0] for b in boxes) for d in range(len(shape))]
    hi = [max(b[d][1] for b in boxes) for d in range(len(shape))]
    covered = {tuple(b) for b in boxes}
    size = int(np.prod([h - low for low, h in zip(lo, hi, strict=True)]))
    held = sum(int(np.prod([e - s for s, e in b])) for b in covered)
    if held != size:
        raise ValueError(
            f"process {jax.process_index()}'s devices hold no single block of the batch "
            f"{shape} on mesh {dict(mesh.shape)}; build the mesh with me.make_mesh"
        )
    if members is None:
        return Block((lo[0], hi[0]))
    return Block((lo[1], hi[1]), (lo[0], hi[0]))


class StreamIterator:
    """This process's part of each step's global batch, read ahead by Grain threads.

    The order of an epoch (``order_fn(epoch)``: int ``[N]`` shared, or ``[members, N]``
    per member) is fetched once per epoch, on the calling thread. Within an epoch, Grain
    reads the next ``prefetch`` steps' rows in ``threads`` worker threads while the
    devices run; step ``s`` of an epoch uses order positions ``s * B .. (s + 1) * B``.

    Args:
      source: a random-access source (:func:`as_source`).
      order_fn: ``epoch -> order`` on the host (numpy).
      batch: the global batch size ``B``.
      steps_per_epoch: ``N // B``.
      block: this process's :class:`Block` (:func:`local_block`).
      threads: Grain's worker threads.
      prefetch: steps read ahead.

    Example:
      >>> ds = me.data.synthetic(256, 16)
      >>> src, order_fn = ArraySource(ds.train_images, ds.train_labels), np.random.permutation
      >>> it = StreamIterator(src, lambda epoch: order_fn(256), 128, 2, local_block(mesh, 128))
      >>> x, y = it.next_batch(1, 0)
      >>> it.get_state()
      {'epoch': 1, 'step': 1}
    """

    def __init__(
        self,
        source: Any,
        order_fn: Callable[[int], np.ndarray],
        batch: int,
        steps_per_epoch: int,
        block: Block,
        threads: int = 4,
        prefetch: int = 8,
    ):
        self.source, self.order_fn, self.batch = as_source(source), order_fn, batch
        self.steps_per_epoch, self.block = steps_per_epoch, block
        self.options = _grain().ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch)
        self.epoch, self.step = 1, 0
        self._it: Any = None  # Grain's iterator over the current epoch's steps
        self._at: tuple[int, int] | None = None  # the (epoch, step) it yields next

    def indices(self, order: np.ndarray, step: int) -> np.ndarray:
        """This process's example indices of ``step``: ``[rows]`` or ``[members, rows]``."""
        lo, hi = self.block.rows
        cols = order[..., step * self.batch + lo : step * self.batch + hi]
        if self.block.members is not None:
            cols = cols[self.block.members[0] : self.block.members[1]]
        return cols

    def _start(self, epoch: int, step: int) -> None:
        order = np.asarray(self.order_fn(epoch))
        read = lambda s: self.source.read(self.indices(order, s))
        steps = _grain().MapDataset.range(step, self.steps_per_epoch).map(read)
        self._it = iter(steps.to_iter_dataset(self.options))
        self._at = (epoch, step)

    def next_batch(self, epoch: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """This process's images and labels of ``step`` of ``epoch``; reads ahead after it.

        Args:
          epoch: from 1.
          step: within the epoch, from 0.

        Returns:
          ``(images, labels)``: uint8 ``[rows, 28, 28, 1]`` and int32 ``[rows]``, or
          ``[members, rows, ...]`` per member.
        """
        if self._at != (epoch, step):  # a new epoch, a resume, or a jump: read from there
            self._start(epoch, step)
        x, y = next(self._it)
        self.epoch, self.step = epoch, step + 1
        if self.step == self.steps_per_epoch:
            self.epoch, self.step = epoch + 1, 0
        self._at = (self.epoch, self.step) if self.step else None
        return x, y

    def get_state(self) -> dict[str, int]:
        """The position of the next batch, JSON-able: ``{"epoch": e, "step": s}``."""
        return {"epoch": self.epoch, "step": self.step}

    def set_state(self, state: dict[str, int]) -> None:
        """Continues from a :meth:`get_state` (the next batch is that position's).

        Raises:
          ValueError: a state that is not a position of this iterator.
        """
        epoch, step = int(state["epoch"]), int(state["step"])
        if epoch < 1 or not 0 <= step < self.steps_per_epoch:
            raise ValueError(
                f"iterator state {state} is outside 1.. epochs x {self.steps_per_epoch} steps; "
                "pass a state from get_state() of the same run"
            )
        self.epoch, self.step, self._at, self._it = epoch, step, None, None


def example_bytes(dataset: Any) -> int:
    """Device bytes of one training example of ``dataset`` on the on-device path.

    Args:
      dataset: a :class:`~meshensemble.data.Dataset` (its train split's layout is read,
        no example).

    Returns:
      The features' bytes plus the target's (4 bytes a class id or a float target entry).

    Example:
      >>> example_bytes(me.data.synthetic(8, 4)) == EXAMPLE_BYTES   # MNIST's
      True
      >>> example_bytes(me.data.toy1d())   # a float32 feature and a float32 target
      8
    """
    x, y = dataset.x_train, dataset.y_train
    features = int(np.prod(x.shape[1:], dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return features + 4 * int(np.prod(np.shape(y)[1:], dtype=np.int64))


def device_budget(device: jax.Device | None = None) -> tuple[int, str]:
    """Bytes one device can give the training set, and where that number comes from.

    Args:
      device: default ``jax.local_devices()[0]`` (a device of this process: only those
        answer ``memory_stats``).

    Returns:
      ``(bytes, how)``: ``$MESHENSEMBLE_DEVICE_BUDGET``, else :data:`DEVICE_FRACTION` of
      the memory the device reports, else :data:`DEFAULT_DEVICE_BUDGET`.

    Example:
      >>> device_budget()
      (2147483648, 'default 2.0 GiB (cpu reports no memory)')
    """
    env = os.environ.get("MESHENSEMBLE_DEVICE_BUDGET")
    if env:
        return int(float(env)), f"MESHENSEMBLE_DEVICE_BUDGET={env}"
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        limit = int(stats["bytes_limit"])
        return int(limit * DEVICE_FRACTION), f"{DEVICE_FRACTION:.0%} of {limit / 2**30:.1f} GiB"
    gib = DEFAULT_DEVICE_BUDGET / 2**30
    return DEFAULT_DEVICE_BUDGET, (
        f"default {gib:.1f} GiB ({device.platform} reports no memory)"
    )


def choose_input(
    num_train: int, device: jax.Device | None = None, example_bytes: int = EXAMPLE_BYTES
) -> tuple[str, str]:
    """``--input auto``: ``"device"`` when the replicated training set fits, else ``"stream"``.

    Args:
      num_train: training examples (each ``example_bytes`` on every device).
      device: the device to ask (default ``jax.devices()[0]``).
      example_bytes: device bytes of one example, features and target (default
        :data:`EXAMPLE_BYTES`, MNIST's; e.g. ``32 * 32 * 3 + 4`` for CIFAR-10).

    Returns:
      ``(input, why)``, e.g. ``("device", "60,000 examples, 44.9 MiB/device, within
      ...")``.

    Example:
      >>> choose_input(60_000)[0]
      'device'
    """
    need = num_train * example_bytes
    budget, how = device_budget(device)
    size = f"{num_train:,} examples, {need / 2**20:.1f} MiB/device"
    if need <= budget:
        return "device", f"{size}, within {how}"
    return "stream", f"{size}, more than {how} ({budget / 2**20:.1f} MiB)"
