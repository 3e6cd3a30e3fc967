"""The files of ``meshensemble predict`` and ``export``: checked first, written atomically.

:func:`check_out_file` refuses a ``--out`` that cannot be written before any work;
:func:`write_predictions` writes the ``.npz`` or ``.csv`` of :meth:`Predictor.outputs
<meshensemble.serving.predictor.Predictor.outputs>` through a temporary file renamed into
place (:func:`meshensemble.runtime.storage.atomic_write`: one object on a bucket), so a
failed or interrupted command leaves no half-written file.

Example:
  >>> check_out_file("preds.csv")
  '.csv'
  >>> names = [f"digit_{i}.png" for i in range(len(images))]
  >>> out = predictor.outputs(images)
  >>> write_predictions("preds.csv", out, names, predictor.task.csv_keys(out))
  >>> open("preds.csv").readline().strip()
  'name,label,confidence,entropy,mutual_information'
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from meshensemble.runtime import storage
from meshensemble.training.outputs import check_writable, writing

OUT_SUFFIXES = (".npz", ".csv")
"""The kinds of ``--out`` file ``meshensemble predict`` writes."""
"""Columns of a ``.csv`` after ``index`` (or ``name``), before ``prediction_set``."""

def check_out_file(path: str, source: str | None = None) -> str:
    """Refuses a ``--out`` file that is of an unknown kind, cannot be written or is the input.

    Args:
      path: the output file (``.npz`` or ``.csv``); its folder must exist and be writable.
      source: the ``--input`` path, which ``path`` must not be (through a link, a relative
        path or a hard link alike): writing the predictions would replace the input.

    Returns:
      The kind, ``".npz"`` or ``".csv"``.

    Raises:
      ValueError: another suffix, a folder in the way, a missing or read-only folder, or
        the input file itself.

    Example:
      >>> check_out_file("preds.npz")
      '.npz'
    """
    kind = os.path.splitext(path)[1].lower()
    if kind not in OUT_SUFFIXES:
        raise ValueError(f"--out {path}: give a file ending in .npz or .csv")
    if storage.isdir(path):
        raise ValueError(f"--out {path} is a folder; give a file ending in {kind}")
    if not storage.is_local(path):  # a bucket: no folder to make, a failed upload names it
        return kind
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--out {path}: folder {folder} does not exist; create it first")
    check_writable(folder, "give a writable --out", name=f"--out {path}: its folder")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"--out {path} exists and is read-only; give a writable --out")
    same = source is not None and os.path.exists(path) and os.path.exists(source)
    if same and os.path.samefile(path, source):
        raise ValueError(
            f"--out {path} is the --input file {source}: the predictions would replace it; "
            "give another --out"
        )
    return kind


def write_predictions(
    path: str,
    out: Mapping[str, np.ndarray],
    names: Sequence[str] | None = None,
    columns: Sequence[str] | None = None,
) -> None:
    """Writes a prediction's arrays to ``path`` (``.npz``: every array; ``.csv``: a row each).

    The ``.npz`` holds every array of ``out`` under its key, plus ``names`` (the input
    folder's file names) when given. The ``.csv`` has a header and one row per example:
    ``index`` (or ``name``), then ``columns`` (the task's ``csv_keys``: e.g. ``label``,
    ``confidence``, ``entropy``, ``mutual_information``, ``prediction_set`` for
    classification; ``mean``, ``variance``, ... for regression): an ``[N]`` array is one
    column, a float ``[N, T]`` array ``T`` columns (suffixed ``_t`` when ``T > 1``), a bool
    ``[N, C]`` array (a set) one column of the members' indices separated by spaces.

    Args:
      path: the ``.npz`` or ``.csv`` file (checked by :func:`check_out_file`).
      out: the arrays of :meth:`~meshensemble.serving.predictor.Predictor.outputs`.
      names: the examples' names, or None to number them.
      columns: the ``.csv``'s columns (default every array without a member axis).

    Raises:
      meshensemble.training.OutputError: the file could not be written.

    Example:
      >>> write_predictions("preds.npz", predictor.outputs(images))
      >>> sorted(np.load("preds.npz"))
      ['confidence', 'entropy', 'label', 'mutual_information', 'probs']
    """
    if path.lower().endswith(".csv"):
        keys = list(columns) if columns is not None else [
            k for k in out if not k.startswith("member_")
        ]  # fmt: skip
        with writing(path):
            storage.atomic_write(path, lambda f: _write_csv(f, out, names, keys))
        return
    arrays = dict(out)
    if names is not None:
        arrays["names"] = np.asarray(list(names), dtype=str)
    with writing(path):
        storage.atomic_write(path, lambda f: np.savez(f, **arrays))


def _cells(v: np.ndarray, key: str) -> tuple[list[str], Any]:
    """The header names of one array and a function of the row index giving its cells."""
    if v.dtype == bool and v.ndim == 2:
        return [key], lambda i: [" ".join(map(str, np.flatnonzero(v[i])))]
    if np.issubdtype(v.dtype, np.integer):
        return [key], lambda i: [str(int(v[i]))]
    if v.ndim == 1:
        return [key], lambda i: [f"{float(v[i]):.8g}"]
    t = v.shape[1]
    heads = [key] if t == 1 else [f"{key}_{j}" for j in range(t)]
    return heads, lambda i: [f"{float(v[i, j]):.8g}" for j in range(t)]


def _write_csv(
    f: Any, out: Mapping[str, np.ndarray], names: Sequence[str] | None, keys: Sequence[str]
) -> None:
    text = io.TextIOWrapper(f, encoding="utf-8", newline="")
    rows = csv.writer(text)
    parts = [_cells(np.asarray(out[k]), k) for k in keys]
    rows.writerow(["name" if names is not None else "index", *(h for p in parts for h in p[0])])
    n = len(next(iter(out.values())))
    for i in range(n):
        rows.writerow([names[i] if names is not None else i, *(c for p in parts for c in p[1](i))])
    text.flush()
    text.detach()
