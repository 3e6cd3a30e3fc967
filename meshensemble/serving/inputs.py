"""New images for a trained run: a ``.npy`` array, a ``.npz`` file or a folder of images.

:func:`open_images` checks an input against the run's image shape and dtype and returns
an :class:`Images`: rows read only where sliced (a ``.npy`` is memory-mapped, a folder's
images are decoded a batch at a time), so a streamed prediction holds one batch of input
in memory. Nothing is resized or converted behind the user's back: another shape, dtype
or image mode is refused in one line naming the file and the fix.

Example:
  >>> from PIL import Image
  >>> os.makedirs("new_digits")
  >>> for name, pixels in zip(["a.png", "b.png", "c.png"], images[:3, :, :, 0]):
  ...     Image.fromarray(pixels).save(os.path.join("new_digits", name))
  >>> folder = open_images("new_digits/", (28, 28, 1), np.uint8)
  >>> len(folder), folder.names[:2], folder[0:2].shape
  (3, ['a.png', 'b.png'], (2, 28, 28, 1))
  >>> bool((folder[0:3] == images[:3]).all())   # PNG is lossless
  True
"""

from __future__ import annotations

import dataclasses
import os
import zipfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from meshensemble.runtime import storage

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
"""File name endings read from a folder (case-insensitive)."""
NPZ_IMAGE_KEYS = ("images", "x_test", "x")
"""Keys of a ``.npz`` input tried in this order for the images."""
NPZ_FEATURE_KEYS = ("x", "x_test", "features")
"""Keys of a ``.npz`` input tried in this order for a run's features ``[N, F]``."""
FINITE_CHECK_ROWS = 65536
"""Rows of float features checked for NaN/inf at a time (a memory map is read once)."""
GRAY_MODES = ("L", "1", "P")
"""Pillow modes accepted (and read as 8-bit grayscale) for a one-channel run: a palette
image (``P``) only when every pixel's palette colour is a grey, read through its palette."""
RGB_MODES = ("RGB", "P")
"""Pillow modes accepted (and read as 8-bit RGB, a palette image through its palette) for a
three-channel run."""


@dataclasses.dataclass(frozen=True)
class Images:
    """Images to predict, read where sliced: ``len(images)``, ``images[i:j]`` ``[k, *shape]``.

    Attributes:
      source: the path it came from.
      rows: ``[N, ...]`` array (a memory map for ``.npy``), or the sorted file paths of
        a folder.
      shape: one image's shape as the run takes it, e.g. ``(28, 28, 1)``.
      dtype: the run's dtype (``uint8``).
      names: a folder's file names (sorted), else None.
    """

    source: str
    rows: Any
    shape: tuple[int, ...]
    dtype: Any
    names: list[str] | None = None

    def __len__(self) -> int:
        """The number of images."""
        return len(self.rows)

    def __getitem__(self, index: slice) -> np.ndarray:
        """Images ``[k, *shape]`` of the run's dtype, read (or decoded) now."""
        if self.names is not None:
            return np.stack([_decode(p, self.shape) for p in self.rows[index]])
        return np.asarray(self.rows[index]).reshape((-1, *self.shape))


