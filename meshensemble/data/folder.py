"""An image folder in the usual layout: ``ROOT/train/<class>/*.png`` and ``ROOT/test/<class>/...``.

:func:`load_image_folder` reads every image of both splits into uint8 ``[N, H, W, C]``
arrays, as the images are (RGB stays 3 channels, grayscale 1, RGBA 4; palette images are
read as RGB). The class names are the sorted subfolder names of ``train/``, and a class's
id is its place in that order (recorded as the dataset's ``class_names``). Every image
must have one size and one channel count; a file of another is refused by name, as is a
class in ``test/`` that ``train/`` does not have. Nothing is written.

Example:
  >>> from PIL import Image
  >>> for split, n in (("train", 3), ("test", 1)):
  ...     for cls in ("cat", "dog"):
  ...         os.makedirs(f"pets/{split}/{cls}")
  ...         for i in range(n):
  ...             Image.new("RGB", (8, 6)).save(f"pets/{split}/{cls}/{i}.png")
  >>> ds = load_image_folder("pets")
  >>> ds.x_train.shape, ds.class_names, ds.y_test.tolist()
  ((6, 6, 8, 3), ('cat', 'dog'), [0, 1])
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from meshensemble.data.dataset import DataError, Dataset, first_line, split_counts
from meshensemble.runtime import storage

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
"""File endings read as images (any case); other files in a class folder are skipped."""
SPLITS = ("train", "test")
"""The split folders under the root."""


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError as err:  # Pillow comes with matplotlib, a dependency
        raise DataError(
            f"reading an image folder needs Pillow ({err}); pip install pillow"
        ) from None
    return Image


def list_images(root: str | os.PathLike) -> dict[str, list[tuple[str, str]]]:
    """The image files of each split, as ``(path, class name)`` in class then file order.

    Args:
      root: the folder holding ``train/`` and ``test/``.

    Returns:
      ``{"train": [(path, class)], "test": [...]}``, classes and files sorted by name.

    Raises:
      DataError: a missing split folder, a split without class folders, a class folder
        without images, or a test class that train does not have (one line naming it).

    Example:
      >>> from PIL import Image
      >>> for split in ("train", "test"):
      ...     os.makedirs(f"digits/{split}/7")
      ...     Image.new("L", (4, 4)).save(f"digits/{split}/7/a.png")
      >>> [os.path.relpath(p) for p, _ in list_images("digits")["test"]]
      ['digits/test/7/a.png']
    """
    root = os.path.expanduser(os.fspath(root))
    if not storage.isdir(root):
        raise DataError(
            f"{root}: no such folder; pass a folder holding train/<class>/*.png and "
            "test/<class>/*.png"
        )
    out: dict[str, list[tuple[str, str]]] = {}
    for split in SPLITS:
        where = storage.join(root, split)
        if not storage.isdir(where):
            raise DataError(
                f"{where}: missing; an image folder holds {' and '.join(SPLITS)} folders, "
                "each with one subfolder of images per class"
            )
        classes = _listed(where, storage.isdir)
        if not classes:
            raise DataError(
                f"{where}: no class folders; put each class's images in {where}/<class>/"
            )
        out[split] = []
        for cls in classes:
            folder = storage.join(where, cls)
            files = _listed(folder, lambda path: path.lower().endswith(IMAGE_EXTENSIONS))
            if not files and split == "train":
                raise DataError(
                    f"{folder}: no images ({', '.join(IMAGE_EXTENSIONS)}); a class needs "
                    "training images (remove the folder, or add its images)"
                )
            out[split] += [(storage.join(folder, f), cls) for f in files]
    known = {c for _, c in out["train"]}
    unknown = sorted({c for _, c in out["test"]} - known)
    if unknown:
        raise DataError(
            f"{os.path.join(root, 'test', unknown[0])}: class {unknown[0]!r} is not among the "
            f"train classes ({', '.join(sorted(known))}); rename or remove it, or add its "
            "training images"
        )
    if not out["test"]:
        raise DataError(f"{os.path.join(root, 'test')}: no images; the test split needs some")
    return out


def _listed(folder: str, keep: Callable[[str], bool]) -> list[str]:
    """The names in ``folder``, sorted, that are not hidden and whose path ``keep`` accepts."""
    names = (n for n in storage.listdir(folder) if not n.startswith("."))
    return sorted(n for n in names if keep(storage.join(folder, n)))


def read_image(path: str) -> np.ndarray:
    """One image file as uint8 ``[H, W, C]``, its channels as stored (palette: RGB).

    Args:
      path: a PNG or JPEG file.

    Returns:
      uint8 ``[H, W, C]`` (C: 1 grayscale, 2 grayscale + alpha, 3 RGB, 4 RGBA).

    Raises:
      DataError: the file cannot be read as an 8-bit image (one line naming it).

    Example:
      >>> from PIL import Image
      >>> Image.new("L", (5, 3)).save("g.png")
      >>> read_image("g.png").shape
      (3, 5, 1)
    """
    image_lib = _pil()
    try:
        with image_lib.open(storage.openable(path)) as img:
            if img.mode == "P":
                img = img.convert("RGBA" if "transparency" in img.info else "RGB")
            elif img.mode == "1":
                img = img.convert("L")
            if img.mode not in ("L", "LA", "RGB", "RGBA"):
                raise DataError(
                    f"{path}: an image of mode {img.mode!r}; expected 8-bit grayscale or "
                    "colour (L, LA, RGB, RGBA): convert it first"
                )
            array = np.asarray(img, np.uint8)
    except DataError:
        raise
    except Exception as err:  # PIL's UnidentifiedImageError, a truncated file, ...
        raise DataError(
            f"{path}: not a readable image ({type(err).__name__}: {first_line(err)})"
        ) from None
    return array[..., None] if array.ndim == 2 else array


def load_image_folder(root: str | os.PathLike, name: str | None = None) -> Dataset:
    """Reads an image folder ``ROOT/{train,test}/<class>/*.{png,jpg,jpeg}`` into a Dataset.

    Args:
      root: the folder (``~`` is expanded).
      name: the dataset's name (default: the folder's name).

    Returns:
      A :class:`Dataset` with ``source="folder"``: uint8 images ``[N, H, W, C]`` as
      stored, int32 class ids (the sorted class folder names of ``train/``, recorded as
      ``class_names``; a class may have no test images).

    Raises:
      DataError: one line naming the folder or file: a missing split folder, an empty
        class, a test class unknown to train, an unreadable file, or an image of another
        size or channel count than the first one (every image must have one size).

    Example:
      >>> from PIL import Image
      >>> for split in ("train", "test"):
      ...     for cls in ("a", "b"):
      ...         os.makedirs(f"shapes/{split}/{cls}")
      ...         Image.new("L", (4, 4)).save(f"shapes/{split}/{cls}/0.png")
      >>> load_image_folder("shapes").num_classes
      2
    """
    root = os.path.expanduser(os.fspath(root))
    files = list_images(root)
    classes = sorted({c for _, c in files["train"]})
    ids = {c: i for i, c in enumerate(classes)}
    first, shape = files["train"][0][0], None
    images: dict[str, np.ndarray] = {}
    for split in SPLITS:
        rows = []
        for path, _ in files[split]:
            image = read_image(path)
            shape = shape or image.shape  # the first train image's size: every image's
            if image.shape != shape:
                raise DataError(
                    f"{path}: a {'x'.join(map(str, image.shape))} image; expected "
                    f"{'x'.join(map(str, shape))} like {first} (every image must have one "
                    "size and channel count: resize or convert them first)"
                )
            rows.append(image)
        images[split] = np.stack(rows)
    labels = {s: np.asarray([ids[c] for _, c in files[s]], np.int32) for s in SPLITS}
    name = name or os.path.basename(os.path.normpath(root))
    h, w, c = images["train"].shape[1:]
    note = (
        f"{name} from image folder {root} ({split_counts(labels['train'], labels['test'])}; "
        f"{len(classes)} classes, {h}x{w}x{c})"
    )
    return Dataset(
        name,
        images["train"],
        labels["train"],
        images["test"],
        labels["test"],
        source="folder",
        note=note,
        num_classes=len(classes),
        class_names=classes,
    )
