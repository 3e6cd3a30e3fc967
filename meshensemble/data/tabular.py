"""Tabular data from CSV: a named target column, every other column a float feature.

:func:`load_csv` reads a train CSV and a test CSV (or holds a seeded fraction of the train
rows out as the test split). The first line names the columns. The target column gives
class ids when its values are names or integers (the train file's distinct values,
sorted, then numbered from 0: recorded as ``class_names``) and float targets ``[N, 1]``
when a value has a fraction (``targets=`` decides explicitly). Every other column must
hold a number in every row. Each problem is one line naming the file, the row and the column.

Example:
  >>> with open("wine.csv", "w") as f:
  ...     _ = f.write("alcohol,hue,kind\\n13.2,1.0,red\\n12.1,0.9,white\\n14.0,1.1,red\\n"
  ...                 "12.5,0.8,white\\n")
  >>> ds = load_csv("wine.csv", target_column="kind", test_fraction=0.5)
  >>> ds.x_train.shape, ds.class_names, ds.num_test
  ((2, 2), ('red', 'white'), 2)
"""

from __future__ import annotations

import csv
import io
import os
from typing import Any

import numpy as np

from meshensemble.data.dataset import DataError, Dataset, split_counts
from meshensemble.data.split import validation_indices
from meshensemble.runtime import storage

TARGET_KINDS = ("auto", "classes", "floats")
"""Values of ``load_csv(targets=...)``: decide from the values, class ids, float targets."""


def read_csv(path: str | os.PathLike) -> tuple[list[str], list[list[str]]]:
    """A CSV file's header and rows, as strings.

    Args:
      path: the file.

    Returns:
      ``(columns, rows)``; every row has one cell per column.

    Raises:
      DataError: a missing or empty file, a repeated column name, or a row with another
        number of cells (one line naming the file and the line).

    Example:
      >>> with open("t.csv", "w") as f:
      ...     _ = f.write("a,b\\n1,2\\n")
      >>> read_csv("t.csv")
      (['a', 'b'], [['1', '2']])
    """
    path = os.path.expanduser(os.fspath(path))
    if not storage.isfile(path):
        raise DataError(f"{path}: no such file; pass a CSV whose first line names the columns")
    try:
        text = storage.read_bytes(path).decode("utf-8-sig")
        lines = [row for row in csv.reader(io.StringIO(text, newline="")) if row]
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise DataError(f"{path}: not a readable CSV ({type(err).__name__}: {err})") from None
    if len(lines) < 2:
        raise DataError(f"{path}: no rows below the header; a CSV needs a header and rows")
    columns = [c.strip() for c in lines[0]]
    repeated = sorted({c for c in columns if columns.count(c) > 1})
    if repeated:
        raise DataError(f"{path}: column {repeated[0]!r} appears twice; name each column once")
    for i, row in enumerate(lines[1:], start=2):
        if len(row) != len(columns):
            raise DataError(
                f"{path}: line {i} has {len(row)} cells, the header {len(columns)}; give "
                "every row one cell per column"
            )
    return columns, [[cell.strip() for cell in row] for row in lines[1:]]


def _features(path: str, columns: list[str], rows: list[list[str]], names: list[str]) -> np.ndarray:
    """The columns ``names`` of ``rows`` as float32 ``[N, F]`` (a bad cell: one line)."""
    where = [columns.index(n) for n in names]
    out = np.empty((len(rows), len(names)), np.float32)
    for i, row in enumerate(rows):
        for j, k in enumerate(where):
            try:
                out[i, j] = float(row[k])
            except ValueError:
                raise DataError(
                    f"{path}: line {i + 2}, column {names[j]!r} holds {row[k]!r}; every "
                    "column but the target must hold a number in every row"
                ) from None
    if not np.isfinite(out).all():
        i, j = (int(v[0]) for v in np.nonzero(~np.isfinite(out)))
        raise DataError(f"{path}: line {i + 2}, column {names[j]!r} is not finite ({out[i, j]})")
    return out


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _targets(values: list[str], kind: str) -> tuple[np.ndarray, tuple[str, ...] | None]:
    """Class ids and their names, or float targets ``[N, 1]`` and None."""
    numbers = [_number(v) for v in values]
    for i, (value, number) in enumerate(zip(values, numbers, strict=True)):
        if not value or number is not None and not np.isfinite(number):
            raise DataError(
                f"line {i + 2} holds {value!r}; every row needs a target (a class or a finite "
                "number): drop that row or fill it in"
            )
    numeric = all(n is not None for n in numbers)
    if kind == "floats" or kind == "auto" and numeric and any(n != int(n) for n in numbers):
        if not numeric:
            bad = values[[n is None for n in numbers].index(True)]
            raise DataError(f"target value {bad!r} is not a number; float targets need numbers")
        return np.asarray(numbers, np.float32)[:, None], None
    if numeric:  # integer classes sort as numbers: 2 before 10
        names = tuple(sorted(set(values), key=lambda v: (float(v), v)))
    else:
        names = tuple(sorted(set(values)))
    ids = {v: i for i, v in enumerate(names)}
    return np.asarray([ids[v] for v in values], np.int32), names


