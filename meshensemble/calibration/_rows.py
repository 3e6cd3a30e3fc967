"""The row-wise arithmetic of :mod:`meshensemble.calibration`: its boundary checks, the
per-example randomisation of APS/RAPS and the exact k-th smallest score.

* :func:`check_rows`: one-line ``ValueError`` for empty, non-finite, negative or
  unnormalised probability rows (and a warning for logits that look like probabilities),
  reduced on device so that a sharded array is never gathered;
* :func:`row_uniform`: ``u`` in ``[0, 1)`` per row, a hash of the row's bytes and a seed,
  so an example gets the same ``u`` alone or in any batch;
* :func:`refuse_temperature_bound`: the one line that refuses a temperature at a
  search bound (why, and how large a held-out split to use);
* :func:`kth_smallest`: the exact k-th smallest value by bisection on bit patterns
  (float32, or float64 under ``jax_enable_x64``).

Example:
  >>> probs = check_rows(probs, 2, "probs", probabilities=True)
  >>> u = row_uniform(jnp.asarray(probs), np.array([7, 0], np.uint32))
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshensemble.numerics import statmath


def check_rows(x: Any, ndim: int | None, name: str, probabilities: bool) -> Any:
    """``x`` after its one-line checks at the boundary: `[N, C]`, `[members, N, C]`, or
    any `[..., C]` when ``ndim`` is None.

    Every input: the rank, at least one row and one class, a real dtype, no NaN/inf (the
    values of concrete arrays only: under ``jax.jit`` / ``vmap`` only the shape is checked).
    Probabilities (``probabilities=True``): no negative value and every row summing to 1
    within :func:`sum_tolerance`. Logits that look like probabilities (every row
    non-negative and summing to 1) get a warning: temperature scaling divides logits.

    Args:
      x: the array (numpy, jax, possibly sharded over its rows).
      ndim: the rank required (2 or 3), or None for any rank >= 1.
      name: the argument's name in the messages.
      probabilities: whether rows must be probabilities (else logits).

    Returns:
      ``x`` as an array (not copied to the host).

    Raises:
      ValueError: one line naming the problem and the fix.
    """
    if ndim is None:
        x = statmath.as_array(x)
        if x.ndim == 0:
            raise ValueError(f"`{name}` must be [..., classes], got a scalar; pass an array.")
    else:
        x = statmath.check_probs(x, ndim, name)
    if x.size == 0:
        raise ValueError(
            f"`{name}` of shape {tuple(x.shape)} holds no example or no class; pass at least "
            "one example (row) of at least one class."
        )
    if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
        raise ValueError(f"`{name}` must hold real numbers, got dtype {x.dtype}.")
    if isinstance(x, jax.core.Tracer):  # inside jit/vmap: the values are not known here
        return x
    finite, bad, lo, worst, worst_sum = (v.item() for v in jax.device_get(row_stats(x)))
    if not finite:
        raise ValueError(
            f"`{name}` contains NaN or inf (first in example {bad}); pass finite values (NaN "
            "comes from a diverged model or a failed run: check it first)."
        )
    tol = sum_tolerance(x.dtype, x.shape[-1])
    if probabilities and lo < 0:
        raise ValueError(
            f"`{name}` holds negative values (min {lo:.4g}); pass probabilities in [0, 1] "
            "(e.g. jax.nn.softmax(logits)), not logits."
        )
    if probabilities and abs(worst_sum - 1.0) > tol:
        raise ValueError(
            f"each row of `{name}` must sum to 1 (within {tol:.1e}), but example {worst} sums "
            f"to {worst_sum:.6g}; pass probabilities (e.g. jax.nn.softmax(logits)), not "
            "logits or unnormalised scores."
        )
    if not probabilities and x.shape[-1] > 1 and lo >= 0 and abs(worst_sum - 1.0) <= 1e-5:
        warnings.warn(
            f"every row of `{name}` is non-negative and sums to 1: these look like "
            "probabilities, not logits; pass logits (e.g. ensemble_logits(member_probs) or "
            "log(probs)), or use apply_temperature_to_probs",
            stacklevel=3,
        )
    return x


def sum_tolerance(dtype: Any, classes: int) -> float:
    """How far a row's sum may stray from 1: ``max(1e-3, 2 sqrt(C) eps(dtype))``."""
    eps = float(jnp.finfo(dtype).eps) if jnp.issubdtype(dtype, jnp.floating) else 0.0
    return max(1e-3, 2.0 * math.sqrt(classes) * eps)


@jax.jit
def row_stats(x: Any) -> tuple[jax.Array, ...]:
    """``(all finite, first example with NaN/inf, min, example whose sum is furthest from
    1, that sum)`` of ``x`` `[..., N, C]`, reduced on device (only scalars come back, and
    nothing is gathered or reshaped: ``x`` may be sharded over its rows)."""
    x = statmath.as_float(x)
    x = x[None] if x.ndim == 1 else x
    ok = jnp.isfinite(x)
    lead = tuple(range(x.ndim - 2))  # the member axis of [members, N, C], if any
    finite_rows = jnp.all(ok, axis=(-1, *lead))  # [N]
    sums = jnp.sum(jnp.where(ok, x, 0), axis=-1)  # [..., N]
    worst = jnp.argmax(jnp.max(jnp.abs(sums - 1), axis=lead))
    top, bottom = jnp.max(sums), jnp.min(sums)
    worst_sum = jnp.where(jnp.abs(top - 1) >= jnp.abs(bottom - 1), top, bottom)
    lo = jnp.min(jnp.where(ok, x, jnp.inf))
    return jnp.all(finite_rows), jnp.argmin(finite_rows), lo, worst, worst_sum


def fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: every input bit flips each output bit with ~1/2."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def row_uniform(p: jax.Array, words: jax.Array) -> jax.Array:
    """``u`` `[N]` in ``[0, 1)`` (float32, multiples of 2^-24): a hash of each row's bytes.

    Each 32-bit word ``b_j`` of a row (float64 rows have two per value) is mixed with its
    position and the seed's low word, the mixed words are summed modulo 2^32 (exact and
    order-free, so a sharded or batched row gives the same sum) and the sum is mixed with
    the seed's high word. Row by row: independent of the batch the row sits in.

    Args:
      p: `[N, C]` float rows (other float dtypes are hashed as float32).
      words: uint32 `[2]`: the seed's low and high 32 bits.

    Returns:
      float32 `[N]`.
    """
    if p.dtype not in (jnp.float32, jnp.float64):
        p = p.astype(jnp.float32)
    p = jnp.where(p == 0, jnp.zeros_like(p), p)  # -0.0 and 0.0 alike
    bits = jax.lax.bitcast_convert_type(p, jnp.uint32)  # [N, C], or [N, C, 2] for float64
    words_per_row = math.prod(bits.shape[1:])
    pos = jnp.arange(words_per_row, dtype=jnp.uint32).reshape(bits.shape[1:])
    mixed = fmix32(bits ^ fmix32(pos * jnp.uint32(0x9E3779B9) + words[0])[None])
    total = jnp.sum(mixed, axis=tuple(range(1, bits.ndim)), dtype=jnp.uint32)
    h = fmix32(total ^ fmix32(words[1] + jnp.uint32(1)))
    return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def kth_smallest(x: jax.Array, k: int) -> jax.Array:
    """The exact k-th smallest of ``x`` `[N]` by bisection on its bit patterns.

    float64 input (under ``jax_enable_x64``) is searched as float64 (64 rounds), anything
    else as float32 (32 rounds): the result is exactly one of the values. Only counts
    ``sum(x <= v)`` are taken, so ``x`` may stay sharded over devices (a sort along a
    sharded axis would need it gathered).

    Args:
      x: `[N]` floats; k: the rank, ``1 <= k <= N``.

    Returns:
      A scalar of ``x``'s float dtype (float32 unless float64).
    """
    wide = x.dtype == jnp.float64
    fdt, idt = (jnp.float64, jnp.int64) if wide else (jnp.float32, jnp.int32)
    low = 0x7FFFFFFFFFFFFFFF if wide else 0x7FFFFFFF
    bits = jax.lax.bitcast_convert_type(x.astype(fdt), idt)
    sign = 63 if wide else 31
    key = bits ^ ((bits >> sign) & low)  # integer keys in the order of the floats

    def body(_: Any, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2), no overflow
        enough = jnp.sum(key <= mid) >= k
        return jnp.where(enough, lo, mid + 1), jnp.where(enough, mid, hi)

    lo, _ = jax.lax.fori_loop(0, sign + 2, body, (jnp.min(key), jnp.max(key)))
    return jax.lax.bitcast_convert_type(lo ^ ((lo >> sign) & low), fdt)


def refuse_temperature_bound(
    at_lo: np.ndarray, at_hi: np.ndarray, lo: float, hi: float, n: int, at_bound: str
) -> None:
    """Raises (or warns) when a member's NLL still decreases at a temperature bound.

    Args:
      at_lo: bool ``[members]``, at the lower bound ``lo``; at_hi: at the upper bound ``hi``.
      lo: the lower bound; hi: the upper bound; n: the held-out examples.
      at_bound: ``"raise"`` (a ``ValueError`` line: why, and how many to hold out) or
        ``"warn"`` (a ``UserWarning``; the caller returns the bound).
    """
    for edge, name, value in ((at_lo, "lower", lo), (at_hi, "upper", hi)):
        if not edge.any():
            continue
        why = (
            f"the {n} held-out examples are (nearly) all classified right, so a sharper "
            "softmax always lowers their NLL; hold out more examples (at least 5 / error "
            "rate, e.g. 500 for a 99% model) so that some are wrong"
            if name == "lower"
            else "the logits rank the labels no better than chance; check the labels and "
            "that these are the model's logits"
        )
        where = (
            f" (members {np.flatnonzero(edge).tolist()} of {edge.size})" if edge.size > 1 else ""
        )
        msg = (
            f"the NLL still decreases at the {name} temperature bound {value:g}{where}: no "
            f"temperature fits, because {why}"
        )
        if at_bound == "raise":
            raise ValueError(msg + "; the bound is not a calibration, so none is returned.")
        warnings.warn(msg + "; that bound is returned (at_bound='warn')", stacklevel=3)
