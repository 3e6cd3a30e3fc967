"""Regression data: float features ``[N, F]`` and targets ``[N, T]``, four sources, standardising.

Sources, each returning a :class:`~meshensemble.data.Dataset` with float targets ``[N, T]``
(``RegressionData`` is its old name, kept as an alias):

* :func:`toy1d`: the 1-D toy of Lakshminarayanan et al. (2017), ``y = x^3 + noise``
  with ``x`` uniform in ``[-4, 4]`` and noise ``N(0, 3^2)``, generated from a seed;
* :func:`diabetes`: scikit-learn's ``load_diabetes`` (442 patients, 10 features, it
  ships inside scikit-learn), split 80/20 by a seed;
* :func:`friedman1`: scikit-learn's ``make_friedman1`` (1,000 rows of 10 uniform features,
  5 of them used, noise sd 1), drawn and split 80/20 by a seed;
* :func:`load_regression_npz`: an npz with float ``x_train``, ``y_train``, ``x_test``,
  ``y_test`` (features ``[N, F]``, targets ``[N]`` or ``[N, T]``).

:func:`standardizer` gives the train split's means and standard deviations, which
:class:`meshensemble.tasks.Regression` (``target_shift`` / ``target_scale``) and an
``input_transform`` use so the members learn in standardised units while every
prediction is in the data's own units.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from meshensemble.data.dataset import DataError, Dataset, split_counts
from meshensemble.runtime import storage

__all__ = [
    "RegressionData", "diabetes", "friedman1", "load_regression_npz", "standardizer", "toy1d",
]  # fmt: skip

KEYS = ("x_train", "y_train", "x_test", "y_test")

RegressionData = Dataset
"""The old name of regression data: a :class:`~meshensemble.data.Dataset` with float
features ``[N, F]`` and float targets ``[N, T]`` (``num_classes`` None)."""


def _validated(arrays: dict[str, Any], name: str, source: str, note: str) -> Dataset:
    """``arrays`` as float32 ``[N, F]`` / ``[N, T]``; DataError naming the problem otherwise."""
    out = {}
    for key in KEYS:
        a = np.asarray(arrays[key])
        if not np.issubdtype(a.dtype, np.floating) and not np.issubdtype(a.dtype, np.integer):
            raise DataError(f"{name}: {key} has dtype {a.dtype}; give float features and targets")
        a = a.astype(np.float32)
        if key.startswith("y") and a.ndim == 1:
            a = a[:, None]
        if a.ndim != 2 or a.shape[0] == 0:
            want = "[N, F]" if key.startswith("x") else "[N] or [N, T]"
            raise DataError(f"{name}: {key} has shape {a.shape}; give {want} with N > 0")
        if not np.all(np.isfinite(a)):
            raise DataError(f"{name}: {key} holds NaN or inf; clean the data first")
        out[key] = a
    for split in ("train", "test"):
        if out[f"x_{split}"].shape[0] != out[f"y_{split}"].shape[0]:
            raise DataError(
                f"{name}: x_{split} has {out[f'x_{split}'].shape[0]} rows but y_{split} has "
                f"{out[f'y_{split}'].shape[0]}; give one target row per example"
            )
    if out["x_train"].shape[1] != out["x_test"].shape[1]:
        raise DataError(f"{name}: x_train and x_test have different feature counts")
    if out["y_train"].shape[1] != out["y_test"].shape[1]:
        raise DataError(f"{name}: y_train and y_test have different target counts")
    note = f"{note} ({split_counts(out['y_train'], out['y_test'])})"
    return Dataset(name, **out, source=source, note=note)


def toy1d(seed: int = 0, n_train: int = 20, n_test: int = 200) -> RegressionData:
    """The paper's 1-D toy: ``y = x^3 + eps``, ``x ~ U[-4, 4]``, ``eps ~ N(0, 3^2)``.

    Args:
      seed: the numpy generator's seed (the same seed gives the same data).
      n_train: training points (the paper: 20).
      n_test: test points, from the same distribution.

    Returns:
      A :class:`RegressionData` with ``F = T = 1``.

    Example:
      >>> data = me.data.toy1d(seed=0)
      >>> data.x_train.shape, data.y_train.shape
      ((20, 1), (20, 1))
    """
    rng = np.random.default_rng(seed)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        x = rng.uniform(-4.0, 4.0, (n, 1))
        return x, x**3 + rng.normal(0.0, 3.0, (n, 1))

    (xa, ya), (xb, yb) = draw(n_train), draw(n_test)
    arrays = dict(x_train=xa, y_train=ya, x_test=xb, y_test=yb)
    return _validated(arrays, "toy1d", "toy1d", f"the 1-D toy y = x^3 + noise, seed {seed}")


def diabetes(seed: int = 0, test_fraction: float = 0.2) -> RegressionData:
    """scikit-learn's diabetes data (442 x 10 features, 1 target), split by a seed.

    Args:
      seed: the permutation's seed.
      test_fraction: the test share (default 0.2: an 80/20 split).

    Returns:
      A :class:`RegressionData`: ``round(test_fraction * 442)`` test rows, the rest train
      (354 train, 88 test for 0.2).

    Raises:
      DataError: scikit-learn is not installed, or ``test_fraction`` not in ``(0, 1)``.

    Example:
      >>> data = me.data.diabetes(seed=0)   # scikit-learn's copy, no network
      >>> data.x_train.shape, data.y_train.shape, data.x_test.shape   # 354 / 88 rows
      ((354, 10), (354, 1), (88, 10))
    """
    if not 0 < test_fraction < 1:
        raise DataError(f"diabetes: test_fraction={test_fraction!r} must be in (0, 1)")
    note = f"scikit-learn's diabetes data, split by seed {seed}"
    load = lambda datasets: datasets.load_diabetes(return_X_y=True)
    return _from_sklearn("diabetes", load, seed, test_fraction, note)


def friedman1(seed: int = 0, n: int = 1000, noise: float = 1.0,
              test_fraction: float = 0.2) -> RegressionData:  # fmt: skip
    """scikit-learn's Friedman #1 problem: ``n`` rows drawn from a seed, split 80/20 by it.

    ``y = 10 sin(pi x1 x2) + 20 (x3 - 0.5)^2 + 10 x4 + 5 x5 + N(0, noise^2)`` with 10
    features uniform in ``[0, 1]`` (the last 5 unused): a smooth nonlinear target whose
    noise is known, so a calibrated 90% interval is about ``2 * 1.645 * noise`` wide.

    Args:
      seed: draws the rows (``make_friedman1(random_state=seed)``) and the split.
      n: rows in all; noise: the noise's standard deviation.
      test_fraction: the test share (default 0.2: 800 train, 200 test rows).

    Returns:
      A :class:`RegressionData` with ``F = 10``, ``T = 1``.

    Raises:
      DataError: scikit-learn is not installed, or a bad ``n``, ``noise`` or fraction.

    Example:
      >>> data = me.data.friedman1(seed=0)
      >>> data.x_train.shape, data.y_test.shape
      ((800, 10), (200, 1))
    """
    if not 0 < test_fraction < 1:
        raise DataError(f"friedman1: test_fraction={test_fraction!r} must be in (0, 1)")
    if not isinstance(n, int) or n < 3 or not noise >= 0:
        raise DataError(f"friedman1: n={n!r} must be an integer >= 3 and noise={noise!r} >= 0")
    note = f"scikit-learn's make_friedman1 ({n} rows, noise {noise:g}), seed {seed}"
    make = lambda datasets: datasets.make_friedman1(n_samples=n, noise=noise, random_state=seed)
    return _from_sklearn("friedman1", make, seed, test_fraction, note)


def _from_sklearn(
    name: str, load: Callable[[Any], Any], seed: int, test_fraction: float, note: str
) -> Dataset:
    """``load(sklearn.datasets) -> (x, y)``, split by a permutation drawn from ``seed``."""
    try:
        from sklearn import datasets
    except ImportError:
        raise DataError(
            f"{name}: scikit-learn is not installed; pip install scikit-learn"
        ) from None
    x, y = load(datasets)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(test_fraction * len(x)))
    test, train = order[:n_test], order[n_test:]
    arrays = dict(x_train=x[train], y_train=y[train], x_test=x[test], y_test=y[test])
    return _validated(arrays, name, name, note)


def load_regression_npz(path: str | os.PathLike) -> RegressionData:
    """Reads an npz with float ``x_train``, ``y_train``, ``x_test``, ``y_test``.

    Args:
      path: the file; features ``[N, F]``, targets ``[N]`` or ``[N, T]``.

    Returns:
      A :class:`RegressionData` (targets ``[N, T]``, float32).

    Raises:
      DataError: a missing file or key, a bad shape or dtype, NaN or inf.

    Example:
      >>> rng = np.random.default_rng(0)
      >>> x, y = rng.normal(size=(12, 3)).astype(np.float32), rng.normal(size=(12, 1))
      >>> np.savez("house.npz", x_train=x[:8], y_train=y[:8], x_test=x[8:], y_test=y[8:])
      >>> data = me.data.load_regression_npz("house.npz")
      >>> data.x_train.shape, data.y_test.shape
      ((8, 3), (4, 1))
    """
    name = os.fspath(path)
    if not storage.isfile(name):
        raise DataError(f"{name}: no such file; give an npz with x_train, y_train, x_test, y_test")
    try:
        with np.load(storage.openable(name), allow_pickle=False) as f:
            missing = [k for k in KEYS if k not in f.files]
            if missing:
                raise DataError(f"{name}: has no {', '.join(missing)}; save all of {KEYS}")
            arrays = {k: f[k] for k in KEYS}
    except (OSError, ValueError) as err:
        if isinstance(err, DataError):
            raise
        raise DataError(f"{name}: not a readable npz ({err}); save it with numpy.savez") from None
    return _validated(arrays, name, "npz", f"regression data from {name}")


def standardizer(data: RegressionData) -> dict[str, list[float]]:
    """The train split's statistics: ``x_mean``, ``x_std``, ``y_mean``, ``y_std`` (lists).

    A constant column gets standard deviation 1 (it is only centred).

    Example:
      >>> stats = standardizer(me.data.toy1d())
      >>> task = me.tasks.Regression(1, target_shift=stats["y_mean"], target_scale=stats["y_std"])
      >>> sorted(stats)
      ['x_mean', 'x_std', 'y_mean', 'y_std']
    """
    std = lambda a: np.where(a.std(0) > 0, a.std(0), 1.0)
    return {
        "x_mean": data.x_train.mean(0).tolist(),
        "x_std": std(data.x_train).tolist(),
        "y_mean": data.y_train.mean(0).tolist(),
        "y_std": std(data.y_train).tolist(),
    }
