"""Keras-style ``mnist.npz`` files: :func:`load_npz` reads one, :func:`save_npz` writes one."""

from __future__ import annotations

import os
import zipfile
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from meshensemble.data.dataset import (
    FULL_SIZES,
    PRETTY_NAMES,
    DataError,
    Dataset,
    check_name,
    first_line,
    split_counts,
    validate,
)
from meshensemble.runtime import storage

NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")
"""Keys of a Keras-style ``mnist.npz`` (images ``[N, 28, 28]`` uint8, labels ``[N]``)."""


def save_npz(dataset: Dataset, path: str | os.PathLike[str]) -> str:
    """Writes ``dataset`` as a Keras-layout ``.npz`` that :func:`load_npz_dataset` reads back.

    The features are written as they are, except that integer images with one channel
    ``[N, H, W, 1]`` are written ``[N, H, W]`` as in Keras's ``mnist.npz`` (the loaders add
    the channel back); class ids are written as ``uint8`` when they fit, float targets as
    they are, and the class names (when the dataset has them) as ``class_names``.

    Args:
      dataset: the data to write.
      path: the file to write (local or a ``gs://`` object).

    Returns:
      The path written, as a string.

    Example:
      >>> me.data.save_npz(me.data.synthetic(), "tiny.npz")
      'tiny.npz'
      >>> wine = me.data.Dataset("wine", np.ones((6, 13), np.float32), np.arange(6) % 3,
      ...                        np.ones((3, 13), np.float32), np.arange(3))
      >>> load_npz_dataset(save_npz(wine, "wine.npz")).x_train.shape
      (6, 13)
    """

    def features(x: np.ndarray) -> np.ndarray:
        one_channel = x.ndim == 4 and x.shape[-1] == 1 and np.issubdtype(x.dtype, np.integer)
        return x[..., 0] if one_channel else x

    def targets(y: np.ndarray) -> np.ndarray:
        ids = np.issubdtype(y.dtype, np.integer) and (y.size == 0 or 0 <= y.min() <= y.max() < 256)
        return y.astype(np.uint8) if ids else y

    arrays = dict(
        x_train=features(dataset.x_train),
        y_train=targets(dataset.y_train),
        x_test=features(dataset.x_test),
        y_test=targets(dataset.y_test),
    )
    if dataset.class_names is not None:
        arrays["class_names"] = np.asarray(dataset.class_names, dtype=str)
    storage.atomic_write(path, lambda f: np.savez(f, **arrays))
    return os.fspath(path)


def load_npz(path: str | os.PathLike[str], name: str = "mnist") -> Dataset:
    """Loads a dataset from an ``.npz`` file in the layout of Keras's ``mnist.npz``.

    The file holds ``x_train [N, 28, 28] uint8``, ``y_train [N]``, ``x_test [M, 28, 28]``
    and ``y_test [M]`` (see :data:`NPZ_KEYS`); images may also be ``[N, 28, 28, 1]``.
    It is read with ``allow_pickle=False``.

    Args:
      path: the ``.npz`` file (``~`` is expanded).
      name: the dataset it holds, one of :data:`DATASETS` (recorded in the result).

    Returns:
      A :class:`Dataset` with ``source="npz"``: uint8 images ``[N, 28, 28, 1]`` and int32
      labels ``[N]`` per split.

    Raises:
      DataError: (one line, naming the file) if ``name`` is unknown, the file is missing,
        is not an npz archive or is corrupt or truncated, lacks a key, or holds arrays of
        the wrong shape, dtype or label range.

    Example:
      >>> ds = load_npz("mnist.npz")   # e.g. Keras's ~/.keras/datasets/mnist.npz
      >>> ds.train_images.shape, ds.test_labels.shape
      ((96, 28, 28, 1), (32,))
    """
    check_name(name)
    file = os.path.expanduser(os.fspath(path))
    if not storage.exists(file):
        raise DataError(
            f"{file}: file not found (pass the path of a Keras-style mnist.npz with keys "
            f"{', '.join(NPZ_KEYS)}, or use --source tfds / sample)"
        )
    if storage.isdir(file):
        raise DataError(f"{file}: is a directory (pass the path of the .npz file itself)")
    try:
        head = next(storage.read_blocks(file, 6), b"")
    except OSError as e:
        raise DataError(f"{file}: cannot be read ({type(e).__name__}: {first_line(e)})") from e
    if head.startswith(b"\x93NUMPY"):
        raise DataError(
            f"{file}: is a single .npy array, not an .npz archive (save the splits "
            f"with np.savez(path, {'=..., '.join(NPZ_KEYS)}=...))"
        )
    if not head.startswith(b"PK"):
        raise DataError(
            f"{file}: not an .npz archive (it does not start like a zip file; expected a "
            "Keras-style mnist.npz written by np.savez)"
        )

    def pick(loaded: Any) -> dict[str, np.ndarray]:
        missing = [k for k in NPZ_KEYS if k not in loaded.files]
        if missing:
            found = ", ".join(loaded.files) or "none"
            noun = "key" if len(missing) == 1 else "keys"
            raise DataError(
                f"{file}: {noun} {', '.join(repr(k) for k in missing)} missing "
                f"(found {found}; expected keys {', '.join(NPZ_KEYS)} as in Keras's "
                "mnist.npz)"
            )
        return {key: loaded[key] for key in NPZ_KEYS}

    arrays = _load(file, pick)
    train = validate(arrays["x_train"], arrays["y_train"], f"{file} (x_train, y_train)")
    test = validate(arrays["x_test"], arrays["y_test"], f"{file} (x_test, y_test)")
    full = "full " if (len(train[1]), len(test[1])) == FULL_SIZES else ""
    note = f"{full}{PRETTY_NAMES[name]} from {file} ({split_counts(train[1], test[1])})"
    return Dataset(name, *train, *test, source="npz", note=note)


