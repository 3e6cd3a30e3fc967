"""A training split that stays in its files: read a batch at a time, never loaded whole.

For ``meshensemble train --input stream`` on data that does not fit in a host's memory,
a :class:`Dataset`'s ``train_images`` may be a :class:`SourceImages`: it looks like the
uint8 ``[N, 28, 28, 1]`` array (``len``, ``shape``, ``dtype``, ``ndim``, indexing with an
int, a slice or an int array) but reads each example through a random-access source
(:mod:`meshensemble.data.stream`) only when indexed, and ``np.asarray`` of it raises a
:class:`DataError` (a whole load is a bug). The labels stay a real int32 array (4 bytes
an example) and the test split is read whole (10,000 examples for MNIST).

Files for pods (shared storage every host reads): :func:`write_array_record_dataset`
writes ``train.array_record`` (or shards ``train.array_record-0000i-of-0000n``),
``test.array_record`` and ``labels.npz`` (the labels of both splits, so they need not be
read record by record); :func:`load_array_record_dataset` opens them (``--source
arrayrecord --data-dir DIR``). :mod:`meshensemble.data.tfds_stream` opens TFDS's prepared data
the same way (``--source tfds --input stream``).

Example:
  >>> paths = write_array_record_dataset("mnist_ar", me.data.synthetic(256, 64), shards=2)
  >>> ds = load_array_record_dataset("mnist_ar")
  >>> ds.train_images[:2].shape, is_lazy(ds)
  ((2, 28, 28, 1), True)
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from typing import Any

import numpy as np

from meshensemble.data import manifest
from meshensemble.data.codec import MNIST_CODEC, codec_for, codec_from_record
from meshensemble.data.dataset import (
    DATASETS,
    FULL_SIZES,
    IMAGE_SHAPE,
    PRETTY_NAMES,
    DataError,
    Dataset,
    first_line,
    split_counts,
)
from meshensemble.data.stream import ArrayRecordSource, write_array_record
from meshensemble.runtime import storage

LABELS_FILE = "labels.npz"
"""The labels file of :func:`write_array_record_dataset` (``train_labels``, ``test_labels``)."""
TRAIN_FILE = "train.array_record"
"""The train split's ArrayRecord file (or the stem of its shards)."""
TEST_FILE = "test.array_record"
"""The test split's ArrayRecord file."""
CONVERT_FIX = "write it with: meshensemble convert --data-file mnist.npz --out DIR --overwrite"
"""How the messages about missing or malformed ArrayRecord datasets say to make one."""
MIN_RECORDS_PER_SHARD = 1000
"""Fewest records a train file of :func:`write_array_record_dataset` holds (each ArrayRecord
file costs about 125 KB beyond its records, so 5,000 shards of 3,000 examples would take
600 MB): more shards than ``num_train // MIN_RECORDS_PER_SHARD`` are capped to that."""


