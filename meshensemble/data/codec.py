"""How one example is stored in one ArrayRecord record: its target's bytes, then its features'.

A :class:`RecordCodec` names the layout of every record of a file dataset: the target's
shape and dtype (``()`` for a class id, ``(T,)`` for float targets) and the features'
(e.g. ``(32, 32, 3)`` uint8 or ``(13,)`` float32), each stored as raw little-endian
bytes, target first. :func:`codec_for` picks the codec of a dataset's arrays (class ids
below 256 in one byte), and ``manifest.json`` records it (:meth:`RecordCodec.record`), so
a reader knows the layout without guessing. A folder written before codecs existed has
none in its manifest: it holds MNIST records (:data:`MNIST_CODEC`, one label byte and 784
pixel bytes), which is exactly what the generic codec writes for MNIST's arrays.

Example:
  >>> codec = codec_for(np.zeros((4, 8, 8, 3), np.uint8), np.arange(4))
  >>> codec.record_bytes, codec.record()["x_shape"]
  (193, [8, 8, 3])
  >>> x, y = codec.decode([codec.encode(np.ones((8, 8, 3), np.uint8), 2)])
  >>> x.shape, y.tolist()
  ((1, 8, 8, 3), [2])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from meshensemble.data.dataset import IMAGE_SHAPE, DataError

CODEC_NAME = "raw-v1"
"""The name of the generic codec in a manifest (``{"name": "raw-v1", ...}``)."""


@dataclasses.dataclass(frozen=True)
class RecordCodec:
    """The layout of one record: the target's raw bytes, then the features'.

    Attributes:
      x_shape: one example's feature shape, e.g. ``(28, 28, 1)``.
      x_dtype: its numpy dtype string, little-endian (``"|u1"``, ``"<f4"``).
      y_shape: one target's shape: ``()`` for a class id, ``(T,)`` for float targets.
      y_dtype: its stored dtype (``"|u1"`` or ``"<i4"`` for class ids, ``"<f4"``).

    Example:
      >>> MNIST_CODEC.record_bytes   # a label byte and 28x28 pixel bytes
      785
    """

    x_shape: tuple[int, ...]
    x_dtype: str
    y_shape: tuple[int, ...] = ()
    y_dtype: str = "|u1"

    @property
    def x_bytes(self) -> int:
        """Bytes of one example's features."""
        return int(np.prod(self.x_shape, dtype=np.int64)) * np.dtype(self.x_dtype).itemsize

    @property
    def y_bytes(self) -> int:
        """Bytes of one target."""
        return int(np.prod(self.y_shape, dtype=np.int64)) * np.dtype(self.y_dtype).itemsize

    @property
    def record_bytes(self) -> int:
        """Bytes of one record (target, then features)."""
        return self.x_bytes + self.y_bytes

    @property
    def class_ids(self) -> bool:
        """Whether the targets are class ids (an integer dtype)."""
        return bool(np.issubdtype(np.dtype(self.y_dtype), np.integer))

    def encode(self, x: Any, y: Any) -> bytes:
        """One record from one example's features ``x_shape`` and target ``y_shape``.

        Args:
          x: the features.
          y: the target.

        Returns:
          :attr:`record_bytes` bytes.

        Raises:
          DataError: ``x`` or ``y`` has another shape.

        Example:
          >>> len(MNIST_CODEC.encode(np.zeros((28, 28, 1), np.uint8), 7))
          785
        """
        x = np.asarray(x, np.dtype(self.x_dtype))
        y = np.asarray(y, np.dtype(self.y_dtype))
        if x.shape != tuple(self.x_shape) or y.shape != tuple(self.y_shape):
            raise DataError(
                f"record codec: an example of shape {x.shape} with a target of shape "
                f"{y.shape}; expected {tuple(self.x_shape)} and {tuple(self.y_shape)}"
            )
        return y.tobytes() + x.tobytes()

    def decode(self, records: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """Features and targets from raw records.

        Args:
          records: ``n`` records of :attr:`record_bytes` bytes.

        Returns:
          ``(x, y)``: ``[n, *x_shape]`` of ``x_dtype``, and ``[n]`` int32 class ids or
          ``[n, *y_shape]`` of ``y_dtype``.

        Raises:
          DataError: a record of another length.

        Example:
          >>> x, y = MNIST_CODEC.decode([bytes([3]) + bytes(784)])
          >>> x.shape, x.dtype, y.dtype
          ((1, 28, 28, 1), dtype('uint8'), dtype('int32'))
        """
        n, size = len(records), self.record_bytes
        bad = [len(r) for r in records if len(r) != size]
        if bad:
            raise DataError(
                f"records of {bad[0]} bytes; expected {size} ({self.describe()}): the files "
                "do not hold what their manifest says; write the dataset again"
            )
        raw = np.frombuffer(b"".join(records), np.uint8).reshape(n, size)
        y = raw[:, : self.y_bytes].copy().view(np.dtype(self.y_dtype)).reshape(n, *self.y_shape)
        x = raw[:, self.y_bytes :].copy().view(np.dtype(self.x_dtype)).reshape(n, *self.x_shape)
        return x, (y.astype(np.int32) if self.class_ids else y)

    def describe(self) -> str:
        """One phrase for messages, e.g. ``"a |u1 target and (28, 28, 1) |u1 features"``."""
        return (
            f"a {list(self.y_shape) or ''}{self.y_dtype} target and "
            f"{tuple(self.x_shape)} {self.x_dtype} features"
        )

    def record(self) -> dict[str, Any]:
        """The codec as ``manifest.json`` records it (JSON-able).

        Returns:
          ``{"name", "x_shape", "x_dtype", "y_shape", "y_dtype"}``.

        Example:
          >>> MNIST_CODEC.record()["name"]
          'raw-v1'
        """
        return {
            "name": CODEC_NAME,
            "x_shape": [int(d) for d in self.x_shape],
            "x_dtype": self.x_dtype,
            "y_shape": [int(d) for d in self.y_shape],
            "y_dtype": self.y_dtype,
        }


MNIST_CODEC = RecordCodec(tuple(IMAGE_SHAPE), "|u1", (), "|u1")
"""The records of MNIST folders (one label byte, then 28x28 uint8 pixels): what folders
written before codecs existed hold, and what :func:`codec_for` picks for MNIST's arrays."""


def codec_from_record(entry: Mapping[str, Any] | None) -> RecordCodec:
    """The codec a manifest records; :data:`MNIST_CODEC` for a manifest without one.

    Args:
      entry: the manifest's ``"codec"`` entry (:meth:`RecordCodec.record`), or None.

    Returns:
      The codec.

    Raises:
      DataError: an unknown codec name or a malformed entry (one line, the fix).

    Example:
      >>> codec_from_record(None) == MNIST_CODEC
      True
    """
    if entry is None:
        return MNIST_CODEC
    try:
        if entry["name"] != CODEC_NAME:
            raise ValueError(f"unknown codec {entry['name']!r} (this version reads {CODEC_NAME})")
        codec = RecordCodec(
            tuple(int(d) for d in entry["x_shape"]),
            np.dtype(entry["x_dtype"]).str,
            tuple(int(d) for d in entry["y_shape"]),
            np.dtype(entry["y_dtype"]).str,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise DataError(
            f"manifest codec {dict(entry)!r}: {err}; write the dataset again with this "
            "version (meshensemble convert ... --overwrite)"
        ) from None
    return codec


def codec_for(x: Any, y: Any, num_classes: int | None = None) -> RecordCodec:
    """The codec of a dataset's arrays: class ids below 256 in one byte, else as int32.

    Args:
      x: features ``[N, ...]`` (or anything with ``shape`` and ``dtype``).
      y: class ids ``[N]`` or float targets ``[N, T]``.
      num_classes: the number of classes (class ids fit one byte when at most 256).

    Returns:
      A :class:`RecordCodec`; for MNIST's uint8 ``[N, 28, 28, 1]`` images and ids 0..9 it
      is :data:`MNIST_CODEC` (the same bytes as before codecs existed).

    Example:
      >>> codec_for(np.zeros((2, 28, 28, 1), np.uint8), np.array([0, 9])) == MNIST_CODEC
      True
      >>> codec_for(np.zeros((2, 13), np.float32), np.zeros((2, 1), np.float32)).y_dtype
      '<f4'
    """
    y = np.asarray(y)
    x_dtype = np.dtype(x.dtype).newbyteorder("<").str
    if np.issubdtype(y.dtype, np.integer):
        top = num_classes if num_classes is not None else (int(y.max()) + 1 if y.size else 1)
        y_dtype = "|u1" if top <= 256 else "<i4"
        return RecordCodec(tuple(x.shape[1:]), x_dtype, (), y_dtype)
    return RecordCodec(tuple(x.shape[1:]), x_dtype, tuple(y.shape[1:]), "<f4")