def load_npz_dataset(
    path: str | os.PathLike[str],
    name: str | None = None,
    *,
    num_classes: int | None = None,
    class_names: Sequence[str] | None = None,
) -> Dataset:
    """Loads any dataset from an ``.npz`` in the Keras layout: any shapes and dtypes.

    The file holds ``x_train``, ``y_train``, ``x_test``, ``y_test`` (:data:`NPZ_KEYS`):
    features ``[N, ...]`` of any shape (images ``[N, H, W, C]``, or integer ``[N, H, W]`` as
    one channel; tabular ``[N, F]``) and targets that are integer class ids ``[N]`` or
    float targets ``[N]`` / ``[N, T]`` (``[N]`` becomes ``[N, 1]``). An optional
    ``class_names`` array of strings names the classes. It is read with
    ``allow_pickle=False``.

    Args:
      path: the ``.npz`` file (``~`` is expanded).
      name: the dataset's name (default: the file's stem); a name of
        :data:`~meshensemble.data.DATASETS` gets MNIST's checks.
      num_classes: the number of classes (default: the file's ``class_names``, else the
        largest id + 1).
      class_names: the class names (default: the file's ``class_names``, if any).

    Returns:
      A :class:`Dataset` with ``source="npz"``.

    Raises:
      DataError: (one line, naming the file) a missing, unreadable or pickled file, a
        missing key, or arrays the :class:`Dataset` refuses (naming the array, its shape
        and the expected one).

    Example:
      >>> x = np.zeros((10, 8, 8), np.uint8)   # 8x8 grayscale digits, 3 classes
      >>> np.savez("digits.npz", x_train=x[:6], y_train=np.arange(6) % 3, x_test=x[6:],
      ...          y_test=np.arange(4) % 3)
      >>> ds = load_npz_dataset("digits.npz")
      >>> ds.name, ds.input_shape, ds.num_classes
      ('digits', (8, 8, 1), 3)
    """
    file = os.path.expanduser(os.fspath(path))
    arrays = _read_npz(file, optional=("class_names",))
    name = name or os.path.splitext(os.path.basename(file))[0]
    if class_names is None and "class_names" in arrays:
        class_names = tuple(str(n) for n in arrays["class_names"])
    if num_classes is None and class_names is not None:
        num_classes = len(class_names)
    out = {}
    for key in NPZ_KEYS:
        a = arrays[key]
        if key.startswith("x"):
            a = _with_channel(a)
        if key.startswith("y") and a.ndim == 1 and np.issubdtype(a.dtype, np.floating):
            a = a[:, None]  # [N] float targets: one target
        out[key] = a
    note = f"{name} from {file} ({split_counts(out['y_train'], out['y_test'])})"
    return Dataset(
        name, **out, source="npz", note=note, num_classes=num_classes, class_names=class_names
    )


def _with_channel(x: np.ndarray) -> np.ndarray:
    """Integer ``[N, H, W]`` images get one channel; anything else is as it is."""
    return x[..., None] if x.ndim == 3 and np.issubdtype(x.dtype, np.integer) else x


_INPUT_KEYS = ("x_test", "images", "x")  # load_npz_inputs reads the first it finds