def open_images(path: str, shape: Sequence[int], dtype: Any) -> Images:
    """Opens ``path`` (``.npy``, ``.npz`` or a folder of PNG/JPEG) as images for a run.

    Args:
      path: a ``.npy`` array ``[N, H, W]`` or ``[N, H, W, C]``; a ``.npz`` whose images
        are under one of :data:`NPZ_IMAGE_KEYS`; or a folder of ``.png``/``.jpg``/``.jpeg``
        files (sorted by name; hidden files are skipped).
      shape: the run's image shape ``(H, W, C)``; ``[N, H, W]`` is accepted for ``C = 1``.
      dtype: the run's pixel dtype (e.g. ``np.uint8``); arrays must have exactly it.

    Returns:
      An :class:`Images`.

    Raises:
      FileNotFoundError: nothing at ``path``.
      ValueError: an empty or unreadable file, no images, a file in the folder that is not
        an image, another shape, dtype or image mode (one line naming it and the fix).

    Example:
      >>> np.save("x.npy", images)
      >>> open_images("x.npy", (28, 28, 1), np.uint8)[0:4].shape
      (4, 28, 28, 1)
    """
    shape, dtype = tuple(int(s) for s in shape), np.dtype(dtype)
    if not storage.exists(path):
        raise FileNotFoundError(
            f"--input {path}: no such file or folder; give a .npy, a .npz or a folder of images"
        )
    if storage.isdir(path):
        return _open_folder(path, shape, dtype)
    if storage.file_size(path) == 0:
        raise ValueError(f"--input {path} is an empty file; give a .npy or .npz of images")
    lower = path.lower()
    if lower.endswith(".npy"):
        rows = _load_npy(path)
    elif lower.endswith(".npz"):
        rows = _load_npz(path)
    else:
        raise ValueError(
            f"--input {path}: unknown kind of file; give a .npy array, a .npz file or a "
            "folder of PNG/JPEG images"
        )
    _check_array(f"--input {path}", rows, shape, dtype)
    return Images(path, rows, shape, dtype)


def as_images(images: Any, shape: Sequence[int], dtype: Any) -> Images:
    """``images`` (an array, a memory map, or :class:`Images`) checked as a run's input.

    Args:
      images: ``[N, H, W, C]``, or ``[N, H, W]`` for ``C = 1``.
      shape: the run's image shape ``(H, W, C)``.
      dtype: the run's pixel dtype.

    Returns:
      An :class:`Images` (an array is not copied; a ``jax.Array`` is brought to the host).

    Raises:
      ValueError: another shape or dtype, or no images.

    Example:
      >>> len(as_images(np.zeros((3, 28, 28), np.uint8), (28, 28, 1), np.uint8))
      3
    """
    shape, dtype = tuple(int(s) for s in shape), np.dtype(dtype)
    if isinstance(images, Images):
        if images.shape != shape or images.dtype != dtype:
            raise ValueError(
                f"images from {images.source} are {images.dtype} {list(images.shape)}; the run "
                f"takes {dtype} {list(shape)}"
            )
        return images
    rows = images if isinstance(images, np.ndarray) else np.asarray(images)
    _check_array("images", rows, shape, dtype)
    return Images("images", rows, shape, dtype)


def as_features(x: Any, features: int, where: str = "x") -> np.ndarray:
    """A run's features checked: a real ``[N, F]`` array (not copied, not cast).

    Args:
      x: ``[N, F]`` numbers (a numpy array, a memory map, anything ``np.asarray`` takes).
      features: the run's ``F``.
      where: names the input in messages.

    Returns:
      The array (rows are cast to float32 a batch at a time when streamed).

    Raises:
      ValueError: another shape, a non-numeric dtype, no rows, or a value that is NaN,
        infinite or beyond float32's range (one line naming its row and column).

    Example:
      >>> as_features(np.zeros((3, 1)), 1).shape
      (3, 1)
    """
    rows = x if isinstance(x, np.ndarray) else np.asarray(x)
    if rows.ndim != 2 or rows.shape[1] != features:
        raise ValueError(
            f"{where} of shape {list(rows.shape)}: the run takes features [N, {features}]"
        )
    if not (np.issubdtype(rows.dtype, np.floating) or np.issubdtype(rows.dtype, np.integer)):
        raise ValueError(f"{where} of dtype {rows.dtype}: give real numbers (e.g. float32)")
    if len(rows) == 0:
        raise ValueError(f"{where} holds no rows (shape {list(rows.shape)}); give at least one")
    if np.issubdtype(rows.dtype, np.floating):
        _check_finite(rows, where)
    return rows


