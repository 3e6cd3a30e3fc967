"""What defines a run and its data, so that nothing mixes two runs or two datasets.

A workdir's ``config.json`` records the fields that define its run (:data:`RUN_FIELDS`)
and, under ``resolved.data_identity``, the data actually used (:func:`data_identity`):
the source, the number of train and test examples, the npz file, where the data came
from, and a fingerprint of every byte of each split (train, validation, test;
:func:`split_fingerprint`: whole arrays hashed, or an ArrayRecord folder's manifest).
:func:`check_same_run` compares them with a resumed run's and raises one line on the
first difference, before anything in the workdir changes; :func:`load_run_data` and
:func:`check_run_data` do the same for ``evaluate`` (and ``--calibrate``): the run's own
data, or a one-line refusal naming the split.

Example:
  >>> from meshensemble.training.outputs import RunWriter
  >>> ds, cfg = me.data.load_sample(), me.TrainConfig(source="sample")
  >>> RunWriter("runs/mnist").write_config(cfg, {"data_identity": data_identity(ds, None)})
  >>> saved = read_saved_config("runs/mnist")
  >>> check_same_run("runs/mnist", saved, run_fields(cfg))   # None: the same run
  >>> check_same_run("runs/mnist", saved, run_fields(me.TrainConfig(seed=1)))
  Traceback (most recent call last):
  ...
  ValueError: workdir runs/mnist holds a run with seed=0, this run has seed=1; ...
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from meshensemble import data as data_lib
from meshensemble.data import split
from meshensemble.runtime import storage
from meshensemble.runtime.distributed import agree
from meshensemble.training.config import CONFIG_FILE, TrainConfig

RUN_FIELDS = (
    "seed",
    "members",
    "model",
    "batch_size",
    "optimizer",
    "learning_rate",
    "momentum",
    "weight_decay",
    "schedule",
    "warmup_epochs",
    "epochs",
    "shuffle",
    "dataset",
    "validation",
    "augment",
    "augment_shift",
    "bootstrap",
    "label_smoothing",
    "backbone",
    "rank",
)
"""Config fields a resumed run must keep: they define the members (an adapter run's
backbone and rank too), their optimizer and
schedule, their data order (bagging included), augmentation and loss (label smoothing) and
the held-out validation split. ``epochs`` counts only for
a decaying schedule (a constant rate can be extended by more epochs) and
``warmup_epochs`` only for ``warmup_cosine``, ``augment_shift`` only with ``augment``,
``rank`` only with ``backbone``.
``input`` (``device``/``stream``) is not among them: both inputs train the same members from
the same order, so a run may resume with the other one (the streamed iterator's position is
restored from the checkpoint)."""
DATA_KEYS = ("source", "num_train", "num_test", "data_file", "data_dir", "test_file")
"""Keys of :func:`data_identity` a resume compares before the splits' fingerprints."""
FILE_SOURCES = ("npz", "csv")
"""Sources whose data file :func:`data_identity` records (absolute)."""
DIR_SOURCES = ("folder", "arrayrecord")
"""Sources whose data folder :func:`data_identity` records (absolute)."""
OBJECT_SOURCES = ("synthetic", "arrays")
"""Sources of data that only exists in the Python process that made it: ``evaluate``
cannot load it again from a run's config."""
IDENTITY_FORMAT = 2
"""Version of :func:`data_identity`'s layout. Runs written before it (no ``format`` key)
recorded one ``fingerprint`` of a strided sample of the images (:func:`sampled_fingerprint`)."""
SPLITS = ("train", "validation", "test")
"""The splits :func:`data_identity` fingerprints, each one separately."""
FINGERPRINT_SAMPLES = 1024
"""Images per split hashed by the old format's :func:`sampled_fingerprint` (evenly strided)."""