def load_npz_inputs(path: str | os.PathLike[str]) -> tuple[np.ndarray, str]:
    """The inputs of an ``.npz`` that holds inputs alone (or the test inputs of a dataset).

    For out-of-distribution sets: a file with ``x_test`` (the Keras layout, or that key
    alone), else ``images``, else ``x``; integer ``[N, H, W]`` images get one channel, as
    :func:`load_npz_dataset` gives them.

    Args:
      path: the ``.npz`` file (local or a ``gs://`` object; ``~`` is expanded).

    Returns:
      ``(x, note)``: the inputs ``[N, ...]`` and a one-line note naming the file and key.

    Raises:
      DataError: (one line, naming the file) a missing or unreadable file, or none of
        those keys in it.

    Example:
      >>> np.savez("shifted.npz", images=np.zeros((5, 8, 8), np.uint8))
      >>> x, note = load_npz_inputs("shifted.npz")
      >>> x.shape, note
      ((5, 8, 8, 1), 'shifted.npz: images [5, 8, 8, 1] uint8')
    """
    file = os.path.expanduser(os.fspath(path))
    if not storage.exists(file) or storage.isdir(file):
        what = "is a directory" if storage.exists(file) else "no such file"
        raise DataError(
            f"{file}: {what} (pass an .npz with inputs under one of the keys "
            f"{', '.join(_INPUT_KEYS)})"
        )

    def pick(loaded: Any) -> dict[str, np.ndarray]:
        key = next((k for k in _INPUT_KEYS if k in getattr(loaded, "files", ())), None)
        if key is None:
            found = ", ".join(getattr(loaded, "files", ())) or "none"
            raise DataError(
                f"{file}: no inputs (found keys {found}; expected one of "
                f"{', '.join(_INPUT_KEYS)}, e.g. np.savez(path, x_test=inputs))"
            )
        return {key: np.asarray(loaded[key])}

    (key, x), = _load(file, pick).items()
    x = _with_channel(x)
    shape = ", ".join(str(d) for d in x.shape)
    return x, f"{file}: {key} [{shape}] {x.dtype}"


def _read_npz(file: str, optional: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """The arrays :data:`NPZ_KEYS` (and ``optional`` ones present) of an npz file."""
    if not storage.exists(file):
        raise DataError(
            f"{file}: file not found (pass the path of an npz with keys {', '.join(NPZ_KEYS)})"
        )
    if storage.isdir(file):
        raise DataError(f"{file}: is a directory (pass the path of the .npz file itself)")

    def pick(loaded: Any) -> dict[str, np.ndarray]:
        if not hasattr(loaded, "files"):
            raise DataError(
                f"{file}: is a single .npy array, not an .npz archive (save the splits "
                f"with np.savez(path, {'=..., '.join(NPZ_KEYS)}=...))"
            )
        missing = [k for k in NPZ_KEYS if k not in loaded.files]
        if missing:
            raise DataError(
                f"{file}: key(s) {', '.join(repr(k) for k in missing)} missing (found "
                f"{', '.join(loaded.files) or 'none'}; expected {', '.join(NPZ_KEYS)})"
            )
        keys = (*NPZ_KEYS, *(k for k in optional if k in loaded.files))
        return {key: np.asarray(loaded[key]) for key in keys}

    return _load(file, pick)


def _load(file: str, pick: Callable[[Any], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """``pick(the opened npz)``; a file numpy cannot load is a one-line DataError."""
    try:
        with np.load(storage.openable(file), allow_pickle=False) as loaded:
            return pick(loaded)
    except DataError:
        raise
    except ValueError as e:
        if "pickle" not in str(e):
            raise _npz_corrupt(file, e) from e
        raise DataError(
            f"{file}: holds object (pickled) arrays, which are not loaded for safety "
            f"(allow_pickle=False); store numeric arrays {', '.join(NPZ_KEYS)} with np.savez"
        ) from e
    except (zipfile.BadZipFile, zlib.error, OSError, EOFError, KeyError) as e:
        raise _npz_corrupt(file, e) from e


def _npz_corrupt(file: str, error: BaseException) -> DataError:
    return DataError(
        f"{file}: corrupt or truncated .npz archive ({type(error).__name__}: "
        f"{first_line(error)}); download or write it again (np.savez with keys "
        f"{', '.join(NPZ_KEYS)})"
    )


def npz_fix(name: str) -> str:
    """The command-line fix that points at a local npz file, for error messages.

    Args:
      name: the dataset's name.

    Returns:
      E.g. ``"--source npz --data-file PATH/mnist.npz"``.

    Example:
      >>> npz_fix("fashion_mnist")
      '--source npz --data-file PATH/fashion_mnist.npz'
    """
    return f"--source npz --data-file PATH/{name}.npz"
