"""What defines a run, so that resuming in a workdir never mixes two runs.

A workdir's ``config.json`` records the fields that define its run (:data:`RUN_FIELDS`)
and, under ``resolved.data_identity``, the data actually used (:func:`data_identity`):
the source, the number of train and test examples, a fingerprint of the arrays and the
npz file. :func:`check_same_run` compares them with a new run's and raises one line on
the first difference, before anything in the workdir changes.

Example:
  >>> check_same_run("runs/mnist", saved, run_fields(cfg))
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

from meshensemble import data as data_lib
from meshensemble.core.distributed import agree
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
)
"""Config fields a resumed run must keep: they define the members, their optimizer and
schedule, their data order (bagging included), augmentation and loss (label smoothing) and
the held-out validation split. ``epochs`` counts only for
a decaying schedule (a constant rate can be extended by more epochs) and
``warmup_epochs`` only for ``warmup_cosine``, ``augment_shift`` only with ``augment``.
``input`` (``device``/``stream``) is not among them: both inputs train the same members from
the same order, so a run may resume with the other one (the streamed iterator's position is
restored from the checkpoint)."""
DATA_KEYS = ("source", "num_train", "num_test", "fingerprint", "data_file")
"""Keys of :func:`data_identity`, compared in this order."""
FINGERPRINT_SAMPLES = 1024
"""Images per split hashed by :func:`data_fingerprint` (evenly strided)."""


def run_fields(cfg: TrainConfig) -> dict[str, Any]:
    """The values of :data:`RUN_FIELDS` that shape ``cfg``'s run.

    Args:
      cfg: a validated config.

    Returns:
      ``{field: value}``, without ``epochs`` for a constant schedule and without
      ``warmup_epochs`` unless the schedule is ``warmup_cosine``, without ``augment_shift``
      when ``augment`` is ``"none"``.

    Example:
      >>> sorted(run_fields(TrainConfig()))[:3]
      ['batch_size', 'dataset', 'learning_rate']
    """
    out = {name: getattr(cfg, name) for name in RUN_FIELDS}
    if cfg.schedule == "constant":
        del out["epochs"]
    if cfg.schedule != "warmup_cosine":
        del out["warmup_epochs"]
    if cfg.augment == "none":
        del out["augment_shift"]
    return out


def data_fingerprint(dataset: data_lib.Dataset) -> str:
    """A cheap fingerprint of a dataset's arrays: shapes, all labels, strided images.

    Args:
      dataset: the data.

    Returns:
      16 hex digits of a SHA-256 over the shapes, every label and
      :data:`FINGERPRINT_SAMPLES` evenly strided images of each split.

    Example:
      >>> data_fingerprint(me.data.synthetic(64, 16))
      '3f...'
    """
    digest = hashlib.sha256()
    for images, labels in (
        (dataset.train_images, dataset.train_labels),
        (dataset.test_images, dataset.test_labels),
    ):
        stride = max(1, len(images) // FINGERPRINT_SAMPLES)
        digest.update(repr((images.shape, str(images.dtype), labels.shape)).encode())
        digest.update(np.ascontiguousarray(labels, np.int64).tobytes())
        digest.update(np.ascontiguousarray(images[::stride]).tobytes())
    return digest.hexdigest()[:16]


def data_identity(dataset: data_lib.Dataset, data_file: str | None) -> dict[str, Any]:
    """What a run's data was, as recorded in ``config.json`` (``resolved.data_identity``).

    Args:
      dataset: the data the run uses.
      data_file: the config's ``data_file``; recorded (absolute) only when the data came
        from an npz file.

    Returns:
      ``{"source", "num_train", "num_test", "fingerprint", "data_file"}``.

    Example:
      >>> data_identity(me.data.synthetic(64, 16), None)["num_train"]
      64
    """
    from_file = dataset.source == "npz" and data_file is not None
    return {
        "source": dataset.source,
        "num_train": len(dataset.train_labels),
        "num_test": len(dataset.test_labels),
        "fingerprint": data_fingerprint(dataset),
        "data_file": os.path.abspath(data_file) if from_file else None,
    }


AGREED_DATA_KEYS = ("source", "num_train", "num_test", "fingerprint")
"""Keys of :func:`data_identity` every process must share (the npz path may differ)."""


def agree_data(identity: dict[str, Any], note: str | None = None) -> None:
    """Stops every process unless all resolved the same data (a collective; free in one).

    Args:
      identity: this process's :func:`data_identity`.
      note: the dataset's note, quoted in the message (e.g. where the data came from).

    Raises:
      meshensemble.core.distributed.DisagreementError: one line naming the first process
        whose data differs from process 0's, both hosts and the differing keys, e.g.
        ``the data differs between processes: process 1 (host-b) has source='sample',
        num_train=4000 (embedded MNIST sample ...), process 0 (host-a) has source='tfds',
        num_train=60000 (full MNIST from TFDS ...); pass the same --source/--data-file/
        --data-dir (and the same file contents) on every host``.

    Example:
      >>> agree_data(data_identity(dataset, cfg.data_file), dataset.note)
    """
    agree(
        "the data",
        identity,
        "pass the same --source/--data-file/--data-dir (and the same file contents) on every host",
        compare=AGREED_DATA_KEYS,
        label=note,
    )


def read_saved_config(workdir: str) -> dict[str, Any] | None:
    """The JSON object of the workdir's ``config.json``, or None when there is none.

    Args:
      workdir: the run's folder.

    Returns:
      The parsed object (fields and ``resolved``), or None.

    Raises:
      ValueError: the file exists but is not a JSON object (one line naming it).

    Example:
      >>> read_saved_config("runs/mnist")["seed"]
      0
    """
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            loaded = json.load(f)
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
      >>> check_same_run("runs/mnist", read_saved_config("runs/mnist"), run_fields(cfg))
    """
    for name, value in fields.items():
        if name in saved and saved[name] != value:
            held, this = f"{name}={saved[name]!r}", f"{name}={value!r}"
            raise _refuse(workdir, held, this, f"resume with {held}")
    resolved = saved.get("resolved")
    held_data = resolved.get("data_identity") if isinstance(resolved, dict) else None
    if data is None or not isinstance(held_data, dict):
        return
    for key in DATA_KEYS:
        if key in held_data and held_data[key] != data[key]:
            note = resolved.get("data") or "the same data"
            label = {"fingerprint": "data fingerprint", "source": "data source"}.get(key, key)
            raise _refuse(
                workdir,
                f"{label}={held_data[key]!r}",
                f"{label}={data[key]!r}",
                f"resume with the run's data ({note})",
            )