def run_fields(cfg: TrainConfig) -> dict[str, Any]:
    """The values of :data:`RUN_FIELDS` that shape ``cfg``'s run.

    Args:
      cfg: a validated config.

    Returns:
      ``{field: value}``, without ``epochs`` for a constant schedule and without
      ``warmup_epochs`` unless the schedule is ``warmup_cosine``, without ``augment_shift``
      when ``augment`` is ``"none"``, without ``rank`` when there is no ``backbone``.

    Example:
      >>> sorted(run_fields(TrainConfig()))[:3]
      ['augment', 'backbone', 'batch_size']
    """
    dropped = {
        "epochs": cfg.schedule == "constant",
        "warmup_epochs": cfg.schedule != "warmup_cosine",
        "augment_shift": cfg.augment == "none",
        "rank": not cfg.backbone,
    }
    return {name: getattr(cfg, name) for name in RUN_FIELDS if not dropped.get(name)}


def split_fingerprint(images: Any, labels: Any) -> str:
    """A fingerprint of every byte of one split: ``"<kind>:<64 hex digits>"``.

    In-memory images (``kind="bytes"``) are hashed whole with their labels (SHA-256 runs at
    about 1 GB/s: tens of milliseconds for MNIST). A lazy split in ArrayRecord files
    (``kind="manifest"``) is identified by its files' manifest hashes, the labels and the
    rows it takes from them, without reading an image: each host verifies the files as it
    reads them (:mod:`meshensemble.data.manifest`); TFDS's prepared data by its
    dataset_info and its files' sizes and SHA-256, hashed once per host
    (:func:`meshensemble.data.tfds.split_content_id`). A lazy split whose source names no
    files (``tfds.testing.mock_data``) falls back to ``kind="sample"``: every label and
    :data:`FINGERPRINT_SAMPLES` strided images.

    Class ids are hashed as int32 and the header is ``(shape, dtype, targets' shape)`` (the
    layout MNIST runs recorded); float targets are hashed as float32 with their dtype in
    the header too.

    Args:
      images: the split's features ``[N, ...]`` of any dtype (or a lazy
        :class:`~meshensemble.data.SourceImages`).
      labels: int class ids ``[N]`` or float targets ``[N, T]``.

    Returns:
      The fingerprint; two fingerprints of different kinds are not comparable.

    Example:
      >>> ds = me.data.synthetic(64, 16)
      >>> split_fingerprint(ds.x_test, ds.y_test)[:6]
      'bytes:'
    """
    digest = hashlib.sha256()
    header: tuple[Any, ...] = (tuple(images.shape), str(images.dtype))
    if data_lib.is_class_ids(labels):
        labels = np.ascontiguousarray(labels, np.int32)
        header += (labels.shape,)
    else:
        labels = np.ascontiguousarray(labels, np.float32)
        header += (labels.shape, str(labels.dtype))
    digest.update(repr(header).encode())
    digest.update(labels)  # the buffers themselves: no copy
    if not getattr(images, "lazy", False):
        digest.update(np.ascontiguousarray(images))
        return "bytes:" + digest.hexdigest()
    content = data_lib.lazy.content_id(images)
    if content is not None:
        digest.update(content.encode())
        return "manifest:" + digest.hexdigest()
    stride = max(1, len(images) // FINGERPRINT_SAMPLES)
    digest.update(np.ascontiguousarray(images[::stride]).tobytes())
    return "sample:" + digest.hexdigest()


def table_fingerprint(x: Any, y: Any) -> str:
    """The fingerprint older runs of float tables recorded of a split: ``"sha256:<hex>"`` of
    the float32 features and targets (each array's shape, then its bytes).

    Example:
      >>> table_fingerprint(np.zeros((2, 1)), np.ones((2, 1)))[:7]
      'sha256:'
    """
    digest = hashlib.sha256()
    for a in (x, y):
        a = np.ascontiguousarray(a, np.float32)
        digest.update(repr(a.shape).encode())
        digest.update(a)
    return "sha256:" + digest.hexdigest()


def data_fingerprint(dataset: data_lib.Dataset) -> str:
    """A fingerprint of every byte of a dataset's train and test splits.

    Args:
      dataset: the data.

    Returns:
      16 hex digits of a SHA-256 over :func:`split_fingerprint` of both splits.

    Example:
      >>> len(data_fingerprint(me.data.synthetic(64, 16)))   # 16 hex digits
      16
    """
    parts = [split_fingerprint(images, labels) for images, labels in _splits(dataset)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def sampled_fingerprint(dataset: data_lib.Dataset) -> str:
    """The old format's fingerprint: shapes, all labels, strided images of each split.

    Only for comparing with runs recorded before :data:`IDENTITY_FORMAT` 2.

    Args:
      dataset: the data.

    Returns:
      16 hex digits of a SHA-256 over the shapes, every label and
      :data:`FINGERPRINT_SAMPLES` evenly strided images of each split.

    Example:
      >>> a = sampled_fingerprint(me.data.synthetic(64, 16))
      >>> a == sampled_fingerprint(me.data.synthetic(64, 16, seed=0)), a == sampled_fingerprint(
      ...     me.data.synthetic(64, 16, seed=1))
      (True, False)
    """
    digest = hashlib.sha256()
    for images, labels in _splits(dataset):
        stride = max(1, len(images) // FINGERPRINT_SAMPLES)
        digest.update(repr((images.shape, str(images.dtype), labels.shape)).encode())
        digest.update(np.ascontiguousarray(labels, np.int64).tobytes())
        digest.update(np.ascontiguousarray(images[::stride]).tobytes())
    return digest.hexdigest()[:16]


def _splits(dataset: data_lib.Dataset) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    """The dataset's train and test splits, each ``(images, labels)``."""
    return (dataset.train_images, dataset.train_labels), (dataset.test_images, dataset.test_labels)


def data_identity(
    dataset: data_lib.Dataset,
    data_file: str | None,
    validation: int = 0,
    seed: int = 0,
    *,
    origin: str = "config",
    data_dir: str | None = None,
    test_file: str | None = None,
) -> dict[str, Any]:
    """What a run's data was, as recorded in ``config.json`` (``resolved.data_identity``).

    Args:
      dataset: the data the run uses (before its validation split is held out).
      data_file: the config's ``data_file``; recorded (absolute) when the data came from
        a file (an npz, a CSV).
      validation: the run's ``validation`` count (0: no validation split).
      seed: the run's seed (it draws the validation split).
      origin: ``"config"`` when the data was loaded from the config's data settings (so
        ``evaluate`` can load it again), ``"object"`` when it was passed from Python.
      data_dir: the config's ``data_dir``; recorded (absolute) when the data came from a
        folder (an image folder, an ArrayRecord folder).
      test_file: the config's ``test_file``; recorded (absolute) for a CSV's test file.

    Returns:
      ``{"format", "source", "num_train", "num_test", "data_file", "origin", "splits",
      "content"}`` (and ``data_dir``, ``test_file`` where recorded): ``splits`` maps
      ``train`` (the examples trained on), ``validation`` (held out; None without one)
      and ``test`` to their :func:`split_fingerprint`; ``content`` is 16 hex digits over
      all three.

    Example:
      >>> data_identity(me.data.synthetic(64, 16), None)["splits"]["test"][:6]
      'bytes:'
    """
    from_file = dataset.source in FILE_SOURCES and data_file is not None
    images, labels, held = dataset.x_train, dataset.y_train, None
    train = split_fingerprint(images, labels)
    if isinstance(validation, int) and 0 < validation < dataset.num_train:
        out = split.validation_indices(labels, validation, seed, dataset.num_classes or 0)
        keep = np.ones(len(labels), bool)
        keep[out] = False
        lazy = getattr(images, "lazy", False)  # a lazy split: views, no image read
        part = (lambda rows: images.subset(rows)) if lazy else (lambda rows: images[rows])
        train = split_fingerprint(part(keep), labels[keep])
        held = split_fingerprint(part(out), labels[out])
    splits = {
        "train": train,
        "validation": held,
        "test": split_fingerprint(dataset.x_test, dataset.y_test),
    }
    content = hashlib.sha256(repr(sorted(splits.items())).encode()).hexdigest()[:16]
    where = {}  # only where the data has them: MNIST's records keep their keys
    if dataset.source in DIR_SOURCES and data_dir is not None:
        where["data_dir"] = storage.absolute(data_dir)
    if dataset.source == "csv" and test_file is not None:
        where["test_file"] = storage.absolute(test_file)
    return {
        "format": IDENTITY_FORMAT,
        "source": dataset.source,
        "num_train": dataset.num_train,
        "num_test": dataset.num_test,
        "data_file": storage.absolute(data_file) if from_file else None,
        **where,
        "origin": origin,
        "splits": splits,
        "content": content,
    }


def differing_splits(held: dict[str, Any], data: dict[str, Any]) -> list[str]:
    """The splits whose fingerprints differ between two :func:`data_identity` records.

    A split is compared only when both record it with fingerprints of the same kind (see
    :func:`split_fingerprint`).

    Args:
      held: the recorded identity (format 2).
      data: the new one.

    Returns:
      Names from :data:`SPLITS`, in that order.

    Example:
      >>> saved_identity = data_identity(me.data.synthetic(64, 16), None)
      >>> other = me.data.synthetic(64, 16, seed=1)
      >>> differing_splits(saved_identity, data_identity(other, None))
      ['train', 'test']
    """
    old, new = held.get("splits") or {}, data.get("splits") or {}
    out = []
    for name in SPLITS:
        a, b = old.get(name), new.get(name)
        if a is None and b is None:
            continue
        if (a is None) != (b is None) or a.split(":")[0] == b.split(":")[0] and a != b:
            out.append(name)
    return out


AGREED_DATA_KEYS = ("source", "num_train", "num_test", "content")
"""Keys of :func:`data_identity` every process must share (the npz path may differ)."""


def agree_data(identity: dict[str, Any], note: str | None = None) -> None:
    """Stops every process unless all resolved the same data (a collective; free in one).

    Args:
      identity: this process's :func:`data_identity`.
      note: the dataset's note, quoted in the message (e.g. where the data came from).

    Raises:
      meshensemble.runtime.distributed.DisagreementError: one line naming the first process
        whose data differs from process 0's, both hosts and the differing keys, e.g.
        ``the data differs between processes: process 1 (host-b) has source='sample',
        num_train=4000 (embedded MNIST sample ...), process 0 (host-a) has source='tfds',
        num_train=60000 (full MNIST from TFDS ...); pass the same --source/--data-file/
        --data-dir (and the same file contents) on every host``.

    Example:
      >>> dataset = me.data.synthetic(64, 16)
      >>> agree_data(data_identity(dataset, None), dataset.note)   # one process: agrees
    """
    same = "the same --source/--data-file/--data-dir (and the same file contents)"
    agree("the data", identity, f"pass {same} on every host", compare=AGREED_DATA_KEYS, label=note)


def read_saved_config(workdir: str) -> dict[str, Any] | None:
    """The JSON object of the workdir's ``config.json``, or None when there is none.

    Args:
      workdir: the run's folder.

    Returns:
      The parsed object (fields and ``resolved``), or None.

    Raises:
      ValueError: the file exists but is not a JSON object (one line naming it).

    Example:
      >>> from meshensemble.training.outputs import RunWriter
      >>> ds, cfg = me.data.load_sample(), me.TrainConfig(source="sample")
      >>> RunWriter("runs/mnist").write_config(cfg, {"data_identity": data_identity(ds, None)})
      >>> read_saved_config("runs/mnist")["seed"]
      0
    """
    path = storage.join(workdir, CONFIG_FILE)
    if not storage.exists(path):
        return None
    try:
        loaded = storage.read_json(path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        msg = " ".join(str(err).split())
        raise ValueError(
            f"workdir config {path}: cannot read JSON ({msg}); repair it, or pass --overwrite "
            "(or overwrite=True), or use another workdir"
        ) from None
    if not isinstance(loaded, dict):
        raise ValueError(f"workdir config {path}: must hold a JSON object of TrainConfig fields")
    return loaded


def _refuse(workdir: str, held: str, this: str, fix: str) -> ValueError:
    return ValueError(
        f"workdir {workdir} holds a run with {held}, this run has {this}; {fix}, or pass "
        "--overwrite (or overwrite=True), or use another workdir"
    )


def _refuse_change(
    workdir: str, held: dict[str, Any], now: dict[str, Any], keys: Any, fix: str = ""
) -> None:
    """Raises :func:`_refuse` for the first of ``keys`` that ``held`` records with another
    value than ``now`` (``fix``: by default, resume with the held value)."""
    for key in keys:
        if key in held and held[key] != now.get(key):
            label = {"source": "data source"}.get(key, key)
            was = f"{label}={held[key]!r}"
            raise _refuse(workdir, was, f"{label}={now.get(key)!r}", fix or f"resume with {was}")


def check_same_run(
    workdir: str,
    saved: dict[str, Any],
    fields: dict[str, Any],
    data: dict[str, Any] | None = None,
) -> None:
    """Raises unless a new run is the run saved in ``workdir``.

    Only what both sides recorded is compared, so runs written before a key existed
    still resume.

    Args:
      workdir: the run's folder (for the message).
      saved: its ``config.json`` object (:func:`read_saved_config`).
      fields: the new run's :func:`run_fields`.
      data: the new run's :func:`data_identity`; None compares the fields only.

    Raises:
      ValueError: one line naming the first difference, the saved value and the fixes,
        e.g. ``workdir W holds a run with seed=0, this run has seed=1; resume with
        seed=0, or pass --overwrite (or overwrite=True), or use another workdir``.

    Example:
      >>> from meshensemble.training.outputs import RunWriter
      >>> ds, cfg = me.data.load_sample(), me.TrainConfig(source="sample")
      >>> RunWriter("runs/mnist").write_config(cfg, {"data_identity": data_identity(ds, None)})
      >>> check_same_run("runs/mnist", read_saved_config("runs/mnist"), run_fields(cfg))
    """
    _refuse_change(workdir, saved, fields, fields)
    held_data = recorded_identity(saved)
    if data is None or held_data is None:
        return
    fix = f"resume with the run's data ({saved['resolved'].get('data') or 'the same data'})"
    paths = ("data_file", "data_dir", "test_file")  # the files' paths last: content first
    _refuse_change(workdir, held_data, data, [k for k in DATA_KEYS if k not in paths], fix)
    differ = differing_splits(held_data, data) if held_data.get("format") == IDENTITY_FORMAT else []
    if differ:
        name = differ[0]
        held_fp, this_fp = (_short(d["splits"].get(name)) for d in (held_data, data))
        raise _refuse(
            workdir,
            f"{name} split fingerprint={held_fp}",
            f"{name} split fingerprint={this_fp} (the {' and '.join(differ)} data differ)",
            fix,
        )
    # an older run's sampled fingerprint is not compared: sizes matched
    _refuse_change(workdir, held_data, data, paths, fix)


def _short(fingerprint: str | None) -> str:
    """``kind:first 12 hex digits`` of a :func:`split_fingerprint`, for messages."""
    if fingerprint is None:
        return "none"
    kind, _, hexes = fingerprint.partition(":")
    return f"{kind}:{hexes[:12]}"


def recorded_identity(saved: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ``resolved.data_identity`` of a ``config.json`` object, or None.

    Args:
      saved: from :func:`read_saved_config`.

    Returns:
      The recorded identity (any format), or None when the run recorded none.

    Example:
      >>> from meshensemble.training.outputs import RunWriter
      >>> ds, cfg = me.data.load_sample(), me.TrainConfig(source="sample")
      >>> RunWriter("runs/mnist").write_config(cfg, {"data_identity": data_identity(ds, None)})
      >>> recorded_identity(read_saved_config("runs/mnist"))["source"]
      'sample'
    """
    resolved = (saved or {}).get("resolved")
    held = resolved.get("data_identity") if isinstance(resolved, dict) else None
    return held if isinstance(held, dict) else None


def load_run_data(
    workdir: str,
    cfg: TrainConfig,
    *,
    source: str | None = None,
    data_file: str | None = None,
    data_dir: str | None = None,
    log: Any = None,
    loader: Any = None,
) -> data_lib.Dataset:
    """The data to evaluate a run on: the data it recorded, or the data the flags name.

    Without ``source``, ``data_file`` and ``data_dir`` the run's recorded source, file,
    folder and test file are loaded again (``resolved.data_identity``; for older runs the
    config's settings). A run trained on data passed from Python (``me.train(cfg,
    dataset=ds)``: source ``arrays``, or synthetic data) cannot be reloaded from its
    config: it is refused before any work.

    Args:
      workdir: the run's folder (for messages).
      cfg: the run's config (:func:`meshensemble.evaluation.load_run_config`).
      source: overrides the source; data_file: the npz; data_dir: TFDS's folder or the
        ArrayRecord folder.
      log: gets the loader's line saying which data was used.
      loader: ``loader(source, data_file, data_dir, test_file) -> Dataset`` (the run's
        own, which knows its task's sources); default :func:`meshensemble.data.load_dataset`.

    Returns:
      The :class:`~meshensemble.data.Dataset` (check it with :func:`check_run_data`).

    Raises:
      meshensemble.data.DataError: the recorded data cannot be loaded again (one line
        saying to pass the data), or the loader's one-line errors (a missing file...).

    Example:
      >>> from meshensemble.training.outputs import RunWriter
      >>> ds, cfg = me.data.load_sample(), me.TrainConfig(source="sample")
      >>> RunWriter("runs/mnist").write_config(cfg, {"data_identity": data_identity(ds, None)})
      >>> again = load_run_data("runs/mnist", me.evaluation.load_run_config("runs/mnist"))
      >>> again.num_train == ds.num_train
      True
    """
    held = recorded_identity(read_saved_config(workdir)) or {}
    flags = any(v is not None for v in (source, data_file, data_dir))
    stream = cfg.input == "stream" or bool(getattr(cfg, "streaming", False))
    if not flags and (held.get("origin") == "object" or held.get("source") in OBJECT_SOURCES):
        raise data_lib.DataError(
            f"run {workdir} was trained on data passed from Python ({held.get('source')}, "
            f"{held.get('num_train')} train / {held.get('num_test')} test examples), which "
            "evaluate cannot load again; pass that data: evaluate_run(workdir, dataset=ds) "
            "from Python, or --source/--data-file/--data-dir when it is on disk (its "
            "identity is checked)"
        )
    test_file = None
    if not flags and held.get("source") in data_lib.SOURCES:  # what the run recorded
        src, data_file = held["source"], held.get("data_file") or cfg.data_file
        data_dir, test_file = held.get("data_dir"), held.get("test_file")
    else:
        src = source or cfg.source
        if data_file is None and src in ("npz", "auto", "csv"):
            data_file = cfg.data_file
    if loader is not None:
        return loader(src, data_file, data_dir or cfg.data_dir, test_file)
    return data_lib.load_dataset(
        cfg.dataset, src, data_file, data_dir or cfg.data_dir, log=log, stream=stream,
        test_file=test_file or cfg.test_file, test_fraction=cfg.test_fraction,
        target_column=cfg.target_column, targets=cfg.targets, seed=cfg.seed,
    )  # fmt: skip


def other_data_fix(recorded: bool, flags: str = "--source/--data-file/--data-dir") -> str:
    """The fix a refusal of data other than the run's names.

    Args:
      recorded: the data was loaded from what the run recorded (no data flags given), so
        that data changed since training; else the flags named other data.
      flags: the data flags of the command.

    Returns:
      One clause for the end of the error line.

    Example:
      >>> other_data_fix(False, "--data-file")
      "evaluate on the run's data (drop --data-file to load what it recorded)"
    """
    if recorded:
        return (
            "the data the run recorded has changed since it was trained: restore that data, "
            "or train a new run on this one"
        )
    return f"evaluate on the run's data (drop {flags} to load what it recorded)"


def check_run_data(
    workdir: str,
    cfg: TrainConfig,
    dataset: data_lib.Dataset,
    say: Any = print,
    recorded: bool = False,
) -> None:
    """Refuses data other than the run's, comparing the fingerprints of every split.

    Args:
      workdir: the run's folder.
      cfg: its config (the validation count and seed rebuild the split).
      dataset: the data about to be evaluated.
      say: gets one line when the run's identity cannot be fully checked (runs written
        before :data:`IDENTITY_FORMAT` 2, or without an identity).
      recorded: ``dataset`` was loaded from what the run recorded (no data flags): a
        difference then means that data changed since training, and the error says so.

    Raises:
      meshensemble.data.DataError: one line naming the differing split(s), both
        fingerprints and the fix, e.g. ``the test split of this data differs from run R's
        (fingerprint bytes:1a2b... recorded, bytes:9f8e... now); evaluate on the run's
        data: ...``.

    Example:
      >>> from meshensemble.training.outputs import RunWriter
      >>> ds, cfg = me.data.load_sample(), me.TrainConfig(source="sample")
      >>> RunWriter("runs/mnist").write_config(cfg, {"data_identity": data_identity(ds, None)})
      >>> check_run_data("runs/mnist", cfg, ds)              # None: the run's data
    """
    held = recorded_identity(read_saved_config(workdir))
    if held is None:
        say(f"run {workdir} recorded no data identity: the data could not be checked")
        return
    object_data = held.get("origin") == "object" or held.get("source") in OBJECT_SOURCES
    fix = "pass the data the run was trained on" if object_data else other_data_fix(recorded)
    if held.get("format") != IDENTITY_FORMAT and isinstance(held.get("splits"), dict):
        test = table_fingerprint(dataset.x_test, dataset.y_test)  # an older table run's
        if (held.get("num_test"), held["splits"].get("test")) != (dataset.num_test, test):
            raise data_lib.DataError(
                f"the test split of this data ({dataset.note}) differs from run {workdir}'s "
                f"({_short(held['splits'].get('test'))} recorded, {_short(test)} now); {fix}"
            )
        say(f"run {workdir} records its data in an older format: only the test split was checked")
        return
    if held.get("format") != IDENTITY_FORMAT:
        now = (dataset.num_train, dataset.num_test, sampled_fingerprint(dataset))
        if (held.get("num_train"), held.get("num_test"), held.get("fingerprint")) != now:
            raise data_lib.DataError(
                f"this data ({dataset.note}) differs from the data run {workdir} was trained "
                f"on (its sizes or sampled fingerprint {held.get('fingerprint')!r}); {fix}"
            )
        say(
            f"run {workdir} records its data in the old format (sizes and a sample of the "
            "images): only that was checked"
        )
        return
    data = data_identity(dataset, None, cfg.validation_count(dataset.num_train), cfg.seed)
    differ = differing_splits(held, data)
    if differ:
        name = differ[0]
        raise data_lib.DataError(
            f"the {' and '.join(differ)} split{'s' if len(differ) > 1 else ''} of this data "
            f"({dataset.note}) differ{'' if len(differ) > 1 else 's'} from run {workdir}'s "
            f"({name}: fingerprint {_short(held['splits'].get(name))} recorded, "
            f"{_short(data['splits'].get(name))} now); {fix}"
        )