def _check_finite(rows: np.ndarray, where: str) -> None:
    """Refuses the first NaN, inf or value float32 cannot hold (it would predict NaN)."""
    top = float(np.finfo(np.float32).max)
    for start in range(0, len(rows), FINITE_CHECK_ROWS):
        block = np.asarray(rows[start : start + FINITE_CHECK_ROWS])
        with np.errstate(invalid="ignore"):
            bad = ~(np.abs(block) <= top)  # NaN compares False
        if bad.any():
            i, j = (int(v) for v in np.argwhere(bad)[0])
            value = block[i, j]
            what = "beyond float32's range" if np.isfinite(value) else "not finite"
            raise ValueError(
                f"{where} holds {value} ({what}) at row {start + i}, column {j}; give finite "
                "features (drop or impute that row)"
            )


def open_features(path: str, features: int) -> np.ndarray:
    """A run's new features from a ``.npy`` (memory-mapped) or ``.npz`` file.

    Args:
      path: a ``.npy`` of ``[N, F]`` numbers, or a ``.npz`` holding one under a key of
        :data:`NPZ_FEATURE_KEYS` (``x``, ``x_test`` or ``features``).
      features: the run's ``F``.

    Returns:
      The ``[N, F]`` array (a memory map for ``.npy``).

    Raises:
      ValueError: a missing or unreadable file, another suffix, shape or dtype (one line).

    Example:
      >>> np.save("new.npy", np.zeros((5, 10), np.float32))
      >>> open_features("new.npy", 10).shape
      (5, 10)
    """
    if not storage.isfile(path):
        raise ValueError(f"--input {path}: no such file; give a .npy or .npz of [N, {features}]")
    kind = os.path.splitext(path)[1].lower()
    if kind not in (".npy", ".npz"):
        raise ValueError(f"--input {path}: give a .npy or .npz of features [N, {features}]")
    rows = _load_npy(path) if kind == ".npy" else _load_npz(path, NPZ_FEATURE_KEYS)
    return as_features(rows, features, f"--input {path}")


def as_inputs(x: Any, shape: Sequence[int], dtype: Any) -> Any:
    """A run's input checked: images of integer pixels (:func:`as_images`), else features.

    Args:
      x: the inputs ``[N, ...]``.
      shape: one example's shape in the run; dtype: the run's input dtype.

    Returns:
      An :class:`Images` (integer pixels) or the ``[N, F]`` array (float features).

    Raises:
      ValueError: another shape or dtype, or no rows (one line).

    Example:
      >>> as_inputs(np.zeros((3, 2)), (2,), np.float32).shape
      (3, 2)
    """
    if np.issubdtype(np.dtype(dtype), np.integer) or len(shape) != 1:
        return as_images(x, shape, dtype)
    return as_features(x, int(shape[0]))


def open_inputs(path: str, shape: Sequence[int], dtype: Any) -> Any:
    """A run's new inputs from ``path``: :func:`open_images` for images, else
    :func:`open_features` (float features ``[N, F]``).

    Example:
      >>> np.save("new.npy", np.zeros((5, 10), np.float32))
      >>> open_inputs("new.npy", (10,), np.float32).shape
      (5, 10)
    """
    if np.issubdtype(np.dtype(dtype), np.integer) or len(shape) != 1:
        return open_images(path, shape, dtype)
    return open_features(path, int(shape[0]))


