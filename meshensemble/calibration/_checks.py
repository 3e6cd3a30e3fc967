"""The argument checks shared by the calibration modules (one-line ValueErrors), and
:data:`METHODS`, the conformal scores.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshensemble.numerics import statmath

METHODS = ("thr", "aps", "raps")
"""Conformal scores that :func:`conformal_quantile` and :func:`prediction_sets` accept."""

GRID = 15  # interior points per round of the temperature search (one device call each)


# --------------------------------------------------------------------------- checks


def check_labels(labels: Any, n: int, classes: int) -> Any:
    """``labels`` as an integer `[n]` array with values in ``[0, classes)`` (one-line errors)."""
    labels = statmath.check_labels(labels, n)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(
            f"`labels` must be integer class indices, got dtype {labels.dtype}; "
            "use labels.astype(int)."
        )
    lo, hi = (int(v) for v in jax.device_get(min_max(labels)))
    if lo < 0 or hi >= classes:
        raise ValueError(
            f"`labels` must lie in [0, {classes}) for {classes} classes, got range "
            f"[{lo}, {hi}]; fix the labels or the class count."
        )
    return labels


@jax.jit
def min_max(labels: Any) -> tuple[jax.Array, jax.Array]:
    return jnp.min(labels), jnp.max(labels)


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown conformal method {method!r}; use one of {METHODS}.")
    return method


def check_score_kwargs(score_kwargs: dict[str, Any]) -> None:
    unknown = set(score_kwargs) - {"k_reg", "lam", "randomized", "seed"}
    if unknown:
        raise ValueError(
            f"unknown score arguments {sorted(unknown)}; use k_reg, lam, randomized or seed."
        )


def check_sets(sets: Any) -> Any:
    sets = statmath.check_probs(sets, 2, "sets")
    if sets.shape[0] == 0:
        raise ValueError("`sets` holds no example; pass the sets of at least one example.")
    return sets


def check_alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, int | float | np.floating):
        raise ValueError(f"`alpha` must be a float in (0, 1), got {alpha!r}.")
    if not 0.0 < float(alpha) < 1.0:
        raise ValueError(f"`alpha` must lie in (0, 1) (the miscoverage rate), got {alpha!r}.")
    return float(alpha)


def temperature_array(temperature: Any, logits: Any) -> jax.Array:
    """``temperature`` broadcast against ``logits``: a scalar, or `[M]` for `[M, N, C]`."""
    try:
        t = jnp.asarray(temperature, dtype=jnp.result_type(float))
    except (TypeError, ValueError):
        raise ValueError(
            f"`temperature` must be a number > 0 (or [members] of them), got {temperature!r}."
        ) from None
    if t.ndim == 1 and logits.ndim == 3 and t.shape[0] == logits.shape[0]:
        t = t[:, None, None]
    elif t.ndim != 0:
        raise ValueError(
            f"`temperature` must be a scalar, or [members] = [{logits.shape[0]}] for member "
            f"logits [members, N, C]; got shape {tuple(t.shape)} for logits "
            f"{tuple(logits.shape)}."
        )
    if isinstance(temperature, jax.core.Tracer):  # inside jit: only the shape is known
        return t
    host = np.asarray(jax.device_get(temperature), np.float64)
    if not np.all((host > 0) & np.isfinite(host)):
        raise ValueError(
            f"`temperature` must be finite and > 0, got {host.ravel().tolist()}; "
            "pass the T that fit_temperature returned."
        )
    return t


# --------------------------------------------------------------------------- conformal ranks


def conformal_rank(n: int, alpha: float) -> int:
    """``ceil((n + 1)(1 - alpha))``, the split-conformal rank, free of float round-up.

    The small slack keeps ``(n + 1)(1 - alpha)`` = 3.0000000000000004 (``n = 9``,
    ``alpha = 0.7``, exactly 3) from rounding up to 4, a wider interval than documented.
    """
    return math.ceil((n + 1) * (1.0 - alpha) - 1e-9)


def smallest_alpha(n: int) -> str:
    """``1 / (n + 1)``, the smallest alpha ``n`` calibration scores accept, rounded *up* to
    3 significant digits (text for an error's hint: the value shown is accepted)."""
    x = 1.0 / (n + 1)
    unit = 10.0 ** (math.floor(math.log10(x)) - 2)
    return f"{math.ceil(x / unit - 1e-9) * unit:.3g}"