def load_csv(
    train_file: str | os.PathLike,
    *,
    target_column: str,
    test_file: str | os.PathLike | None = None,
    test_fraction: float | None = None,
    seed: int = 0,
    name: str | None = None,
    targets: str = "auto",
) -> Dataset:
    """Reads tabular data from CSV: the target column, and every other column as a feature.

    Args:
      train_file: the training CSV (first line: the column names).
      target_column: the column holding the targets.
      test_file: the test CSV, with the same columns (in any order).
      test_fraction: instead of ``test_file``, the share of the train rows held out as
        the test split, in ``(0, 1)``: seeded, stratified by class for class ids (as the
        validation split, :func:`~meshensemble.data.split.validation_indices`).
      seed: the seed of that draw.
      name: the dataset's name (default: the train file's stem).
      targets: one of :data:`TARGET_KINDS`: ``"auto"`` gives class ids unless a target
        value has a fraction (then float targets ``[N, 1]``); ``"classes"``, ``"floats"``.

    Returns:
      A :class:`Dataset` with ``source="csv"``: float32 features ``[N, F]`` (the columns in
      the train file's order) and int32 class ids (the distinct train values, sorted, in
      ``class_names``) or float32 targets ``[N, 1]``.

    Raises:
      DataError: one line: a missing column (naming the columns present), a cell that is
        not a number, a test class that train does not have, both or neither of
        ``test_file`` and ``test_fraction``, or a file problem.

    Example:
      >>> with open("t.csv", "w") as f:
      ...     _ = f.write("x1,x2,y\\n0.5,1,2.5\\n0.1,2,0.25\\n0.3,0,1.0\\n")
      >>> ds = load_csv("t.csv", target_column="y", test_fraction=0.34)
      >>> ds.num_classes, ds.y_train.shape
      (None, (2, 1))
    """
    if targets not in TARGET_KINDS:
        raise DataError(f"targets={targets!r}; use one of {', '.join(TARGET_KINDS)}")
    if (test_file is None) == (test_fraction is None):
        raise DataError(
            "load_csv: pass a test file (--test-file TEST.csv) or a test fraction "
            "(--test-fraction F), exactly one of them"
        )
    if test_fraction is not None and not 0 < test_fraction < 1:
        raise DataError(f"test_fraction={test_fraction!r}; pass a share in (0, 1), e.g. 0.2")
    path = os.path.expanduser(os.fspath(train_file))
    columns, rows = read_csv(path)
    _check_column(path, columns, target_column)
    names = [c for c in columns if c != target_column]
    if not names:
        raise DataError(f"{path}: only the target column {target_column!r}; give feature columns")
    if test_file is not None:  # both files' columns first: a cheap check before parsing
        test_path = os.path.expanduser(os.fspath(test_file))
        test_columns, test_rows = read_csv(test_path)
        for column in columns:
            _check_column(test_path, test_columns, column)
    x_all = _features(path, columns, rows, names)  # every row, so messages name its line
    try:
        y_all, classes = _targets([r[columns.index(target_column)] for r in rows], targets)
    except DataError as err:
        raise DataError(f"{path}: column {target_column!r}: {err}") from None
    if test_file is not None:
        test_values = [r[test_columns.index(target_column)] for r in test_rows]
        x = (x_all, _features(test_path, test_columns, test_rows, names))
        y = (y_all, _test_targets(test_path, target_column, test_values, classes))
    else:
        held = _held_out(path, y_all, test_fraction, seed, classes)
        x, y = (x_all[~held], x_all[held]), (y_all[~held], y_all[held])
    name = name or os.path.splitext(os.path.basename(path))[0]
    what = f"{len(classes)} classes" if classes else "float target"
    note = (
        f"{name} from {path}{'' if test_file is None else ' and ' + test_path} "
        f"({split_counts(y[0], y[1])}; {len(names)} features, {target_column!r}: {what})"
    )
    return Dataset(
        name, x[0], y[0], x[1], y[1], source="csv", note=note,
        num_classes=None if classes is None else len(classes), class_names=classes,
    )  # fmt: skip


def _check_column(path: str, columns: list[str], column: str) -> None:
    if column not in columns:
        raise DataError(
            f"{path}: no column {column!r}; the columns are {', '.join(columns)} (pass one of "
            "them as the target column, and give the test file the train file's columns)"
        )


def _held_out(
    path: str, y: np.ndarray, fraction: Any, seed: int, classes: tuple[str, ...] | None
) -> np.ndarray:
    """A bool mask of the rows held out: a seeded ``fraction``, stratified by class for
    class ids (:func:`~meshensemble.data.split.validation_indices`), else at random."""
    n = len(y)
    n_test = int(round(fraction * n))
    if not 1 <= n_test < n:
        raise DataError(
            f"{path}: test_fraction={fraction} of {n} rows holds out {n_test}; leave at least "
            "one row in each split"
        )
    held = np.zeros(n, bool)
    held[validation_indices(y, n_test, seed, len(classes or ()))] = True
    return held


def _test_targets(
    test_path: str, column: str, values: list[str], classes: tuple[str, ...] | None
) -> np.ndarray:
    """The test file's targets: float ``[M, 1]``, or class ids coded by the train classes."""
    if classes is None:
        try:
            return _targets(values, "floats")[0]
        except DataError as err:
            raise DataError(f"{test_path}: column {column!r}: {err}") from None
    unknown = sorted(set(values) - set(classes))
    if unknown:
        raise DataError(
            f"{test_path}: column {column!r} holds the class {unknown[0]!r}, which the train "
            f"split does not have (its classes: {', '.join(classes)}); drop those rows"
        )
    ids = {v: i for i, v in enumerate(classes)}
    return np.asarray([ids[v] for v in values], np.int32)