def _load_npy(path: str) -> np.ndarray:
    try:
        mmap = "r" if storage.is_local(path) else None  # a bucket's file: read whole
        return np.load(storage.openable(path), mmap_mode=mmap, allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:
        raise ValueError(f"--input {path}: not a readable .npy array ({_first(err)})") from None


def _load_npz(path: str, keys: Sequence[str] = NPZ_IMAGE_KEYS) -> np.ndarray:
    try:
        with np.load(storage.openable(path), allow_pickle=False) as npz:
            key = next((k for k in keys if k in npz.files), None)
            if key is None:
                raise ValueError(
                    f"--input {path} has keys {sorted(npz.files)} but none of "
                    f"{', '.join(keys)}; save the inputs under the key {keys[0]!r}"
                )
            return npz[key]
    except (OSError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError(f"--input {path}: not a readable .npz file ({_first(err)})") from None


def _first(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text[:200] or type(err).__name__


def _check_array(where: str, rows: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> None:
    ok = rows.shape[1:] == shape or (shape[-1] == 1 and rows.shape[1:] == shape[:-1])
    want = f"[N, {', '.join(map(str, shape))}]"
    if shape[-1] == 1:
        want += f" or [N, {', '.join(map(str, shape[:-1]))}]"
    if rows.ndim < 1 or not ok:
        raise ValueError(
            f"{where} of shape {list(rows.shape)}: the run takes {want} "
            "(nothing is resized: resize the images first)"
        )
    if rows.dtype != dtype:
        unit = (
            np.issubdtype(rows.dtype, np.floating)
            and np.issubdtype(dtype, np.integer)
            and rows.size > 0
            and float(np.nanmax(np.abs(rows))) <= 1.0
        )
        fix = (
            f"pixels in [0, 1]: convert with (images * 255).round().astype(np.{dtype})"
            if unit
            else f"pixels 0..255: convert with images.astype(np.{dtype})"
        )
        raise ValueError(
            f"{where} of dtype {rows.dtype}: the run takes {dtype} images as it trained on ({fix})"
        )
    if len(rows) == 0:
        raise ValueError(f"{where} holds no images (shape {list(rows.shape)}); give at least one")


def _open_folder(path: str, shape: tuple[int, ...], dtype: np.dtype) -> Images:
    from PIL import Image, UnidentifiedImageError

    names = sorted(n for n in storage.listdir(path) if not n.startswith("."))
    other = [n for n in names if not n.lower().endswith(IMAGE_SUFFIXES)]
    if other:
        raise ValueError(
            f"--input {path} holds {other[0]!r}, not a PNG/JPEG image; the folder must hold "
            "only .png/.jpg/.jpeg files (move the others out)"
        )
    if not names:
        raise ValueError(f"--input {path}: the folder holds no PNG/JPEG images")
    if dtype != np.uint8 or shape[-1] not in (1, 3):
        raise ValueError(f"--input {path}: a folder of images needs a uint8 run, not {dtype}")
    files = [storage.join(path, n) for n in names]
    for name, file in zip(names, files):
        try:
            with Image.open(storage.openable(file)) as img:
                size, mode = (img.height, img.width), img.mode
                colour = mode == "P" and shape[-1] == 1 and not _grey_palette(img)
        except (OSError, UnidentifiedImageError) as err:
            raise ValueError(
                f"--input {path}: {name} is not a readable image ({_first(err)})"
            ) from None
        _check_image(f"{path}/{name}", size, "P (colour palette)" if colour else mode, shape)
    return Images(path, files, shape, dtype, names)


def _check_image(where: str, size: tuple[int, int], mode: str, shape: tuple[int, ...]) -> None:
    if size != shape[:2]:
        raise ValueError(
            f"--input {where} is {size[0]}x{size[1]} (height x width); the run takes "
            f"{shape[0]}x{shape[1]} images (nothing is resized: resize it first)"
        )
    modes = GRAY_MODES if shape[-1] == 1 else RGB_MODES
    if mode not in modes:
        what = "grayscale" if shape[-1] == 1 else "RGB"
        raise ValueError(
            f"--input {where} has image mode {mode}; the run takes {what} images (convert it "
            f"to {what} first)"
        )


def _grey_palette(img: Any) -> bool:
    """Whether every pixel of a palette image has a grey colour (red = green = blue)."""
    rgb = np.asarray(img.convert("RGB"))
    return bool((rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all())


def _decode(file: str, shape: tuple[int, ...]) -> np.ndarray:
    from PIL import Image

    with Image.open(storage.openable(file)) as img:
        pixels = np.asarray(img.convert("L" if shape[-1] == 1 else "RGB"), np.uint8)
    return pixels.reshape(shape)
