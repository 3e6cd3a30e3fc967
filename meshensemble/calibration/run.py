"""Calibrating a trained ensemble: the ``--calibrate`` part of ``meshensemble evaluate``.

:func:`calibrate_ensemble` fits a temperature ("pool, then calibrate") and a split-conformal
threshold on a run's validation split and scores the test set before and after;
:func:`calibration_line` summarises it, :func:`draw_calibration` draws it.
:func:`check_calibration` and :func:`check_split` are the one-line refusals run before
any work (the classification task's calibrator, :class:`meshensemble.tasks.Classification`,
calls them; :func:`meshensemble.evaluation.evaluate_run` asks the task).

Example:
  >>> val, test = (val_images, val_labels), (test_images, test_labels)
  >>> section, curves = calibrate_ensemble(ens, state, val, test, alpha=0.1)
  >>> print(calibration_line(section))
  calibration: T=... on 16 validation examples
    test NLL ... -> ..., ECE ... -> ..., adaptive ECE ... -> ..., Brier ... -> ...
    conformal thr at alpha=0.1: mean set size ..., coverage ...
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from meshensemble import metrics
from meshensemble.calibration._checks import METHODS, smallest_alpha
from meshensemble.calibration.conformal import (
    conformal_quantile,
    coverage,
    prediction_sets,
    set_size,
)
from meshensemble.calibration.temperature import apply_temperature, ensemble_logits, fit_temperature
from meshensemble.core import streaming
from meshensemble.runtime.distributed import fetch
from meshensemble.training.identity import read_saved_config

TEMPERATURE_BOUNDS = (1e-3, 1e3)
"""Range searched for T; a fit at a bound (the NLL still falls there) is refused, not applied
(``temperature_at_bound`` in the section stays for readers of older files: always False)."""
MIN_TEMPERATURE_EXAMPLES = 500
"""Fewer validation examples get a warning: on a 99% model a split of ``n`` is all right
(no temperature fits) with probability ``0.99^n`` (37% at 100, 0.7% at 500)."""
CALIBRATION_PLOT = "calibration.png"
"""Reliability before / after temperature scaling and the conformal set-size histogram."""


def check_calibration(
    n: int, alpha: float, method: str, note: Callable[[str], None] | None = None
) -> None:
    """One-line refusals of a classification calibration on ``n`` validation examples.

    Refuses a bad alpha or method, and an alpha too small for the split (split conformal
    needs ``n >= 1 / alpha - 1``); warns when the split is small for the alpha (``n + 1 <
    10 / alpha``: the coverage then exceeds ``1 - alpha`` by up to ``1 / (n + 1)``, more
    than a tenth of alpha) or for a temperature (fewer than
    :data:`MIN_TEMPERATURE_EXAMPLES`). A warning goes to ``note`` as one line when given
    (the CLI prints it), else to :func:`warnings.warn`.

    Raises:
      ValueError: one line naming the problem and the fix.

    Example:
      >>> check_calibration(1000, 0.1, "thr")   # None: a split large enough
    """
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha!r} must lie in (0, 1), e.g. 0.1 for 90% coverage")
    if method not in METHODS:
        raise ValueError(f"unknown conformal method {method!r}; use {METHODS}")
    warn = note or (lambda msg: warnings.warn(msg, stacklevel=3))
    check_alpha_for(n, alpha, f"the {n} validation examples")
    if n + 1 < 10 / alpha:
        warn(
            f"{n} validation examples are few for alpha={alpha:g}: sets cover up to "
            f"{1 - alpha + 1 / (n + 1):.4f} on average; hold out {math.ceil(10 / alpha) - 1} "
            f"or more for {1 - alpha:g}"
        )
    if n < MIN_TEMPERATURE_EXAMPLES:
        warn(
            f"{n} validation examples are few for a temperature (none fits if all are "
            f"right); hold out {MIN_TEMPERATURE_EXAMPLES} or more (--validation)"
        )


def check_alpha_for(n: int, alpha: float, what: str) -> None:
    """Refuses an ``alpha`` too small for ``n`` calibration examples (``n < 1/alpha - 1``).

    Raises:
      ValueError: one line naming ``what``, the smallest alpha and the split size needed.
    """
    if isinstance(alpha, bool) or not isinstance(alpha, int | float | np.floating):
        raise ValueError(f"alpha={alpha!r} must be a number in (0, 1), e.g. 0.1")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha!r} must lie in (0, 1), e.g. 0.1 for 90% coverage")
    if n < (1.0 - alpha) / alpha - 1e-9:
        need = math.ceil((1.0 - alpha) / alpha - 1e-9)
        raise ValueError(
            f"alpha={alpha:g} is too small for {what}: split conformal needs n >= "
            f"1/alpha - 1 = {need}; use --alpha >= {smallest_alpha(n)} or train with "
            f"--validation {need} or more"
        )


def check_split(workdir: str, split: Any) -> None:
    """The rebuilt validation split must be the one training held out (its fingerprint)."""
    held = ((read_saved_config(workdir) or {}).get("resolved") or {}).get("validation") or {}
    if split is not None and held.get("fingerprint") not in (None, split.fingerprint):
        raise ValueError(
            f"the validation split rebuilt from this data (fingerprint {split.fingerprint}) "
            f"is not the one run {workdir} held out ({held['fingerprint']}); evaluate with "
            "the run's data (its --source and --data-file)"
        )


def stream_ensemble_logits(ens: Any, state: Any, images: Any, batch_size: int = 1000) -> Any:
    """The ensemble's logits ``log(mean_m p^m)`` of every image, streamed on the mesh.

    Per batch, ``ens.predict_members`` is pooled on device by
    :func:`meshensemble.calibration.ensemble_logits`; only ``[b, classes]`` reaches the host.

    Args:
      ens: the :class:`meshensemble.Ensemble`; state: its state; images: ``[N, ...]``.
      batch_size: examples per call.

    Returns:
      float32 numpy ``[N, classes]``.

    Example:
      >>> stream_ensemble_logits(ens, state, val_images, batch_size=8).shape
      (16, 10)
      >>> t = me.calibration.fit_temperature(stream_ensemble_logits(ens, state, val_images),
      ...                                    val_labels)
    """
    parts: list[np.ndarray] = []
    pooled = lambda x, mask: ensemble_logits(ens.predict_members(state, x))
    sink = lambda start, logits: parts.append(np.asarray(logits, np.float32))
    streaming.stream(pooled, images, batch_size, ens.data_size, sink)
    return np.concatenate(parts)


def test_scores(probs: Any, labels: np.ndarray, num_bins: int) -> dict[str, float]:
    return {
        "accuracy": float(np.mean(np.argmax(probs, axis=-1) == labels)),
        "nll": float(metrics.nll(probs, labels)),
        "ece": float(metrics.ece(probs, labels, num_bins)),
        "adaptive_ece": float(metrics.adaptive_ece(probs, labels, num_bins)),
        "brier": float(metrics.brier(probs, labels)),
    }


def calibrate_ensemble(
    ens: Any,
    state: Any,
    validation: tuple[Any, Any],
    test: tuple[Any, Any],
    alpha: float = 0.1,
    method: str = "thr",
    batch_size: int = 1000,
    num_bins: int = 15,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fits a temperature and a conformal threshold on validation data; scores the test set.

    "Pool, then calibrate": ``T`` minimises the validation NLL of
    ``softmax(log(mean_m p^m) / T)`` (:func:`meshensemble.calibration.fit_temperature`);
    the conformal threshold ``q`` is the split-conformal quantile of the validation
    examples' calibrated probabilities at ``alpha``; the test set is scored with the
    uncalibrated and calibrated ensemble, and its prediction sets' size and coverage.

    Args:
      ens: the :class:`meshensemble.Ensemble`; state: its state.
      validation: ``(images, labels)`` held out of training; test: ``(images, labels)``.
      alpha: the miscoverage rate; method: one of :data:`meshensemble.calibration.METHODS`.
      batch_size: examples per call; num_bins: bins of the ECE and the adaptive ECE.

    Returns:
      ``(section, curves)``: ``section`` = ``{"temperature", "num_validation",
      "validation_nll_before", "validation_nll_after", "before", "after", "conformal"}``;
      ``before`` / ``after``: the test ``accuracy, nll, ece, adaptive_ece, brier``;
      ``conformal``: ``method, alpha, threshold, mean_set_size, coverage`` and
      ``set_size_counts[k]``, test sets of size ``k``. ``curves``: reliability data.

    Raises:
      ValueError: bad alpha or method, or too few validation examples for ``alpha``.

    Example:
      >>> val, test = (val_images, val_labels), (test_images, test_labels)
      >>> section, _ = calibrate_ensemble(ens, state, val, test, alpha=0.1)
      >>> sorted(section)
      ['after', 'before', 'conformal', 'num_validation', 'temperature', ...]
      >>> 0 <= section["conformal"]["coverage"] <= 1
      True
    """
    (xv, yv), (xt, yt) = validation, test
    yv, yt = np.asarray(yv, np.int32), np.asarray(yt, np.int32)
    check_alpha_for(len(yv), alpha, f"{len(yv)} validation examples")  # before any work
    zv = stream_ensemble_logits(ens, state, xv, batch_size)
    t = fit_ensemble_temperature(zv, yv)
    pv = np.asarray(apply_temperature(zv, t))
    q = conformal_quantile(pv, yv, alpha, method)
    zt = stream_ensemble_logits(ens, state, xt, batch_size)
    before = np.asarray(apply_temperature(zt, 1.0))
    after = np.asarray(apply_temperature(zt, t))
    sets = prediction_sets(after, q, method)
    sizes = np.asarray(fetch(sets)).sum(axis=-1)
    section = {
        "temperature": float(t),
        "temperature_at_bound": t in TEMPERATURE_BOUNDS,
        "num_validation": int(len(yv)),
        "validation_nll_before": float(metrics.nll(apply_temperature(zv, 1.0), yv)),
        "validation_nll_after": float(metrics.nll(pv, yv)),
        "before": test_scores(before, yt, num_bins),
        "after": test_scores(after, yt, num_bins),
        "conformal": {
            "method": method,
            "alpha": float(alpha),
            "threshold": float(q),
            "mean_set_size": set_size(sets),
            "coverage": coverage(sets, yt),
            "set_size_counts": np.bincount(sizes, minlength=after.shape[-1] + 1).tolist(),
        },
    }
    pairs = (("before", before), ("after", after))
    curves = {k: metrics.reliability_diagram_data(p, yt, num_bins) for k, p in pairs}
    return section, curves