class IndexedSource:
    """A source's examples at ``indices``, in that order (an index-remapped view).

    Args:
      source: a random-access source (``len`` and ``read(indices)``).
      indices: int ``[M]`` positions in ``source``.

    Example:
      >>> src = me.data.stream.ArraySource(images, labels)
      >>> view = IndexedSource(src, np.array([5, 2, 9]))
      >>> view.read(np.array([0]))[1] == labels[[5]]   # src's label of example 5
      array([ True])
    """

    def __init__(self, source: Any, indices: np.ndarray):
        self.source, self.indices = source, np.asarray(indices, np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def shape(self) -> tuple[int, ...]:
        """``(M, *example shape)`` of the source's features."""
        return (len(self), *example_layout(self.source)[0])

    @property
    def dtype(self) -> np.dtype:
        """The source's feature dtype."""
        return example_layout(self.source)[1]

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        x, y = self.read(np.asarray([i]))
        return x[0], int(y[0])

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The examples at ``indices`` of this view (any shape ``S``).

        Args:
          indices: int ``S``.

        Returns:
          ``(images, labels)``: uint8 ``S + [28, 28, 1]`` and int32 ``S``.

        Example:
          >>> src = me.data.stream.ArraySource(images, labels)
          >>> x, y = IndexedSource(src, np.array([5, 2])).read(np.array([1]))  # src's example 2
          >>> bool((x == images[[2]]).all() and (y == labels[[2]]).all())
          True
        """
        return self.source.read(self.indices[np.asarray(indices)])


def example_layout(source: Any) -> tuple[tuple[int, ...], np.dtype]:
    """One example's feature shape and dtype in a source: its ``shape[1:]`` and ``dtype``.

    Args:
      source: a random-access source; one without ``shape`` holds MNIST images.

    Returns:
      ``(shape, dtype)``, e.g. ``((28, 28, 1), dtype('uint8'))``.

    Example:
      >>> example_layout(me.data.stream.ArraySource(np.zeros((3, 5), np.float32), [0, 1, 2]))
      ((5,), dtype('float32'))
    """
    shape = getattr(source, "shape", None)
    if shape is None:
        return tuple(IMAGE_SHAPE), np.dtype(np.uint8)
    return tuple(shape[1:]), np.dtype(getattr(source, "dtype", np.uint8))


class SourceImages:
    """The train features of a source, array-like, read only where indexed.

    ``len``, ``shape`` (e.g. ``(N, 28, 28, 1)``: the source's, see
    :func:`example_layout`), ``dtype`` and ``ndim`` as the array would have them;
    ``x[i]``, ``x[a:b:c]`` and ``x[int_array]`` read those examples through
    ``source.read`` and return numpy arrays; :meth:`subset` gives a lazy view.

    Args:
      source: a random-access source (``len`` and ``read(indices) -> (images, labels)``).

    Raises:
      DataError: from ``np.asarray(x)``: a whole load of the split is refused.

    Example:
      >>> path = me.data.stream.write_array_record("train.array_record", images, labels)[0]
      >>> x = SourceImages(ArrayRecordSource(path))
      >>> x[:4].shape, len(x)
      ((4, 28, 28, 1), 32)
    """

    lazy = True
    """Marks a lazily read split (:func:`is_lazy`)."""

    def __init__(self, source: Any):
        self.source = source
        self.example_shape, self.dtype = example_layout(source)
        self.ndim = 1 + len(self.example_shape)

    def __len__(self) -> int:
        return len(self.source)

    @property
    def shape(self) -> tuple[int, ...]:
        """``(N, *example shape)``, e.g. ``(N, 28, 28, 1)``."""
        return (len(self.source), *self.example_shape)

    def __getitem__(self, key: Any) -> np.ndarray:
        rest: tuple[Any, ...] = ()
        if isinstance(key, tuple):
            key, rest = key[0], key[1:]
        n = len(self)
        if isinstance(key, slice):
            rows = np.arange(*key.indices(n))
        elif isinstance(key, int | np.integer):
            if not -n <= key < n:
                raise IndexError(f"index {key} is out of bounds for {n} training examples")
            return self[np.asarray([key])][0][rest]
        else:
            rows = np.asarray(key)
            if rows.dtype == np.bool_:
                rows = np.flatnonzero(rows)
            if rows.size and (rows.min() < -n or rows.max() >= n):
                raise IndexError(f"indices outside 0..{n - 1} of the training examples")
            rows = np.where(rows < 0, rows + n, rows)
        if rows.size == 0:
            return np.zeros((*rows.shape, *self.example_shape), self.dtype)[(slice(None), *rest)]
        images = np.asarray(self.source.read(rows.astype(np.int64))[0], self.dtype)
        return images[(slice(None),) * rows.ndim + rest] if rest else images

    def subset(self, indices: np.ndarray) -> SourceImages:
        """A lazy view of the examples at ``indices`` (e.g. what a validation split leaves).

        Args:
          indices: int ``[M]`` positions, or a boolean mask ``[N]``.

        Returns:
          A :class:`SourceImages` of ``M`` examples over an :class:`IndexedSource`.

        Example:
          >>> x = SourceImages(me.data.stream.ArraySource(images, labels))
          >>> x.subset(np.array([9, 4]))[0].shape   # example 9, read now
          (28, 28, 1)
        """
        indices = np.asarray(indices)
        if indices.dtype == np.bool_:
            indices = np.flatnonzero(indices)
        return SourceImages(IndexedSource(self.source, indices))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise DataError(
            f"np.asarray of the lazy training images would load all {len(self):,} training "
            "images; this dataset streams: use --input stream (input='stream')"
        )

    def __repr__(self) -> str:
        return f"SourceImages({type(self.source).__name__}, shape={self.shape})"


def is_lazy(data: Any) -> bool:
    """Whether a :class:`Dataset` (or its ``train_images``) is read lazily from a source.

    Args:
      data: a Dataset or an images array.

    Returns:
      True for a :class:`SourceImages` train split.

    Example:
      >>> is_lazy(me.data.synthetic(20, 10))
      False
    """
    images = getattr(data, "train_images", data)
    return bool(getattr(images, "lazy", False))


def shard_count(num_train: int, shards: int) -> int:
    """``shards`` capped so each train file holds at least :data:`MIN_RECORDS_PER_SHARD`.

    Args:
      num_train: training examples.
      shards: the train files asked for.

    Returns:
      ``min(shards, max(1, num_train // MIN_RECORDS_PER_SHARD))``.

    Example:
      >>> shard_count(3000, 5000)
      3
    """
    return max(1, min(int(shards), int(num_train) // MIN_RECORDS_PER_SHARD))


def content_id(images: Any) -> str | None:
    """What identifies the bytes of a lazy split without reading it, or None.

    The base source's ``content_id`` (an ArrayRecord folder's manifest hashes, set by
    :func:`load_array_record_dataset`) and the rows each :class:`IndexedSource` view takes.

    Args:
      images: a :class:`SourceImages`.

    Returns:
      A string, or None when the source has no ``content_id`` (e.g. TFDS's mock data,
      which comes from no file).

    Example:
      >>> paths = write_array_record_dataset("mnist_ar", me.data.synthetic(256, 64), shards=2)
      >>> content_id(load_array_record_dataset("mnist_ar").train_images)[:9]
      'manifest:'
    """
    source, views = getattr(images, "source", None), []
    while isinstance(source, IndexedSource):
        views.append(hashlib.sha256(np.ascontiguousarray(source.indices).tobytes()).hexdigest())
        source = source.source
    base = getattr(source, "content_id", None)
    return None if base is None else "|".join([base, *views])


def write_array_record_dataset(
    directory: str | os.PathLike, dataset: Dataset, shards: int = 1, *, overwrite: bool = False
) -> list[str]:
    """Writes a dataset as ArrayRecord files, a labels file and a manifest, for pods.

    Writes ``train.array_record`` (one shard) or ``train.array_record-0000i-of-0000n``,
    ``test.array_record``, ``labels.npz`` (``train_labels``, ``test_labels``) and
    ``manifest.json`` (each file's size, SHA-256 and records:
    :mod:`meshensemble.data.manifest`); :func:`load_array_record_dataset` reads them. The
    files are written into a temporary sibling folder that is renamed into place when
    complete, so an interrupted write (Ctrl-C, a full disk) leaves no partial folder.

    Args:
      directory: the folder to write (on storage every host can read); it must not exist
        or be empty, unless ``overwrite`` (which replaces only a folder holding nothing
        but a dataset's files).
      dataset: an in-memory :class:`Dataset`.
      shards: how many train files (consecutive runs of examples); capped by
        :func:`shard_count` at :data:`MIN_RECORDS_PER_SHARD` records a file.
      overwrite: replace a non-empty ``directory`` (only once the new files are complete).

    Returns:
      The paths written: the train files, the test file, the labels file, the manifest.

    Raises:
      DataError: ``shards`` below 1, a lazy dataset (write from arrays), a non-empty
        ``directory`` without ``overwrite``, or one holding other files (nothing is
        written then).

    Example:
      >>> paths = write_array_record_dataset("mnist_ar", me.data.synthetic(256, 64), shards=2)
      >>> [os.path.basename(p) for p in paths]   # 256 examples are too few for 2 shards
      ['train.array_record', 'test.array_record', 'labels.npz', 'manifest.json']
    """
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise DataError(f"write_array_record_dataset: shards={shards!r}; pass an integer >= 1")
    if is_lazy(dataset):
        raise DataError("write_array_record_dataset: the dataset is lazy; write from arrays")
    directory = storage.absolute(directory)
    if storage.isfile(directory):
        raise DataError(f"{directory}: a file is in the way; pass a folder path to write")
    held = storage.listdir(directory) if storage.isdir(directory) else []
    if held and not overwrite:
        raise DataError(
            f"{directory}: not empty; pass --overwrite (overwrite=True) to replace it, or "
            "another folder"
        )
    foreign = [n for n in held if not _OWN_FILE.match(n)]
    if foreign:  # --overwrite replaces the folder: never one holding other files
        raise DataError(
            f"{directory}: holds {foreign[0]!r}, which convert did not write; --overwrite "
            "only replaces a dataset folder: pick another folder"
        )
    if not storage.is_local(directory):  # a bucket cannot rename a folder: see _upload
        return _upload(directory, dataset, shards, held)
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}.tmp-", dir=parent)
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700: a folder others train from
        names = _write_files(tmp, dataset, shard_count(dataset.num_train, shards))
        _swap_in(tmp, directory)
    except BaseException:  # Ctrl-C included: no partial folder is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [os.path.join(directory, n) for n in names]


def _upload(directory: str, dataset: Dataset, shards: int, held: list[str]) -> list[str]:
    """Writes the folder on an object store, which cannot rename a folder atomically.

    The files are made in a local temporary folder, then uploaded one object each; the
    files of an older conversion that are not rewritten are deleted; the manifest goes
    last. A reader in between sees the old manifest over new files and fails its checksum
    check (one line, :data:`~meshensemble.data.manifest.REWRITE_FIX`): never a silent mix.
    """
    with tempfile.TemporaryDirectory() as tmp:
        names = _write_files(tmp, dataset, shard_count(dataset.num_train, shards))
        for name in names:  # the manifest is the last name
            if name == manifest.MANIFEST_FILE:
                for stale in sorted(set(held) - set(names)):
                    storage.remove(storage.join(directory, stale))
            storage.atomic_write(storage.join(directory, name), storage.read_bytes(f"{tmp}/{name}"))
    return [storage.join(directory, n) for n in names]


def _umask() -> int:
    """The process's umask (read by setting it, then restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_files(directory: str, dataset: Dataset, shards: int) -> list[str]:
    """Writes the files and the manifest into ``directory``; their names."""
    codec = codec_for(dataset.x_train, dataset.y_train, dataset.num_classes)
    train = write_array_record(
        os.path.join(directory, TRAIN_FILE), dataset.x_train, dataset.y_train, shards, codec
    )
    write_array_record(os.path.join(directory, TEST_FILE), dataset.x_test, dataset.y_test, 1, codec)
    meta = {}
    if dataset.num_classes is not None:
        meta["num_classes"] = np.asarray(dataset.num_classes)
    if dataset.class_names is not None:
        meta["class_names"] = np.asarray(dataset.class_names, dtype=str)
    np.savez(
        os.path.join(directory, LABELS_FILE),
        train_labels=dataset.y_train,
        test_labels=dataset.y_test,
        name=np.asarray(dataset.name),
        **meta,
    )
    parts = np.array_split(np.arange(dataset.num_train), len(train))
    counts = {os.path.basename(p): len(part) for p, part in zip(train, parts, strict=True)}
    counts[TEST_FILE] = dataset.num_test
    names = [*(os.path.basename(p) for p in train), TEST_FILE, LABELS_FILE]
    manifest.write_manifest(directory, names, counts, codec.record())
    return [*names, manifest.MANIFEST_FILE]


def _swap_in(tmp: str, directory: str) -> None:
    """Renames the finished ``tmp`` to ``directory``, replacing what was there."""
    old = None
    if os.path.isdir(directory):
        if not os.listdir(directory):
            os.rmdir(directory)
        else:
            old = f"{tmp}.old"
            os.rename(directory, old)
    os.rename(tmp, directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


_OWN_FILE = re.compile(
    rf"^({re.escape(TRAIN_FILE)}(-\d+-of-\d+)?|{re.escape(TEST_FILE)}|{re.escape(LABELS_FILE)}"
    rf"|{re.escape(manifest.MANIFEST_FILE)})$"
)
_SHARD = re.compile(r"-(\d+)-of-(\d+)$")


def _train_files(directory: str) -> list[str]:
    single = storage.join(directory, TRAIN_FILE)
    if storage.isfile(single):
        return [single]
    shards = [n for n in storage.listdir(directory) if n.startswith(f"{TRAIN_FILE}-")]
    found = sorted(storage.join(directory, n) for n in shards if "-of-" in n)
    totals = {int(m.group(2)) for m in map(_SHARD.search, found) if m}
    if len(totals) > 1:  # shards of two conversions into one folder
        kinds = " and ".join(f"-of-{n:05d}" for n in sorted(totals))
        raise DataError(
            f"{directory}: train shards of several conversions ({kinds}): leftovers of an "
            f"earlier one; {manifest.REWRITE_FIX}"
        )
    if len(totals) == 1:  # every shard of n present? (folders without a manifest)
        n = totals.pop()
        want = [f"{single}-{i:05d}-of-{n:05d}" for i in range(n)]
        gone = [w for w in want if w not in found]
        if gone:
            raise DataError(
                f"{gone[0]}: missing ({len(gone)} of {n} train shards missing); "
                f"{manifest.REWRITE_FIX}"
            )
    return found


def load_array_record_dataset(directory: str | os.PathLike, name: str | None = None) -> Dataset:
    """Opens a dataset of :func:`write_array_record_dataset`: lazy train, in-memory test.

    The train features stay in their files (:class:`SourceImages` over an
    :class:`~meshensemble.data.stream.ArrayRecordSource` that decodes them with the
    folder's record codec, :mod:`meshensemble.data.codec`); the targets, the number of
    classes and the class names come from ``labels.npz``; the test split is read whole.
    A folder written before codecs existed holds MNIST records.

    Args:
      directory: the folder holding the files.
      name: the dataset's name; default ``"mnist"`` for a folder of MNIST records (as
        before codecs), else the name the folder recorded. A name of
        :data:`~meshensemble.data.DATASETS` gets MNIST's checks and note.

    Returns:
      A :class:`Dataset` with ``source="arrayrecord"`` and a lazy train split.

    Raises:
      DataError: (one line naming the directory and the fix) the directory or a file is
        missing, ``labels.npz`` is malformed, the files disagree with the labels, or the
        directory is on an object store (``gs://``: mount it, or copy it to each host).

    Example:
      >>> paths = write_array_record_dataset("mnist_ar", me.data.synthetic(256, 64), shards=2)
      >>> ds = load_array_record_dataset("mnist_ar")
      >>> ds.num_train, is_lazy(ds)
      (256, True)
    """
    directory = os.fspath(directory)
    where = f"ArrayRecord dataset {directory}"
    if not storage.is_local(directory):  # array_record's reader does not read a bucket here
        raise DataError(
            f"{where}: ArrayRecord files are read from a local or mounted folder; copy it to "
            "each host, or mount the bucket (gcsfuse) and pass that path"
        )
    if not storage.isdir(directory):
        raise DataError(f"{where}: no such directory; {CONVERT_FIX}")
    train_files = _train_files(directory)
    test_file, labels_file = (storage.join(directory, f) for f in (TEST_FILE, LABELS_FILE))
    found = {TRAIN_FILE: train_files, TEST_FILE: storage.isfile(test_file)}
    found[LABELS_FILE] = storage.isfile(labels_file)
    missing = [f for f, ok in found.items() if not ok]
    if missing:
        raise DataError(f"{where}: missing {', '.join(missing)}; {CONVERT_FIX}")
    train_source, test_source = _open_sources(directory, train_files, test_file)
    train_labels, test_labels, meta = _read_labels(labels_file, where, train_source, test_source)
    test_images, file_test_labels = test_source.read(np.arange(len(test_source)))
    if not np.array_equal(file_test_labels, test_labels):
        raise DataError(f"{where}: {LABELS_FILE} disagrees with {TEST_FILE}; {CONVERT_FIX}")
    if name is None:
        name = "mnist" if train_source.codec == MNIST_CODEC else meta.pop("name", "data")
    meta.pop("name", None)
    if name in DATASETS:
        full = "full " if (len(train_labels), len(test_labels)) == FULL_SIZES else ""
        what = f"{full}{PRETTY_NAMES[name]}"
    else:
        what = name
    note = (
        f"{what} from ArrayRecord files in {directory} "
        f"({split_counts(train_labels, test_labels)}; train split read lazily)"
    )
    return Dataset(
        name,
        SourceImages(train_source),
        train_labels,
        test_images,
        test_labels,
        source="arrayrecord",
        note=note,
        **meta,
    )


def _read_labels(
    labels_file: str, where: str, train_source: Any, test_source: Any
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """``labels.npz``'s targets of both splits, checked against the files' record counts,
    and what else it recorded (``name``, ``num_classes``, ``class_names``)."""
    try:
        with np.load(labels_file, allow_pickle=False) as f:
            train_labels, test_labels = np.asarray(f["train_labels"]), np.asarray(f["test_labels"])
            meta: dict[str, Any] = {}
            if "name" in f.files:
                meta["name"] = str(f["name"])
            if "num_classes" in f.files:
                meta["num_classes"] = int(f["num_classes"])
            if "class_names" in f.files:
                meta["class_names"] = tuple(str(n) for n in f["class_names"])
    except Exception as e:
        raise DataError(
            f"{where}: {LABELS_FILE} is not readable with train_labels and test_labels "
            f"({type(e).__name__}: {first_line(e)}); {CONVERT_FIX}"
        ) from e
    want = (1 + len(train_source.codec.y_shape),) if hasattr(train_source, "codec") else (1,)
    for split, labels, src in (
        ("train", train_labels, train_source),
        ("test", test_labels, test_source),
    ):
        if (labels.ndim,) != want or len(labels) != len(src):
            raise DataError(
                f"{where}: {LABELS_FILE} has {split}_labels of shape {labels.shape} but the "
                f"{split} files hold {len(src)} records; {CONVERT_FIX}"
            )
    return train_labels, test_labels, meta


def _open_sources(
    directory: str, train_files: list[str], test_file: str
) -> tuple[ArrayRecordSource, ArrayRecordSource]:
    """The train and test sources, checked against the folder's manifest where it has one.

    The manifest's sizes are checked now (a ``stat`` per file); the test file and
    ``labels.npz`` (read whole anyway) are verified now, each train file by its source the
    first time a record of it is read. ``content_id`` of the train source identifies its
    bytes: the manifest's hashes (and its codec unless MNIST's), else (an older folder) the
    files' names and sizes. The manifest's codec (MNIST's when it has none) decodes them.
    """
    found = manifest.read_manifest(directory)
    if found is None:
        train = ArrayRecordSource(train_files)
        sizes = [(os.path.basename(p), storage.file_size(p)) for p in train_files]
        train.content_id = "sizes:" + repr(sizes)
        return train, ArrayRecordSource(test_file)
    manifest.check_manifest(directory, found, train_files)
    files, codec = found["files"], codec_from_record(found.get("codec"))
    names = [os.path.basename(p) for p in train_files]
    missing = [n for n in names + [TEST_FILE, LABELS_FILE] if n not in files]
    if missing:
        raise DataError(
            f"{os.path.join(directory, missing[0])}: not listed in {manifest.MANIFEST_FILE}; "
            f"{manifest.REWRITE_FIX}"
        )
    verifier = manifest.FileVerifier({p: files[n]["sha256"] for p, n in zip(train_files, names)})
    counts = [files[n].get("records") for n in names]
    counts = None if None in counts else counts
    train = ArrayRecordSource(train_files, counts=counts, verifier=verifier, codec=codec)
    train.content_id = "manifest:" + manifest.manifest_fingerprint(found, names)
    if codec != MNIST_CODEC:  # MNIST folders keep the identity they had before codecs
        train.content_id += "|codec:" + repr(sorted(codec.record().items()))
    check = manifest.FileVerifier(
        {os.path.join(directory, n): files[n]["sha256"] for n in (TEST_FILE, LABELS_FILE)}
    )
    for name in (TEST_FILE, LABELS_FILE):
        check.verify(os.path.join(directory, name))
    return train, ArrayRecordSource(test_file, codec=codec)
