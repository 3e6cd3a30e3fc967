"""TFDS's prepared data with a lazy train split: ``--source tfds --input stream``.

:func:`load_tfds_stream` opens any TFDS dataset with an image and a label feature (MNIST,
Fashion-MNIST, ``cifar10``, ``svhn_cropped`` ...) through ``tfds.data_source``: the train
images stay in TFDS's files and are read a batch at a time
(:class:`~meshensemble.data.lazy.SourceImages` over a
:class:`~meshensemble.data.stream.TfdsSource`), the train labels are read once (the
records decoded without their images where TFDS allows it), the test split is read whole.
Nothing is downloaded: prepare the data first (one run with ``--source tfds``).

Example:
  >>> ds = load_tfds_stream("cifar10")  # doctest: +SKIP
  >>> ds.input_shape, me.data.is_lazy(ds)  # doctest: +SKIP
  ((32, 32, 3), True)
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from meshensemble.data import tfds as tfds_lib
from meshensemble.data.dataset import (
    DATASETS,
    IMAGE_SHAPE,
    PRETTY_NAMES,
    DataError,
    Dataset,
    first_line,
    split_counts,
)
from meshensemble.data.lazy import SourceImages
from meshensemble.data.stream import TfdsSource

LABEL_CHUNK = 1000
"""Train records read per batched read of the labels."""


def load_tfds_stream(name: str, data_dir: str | os.PathLike | None = None) -> Dataset:
    """Opens TFDS's prepared data with a lazy train split (``tfds.data_source``).

    MNIST and Fashion-MNIST are read as they always were (``image`` and ``label``, 28x28x1,
    MNIST's checks and note); any other name takes its image and label features, the
    image shape, the number of classes and their names from the dataset's info
    (:func:`meshensemble.data.tfds.image_label_features`) and its splits from
    :func:`meshensemble.data.tfds.default_splits`.

    Args:
      name: a TFDS name with one image and one label feature.
      data_dir: TFDS's data directory (default ``$TFDS_DATA_DIR`` or
        ``~/tensorflow_datasets``).

    Returns:
      A :class:`~meshensemble.data.Dataset` with ``source="tfds"`` and a lazy train split.

    Raises:
      DataError: the data is not prepared (ArrayRecord format), TFDS fails, the dataset
        has not one image and one label feature, or its images vary in size (one line).

    Example:
      >>> ds = load_tfds_stream("mnist")  # doctest: +SKIP
    """
    mnist = name in DATASETS
    tfds, (train, test) = tfds_lib.open_data_sources(name, data_dir)  # DataError: not prepared
    where = f"TFDS {name} in {data_dir or 'the default data_dir'}"
    spec = _spec(tfds, train, where, mnist)
    if None in spec["shape"]:
        raise DataError(
            f"{where}: images of varying size {spec['shape']} cannot be streamed; resize them "
            "into an image folder (--source folder) or an npz first"
        )
    try:
        labels = _train_labels(tfds, name, data_dir, spec)
    except Exception as e:
        raise DataError(f"{where}: reading the train labels failed ({first_line(e)})") from e
    _, (train, test) = tfds_lib.open_data_sources(name, data_dir)  # opened after: as prepared
    keys = dict(image_key=spec["image_key"], label_key=spec["label_key"])
    test_images, test_labels = TfdsSource(test, spec["shape"], **keys).read(np.arange(len(test)))
    what = PRETTY_NAMES[name] if mnist else name
    note = f"{what} from TFDS ({split_counts(labels, test_labels)}; train split read lazily)"
    train_source = TfdsSource(train, spec["shape"], **keys)
    train_source.content_id = tfds_lib.split_content_id(train)  # its files, hashed per host
    classes = {} if mnist else {k: spec[k] for k in ("num_classes", "class_names")}
    return Dataset(
        name, SourceImages(train_source), labels, test_images, test_labels, source="tfds",
        note=note, **classes,
    )  # fmt: skip


def _spec(tfds: Any, train: Any, where: str, mnist: bool) -> dict[str, Any]:
    """The image and label features: MNIST's fixed ones, else from the dataset's info."""
    if mnist:
        return {"image_key": "image", "label_key": "label", "shape": tuple(IMAGE_SHAPE)}
    info = getattr(train, "dataset_info", None)
    spec = tfds_lib.image_label_features(tfds, info, None, None, where)
    shape = tuple(spec["shape"])
    return {**spec, "shape": (*shape, 1) if len(shape) == 2 else shape}


def _train_labels(tfds: Any, name: str, data_dir: Any, spec: dict[str, Any]) -> np.ndarray:
    """All train labels, from records whose images are left undecoded where possible."""
    image, label = spec["image_key"], spec["label_key"]
    where = os.path.expanduser(os.fspath(data_dir)) if data_dir is not None else None
    records = None
    try:  # the images' bytes are read but not decoded; where TFDS cannot: decode them
        skipping = tfds.data_source(
            name, split="train", data_dir=where, decoders={image: tfds.decode.SkipDecoding()}
        )
        if len(skipping):
            int(tfds_lib.read_records(skipping, [0])[0][label])
        records = skipping
    except Exception:  # e.g. tfds.testing.mock_data's generated records: decode them
        records = tfds.data_source(name, split="train", data_dir=where)
    out = []
    for start in range(0, len(records), LABEL_CHUNK):
        idx = list(range(start, min(start + LABEL_CHUNK, len(records))))
        out.extend(int(r[label]) for r in tfds_lib.read_records(records, idx))
    return np.asarray(out, np.int32)