def fit_ensemble_temperature(logits: np.ndarray, labels: np.ndarray) -> float:
    """``fit_temperature`` in :data:`TEMPERATURE_BOUNDS`; a bound is refused, not applied.

    Raises:
      ValueError: one line: the temperature ran to a bound, why, and how large a
        validation split to hold out instead.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = fit_temperature(logits, labels, bounds=TEMPERATURE_BOUNDS, at_bound="warn")
    if t not in TEMPERATURE_BOUNDS:
        return t
    n = len(labels)
    wrong = int(np.sum(np.argmax(logits, axis=-1) != labels))
    if t == TEMPERATURE_BOUNDS[0]:
        why = (
            f"{n - wrong} of the {n} validation examples are classified right, so a sharper "
            "softmax always lowers their NLL and every test mistake would become a confident "
            "one"
        )
        fix = (
            "hold out more examples so that some are wrong (at least 5 / error rate: e.g. "
            "--validation 500 for a 99% model, 5000 for 99.9%) and train again"
        )
    else:
        why = f"the ensemble gets {wrong} of the {n} validation examples wrong: worse than chance"
        fix = "check that the run's data and labels are the ones it was trained on"
    raise ValueError(
        f"the temperature ran to its search bound T={t:g}, which is not a calibration and is "
        f"not applied: {why}; {fix}"
    )


def calibration_line(section: Mapping[str, Any]) -> str:
    """A ``calibration`` section in three lines under 120 characters; e.g.
    ``print(calibration_line(s))``."""
    b, a, c = section["before"], section["after"], section["conformal"]
    at = " (a search bound)" if section.get("temperature_at_bound") else ""
    names = (("NLL", "nll"), ("ECE", "ece"), ("adaptive ECE", "adaptive_ece"), ("Brier", "brier"))
    pairs = ", ".join(f"{n} {b[k]:.4f} -> {a[k]:.4f}" for n, k in names)
    return (
        f"calibration: T={section['temperature']:.4f}{at} on {section['num_validation']} "
        f"validation examples\n  test {pairs}\n  conformal {c['method']} at "
        f"alpha={c['alpha']:g}: mean set size {c['mean_set_size']:.3f}, coverage "
        f"{c['coverage']:.4f}"
    )


def draw_calibration(path: str, section: Mapping[str, Any], curves: Any) -> None:
    """Draws ``calibration.png``: reliability before/after ``T``, the set sizes.

    Example:
      >>> val, test = (val_images, val_labels), (test_images, test_labels)
      >>> section, curves = calibrate_ensemble(ens, state, val, test, alpha=0.1)
      >>> draw_calibration("calibration.png", section, curves)
    """
    from meshensemble import plots

    b, a, c = section["before"], section["after"], section["conformal"]
    labelled = {
        f"ensemble (ECE {b['ece']:.4f})": curves["before"],
        f"T={section['temperature']:.3f} (ECE {a['ece']:.4f})": curves["after"],
    }
    title = f"{c['method']}, alpha={c['alpha']:g}"
    plots.calibration_summary(labelled, c["set_size_counts"], path, title)
