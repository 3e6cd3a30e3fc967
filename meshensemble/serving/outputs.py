"""The files of ``meshensemble predict`` and ``export``: checked first, written atomically.

:func:`check_out_file` refuses a ``--out`` that cannot be written before any work;
:func:`write_predictions` writes the ``.npz`` or ``.csv`` of :meth:`Predictor.outputs
<meshensemble.serving.predictor.Predictor.outputs>` through a temporary file renamed into
place (:func:`atomic_write`), so a failed or interrupted command leaves no half-written
file.

Example:
  >>> check_out_file("preds.csv")
  '.csv'
  >>> names = [f"digit_{i}.png" for i in range(len(images))]
  >>> write_predictions("preds.csv", predictor.outputs(images), names)
  >>> open("preds.csv").readline().strip()
  'name,label,confidence,entropy,mutual_information'
"""

from __future__ import annotations

import csv
import io
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from meshensemble.training.outputs import check_writable, writing

OUT_SUFFIXES = (".npz", ".csv")
"""The kinds of ``--out`` file ``meshensemble predict`` writes."""
CSV_COLUMNS = ("label", "confidence", "entropy", "mutual_information")
"""Columns of a ``.csv`` after ``index`` (or ``name``), before ``prediction_set``."""
REGRESSION_COLUMNS = ("mean", "variance", "aleatoric", "epistemic", "lower", "upper")
"""Columns of a regression run's ``.csv`` (one per target each), those present."""


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
    if os.path.isdir(path):
        raise ValueError(f"--out {path} is a folder; give a file ending in {kind}")
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


def atomic_write(path: str, data: bytes | Callable[[Any], Any]) -> None:
    """Writes ``path`` through a temporary file beside it, renamed into place when complete.

    Args:
      path: the file.
      data: the bytes, or ``write(f)`` that writes into the open binary file.

    Raises:
      meshensemble.training.OutputError: one line naming the file (disk full, permissions).

    Example:
      >>> os.makedirs("out")
      >>> atomic_write("out/x.json", b"{}")
      >>> open("out/x.json").read(), os.listdir("out")   # no temporary file left
      ('{}', ['x.json'])
    """
    folder = os.path.dirname(os.path.abspath(path))
    with writing(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                if isinstance(data, bytes | bytearray):
                    f.write(data)
                else:
                    data(f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise


def write_predictions(
    path: str, out: Mapping[str, np.ndarray], names: Sequence[str] | None = None
) -> None:
    """Writes a prediction's arrays to ``path`` (``.npz``: every array; ``.csv``: a row each).

    The ``.npz`` holds every array of ``out`` under its key, plus ``names`` (the input
    folder's file names) when given. The ``.csv`` has a header and one row per example:
    ``index`` (or ``name``), ``label``, ``confidence``, ``entropy``,
    ``mutual_information`` and, when ``out`` has sets, ``prediction_set`` (the classes in
    the set, separated by spaces; empty for an empty set). For a regression run's
    outputs (``mean`` ``[N, T]``...) the columns are ``mean``, ``variance``,
    ``aleatoric``, ``epistemic`` and, when calibrated, ``lower``, ``upper``, each
    suffixed ``_t`` per target when ``T > 1``.

    Args:
      path: the ``.npz`` or ``.csv`` file (checked by :func:`check_out_file`).
      out: the arrays of :meth:`~meshensemble.serving.predictor.Predictor.outputs`.
      names: the examples' names, or None to number them.

    Raises:
      meshensemble.training.OutputError: the file could not be written.

    Example:
      >>> write_predictions("preds.npz", predictor.outputs(images))
      >>> sorted(np.load("preds.npz"))
      ['confidence', 'entropy', 'label', 'mutual_information', 'probs']
    """
    if path.lower().endswith(".csv"):
        rows = _write_regression_csv if "mean" in out else _write_csv
        atomic_write(path, lambda f: rows(f, out, names))
        return
    arrays = dict(out)
    if names is not None:
        arrays["names"] = np.asarray(list(names), dtype=str)
    atomic_write(path, lambda f: np.savez(f, **arrays))


def _write_csv(f: Any, out: Mapping[str, np.ndarray], names: Sequence[str] | None) -> None:
    text = io.TextIOWrapper(f, encoding="utf-8", newline="")
    rows = csv.writer(text)
    sets = out.get("prediction_set")
    head = ["name" if names is not None else "index", *CSV_COLUMNS]
    rows.writerow(head + (["prediction_set"] if sets is not None else []))
    n = len(out["label"])
    for i in range(n):
        row = [names[i] if names is not None else i, int(out["label"][i])]
        row += [f"{float(out[k][i]):.6g}" for k in CSV_COLUMNS[1:]]
        if sets is not None:
            row.append(" ".join(map(str, np.flatnonzero(sets[i]))))
        rows.writerow(row)
    text.flush()
    text.detach()


def _write_regression_csv(
    f: Any, out: Mapping[str, np.ndarray], names: Sequence[str] | None
) -> None:
    text = io.TextIOWrapper(f, encoding="utf-8", newline="")
    rows = csv.writer(text)
    keys = [k for k in REGRESSION_COLUMNS if k in out]
    t = out["mean"].shape[1]
    cols = [k if t == 1 else f"{k}_{j}" for k in keys for j in range(t)]
    rows.writerow(["name" if names is not None else "index", *cols])
    for i in range(len(out["mean"])):
        values = [f"{float(out[k][i, j]):.8g}" for k in keys for j in range(t)]
        rows.writerow([names[i] if names is not None else i, *values])
    text.flush()
    text.detach()
