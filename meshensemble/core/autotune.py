"""Defaults chosen by measurement: time candidate programs on the actual device, keep the winner.

How the members a device holds are computed (``vmap`` or an unrolled ``loop``) and how a
CNN computes its convolutions (XLA's, or im2col matmuls) are each fastest on some devices
and models and slow on others. :func:`choose` times a few steps of every candidate on
the device and model at hand (compilation and a warm-up call excluded, candidates
interleaved round by round so that load from other jobs falls on all alike, the median
kept) and remembers the winner in a small JSON file next to the compilation cache, keyed
by everything that decides it (device kind, JAX version, model, shapes): the next run of
the same configuration reads the choice instead of measuring again.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

CHOICES_FILE = "meshensemble-choices.json"
"""File (beside the compilation cache's folder) holding the measured choices."""


def tuning_key(**parts: Any) -> str:
    """A stable key for a measured choice: a hash of ``parts`` plus the device and versions.

    Args:
      **parts: what decides the choice, e.g. ``what="member_strategy"``, ``model=repr(m)``,
        ``shapes=...``, ``members_per_device=2``; values are turned into text.

    Returns:
      A short hex key.

    Example:
      >>> tuning_key(what="member_strategy", model="CNN()", batch=128)
      '3f2a9c...'
    """
    device = jax.devices()[0]
    everything = {
        **{k: str(v) for k, v in parts.items()},
        "platform": device.platform,
        "device_kind": getattr(device, "device_kind", ""),
        "jax": jax.__version__,
    }
    text = json.dumps(everything, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def choices_path(cache_dir: str) -> str:
    """Where the choices live for a compilation cache folder: ``<cache_dir>/../CHOICES_FILE``.

    Args:
      cache_dir: the compilation cache's folder.

    Returns:
      The JSON file's path.

    Example:
      >>> choices_path("/home/me/.cache/meshensemble/jax")
      '/home/me/.cache/meshensemble/meshensemble-choices.json'
    """
    return os.path.join(os.path.dirname(os.path.abspath(cache_dir)), CHOICES_FILE)


def read_choices(path: str | None) -> dict[str, Any]:
    """The recorded choices (``{}`` when the file is absent or unreadable).

    Args:
      path: the JSON file, or None.

    Returns:
      ``{key: {"choice": name, "seconds": {name: s}}}``.

    Example:
      >>> read_choices(choices_path(cache_dir)).get(key, {}).get("choice")
    """
    if not path:
        return {}
    try:
        with open(path) as f:
            loaded = json.load(f)
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _write_choice(path: str, key: str, record: dict[str, Any]) -> None:
    """Adds one choice to the file atomically; a failure only means measuring again later."""
    try:
        choices = read_choices(path)
        choices[key] = record
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(choices, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


def time_candidates(
    candidates: Mapping[str, Callable[[], Any]],
    rounds: int = 3,
    timer: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median seconds of one call of each candidate, interleaved round by round.

    Each candidate is called once first (compilation and warm-up, not timed); then each
    round calls every candidate once, in turn, waiting for its result
    (``jax.block_until_ready``).

    Args:
      candidates: ``{name: fn}``; ``fn()`` runs one step and returns its outputs.
      rounds: timed calls per candidate.
      timer: the clock (injectable for tests).

    Returns:
      ``{name: median seconds}``.

    Raises:
      ValueError: no candidates, or ``rounds < 1``.

    Example:
      >>> time_candidates({"vmap": lambda: step_v(), "loop": lambda: step_l()})
      {'vmap': 0.012, 'loop': 0.009}
    """
    if not candidates or rounds < 1:
        raise ValueError(f"need candidates and rounds >= 1, got {list(candidates)}, {rounds}")
    for fn in candidates.values():
        jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = timer()
            jax.block_until_ready(fn())
            times[name].append(timer() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def choose(
    key: str,
    candidates: Mapping[str, Callable[[], Callable[[], Any]]],
    path: str | None,
    rounds: int = 3,
    timer: Callable[[], float] = time.perf_counter,
) -> tuple[str, str]:
    """The fastest candidate: read from ``path`` when measured before, else measured now.

    Args:
      key: from :func:`tuning_key`.
      candidates: ``{name: make}``; ``make()`` builds the candidate and returns its
        one-step callable (only called when a measurement is needed, so a cached choice
        builds nothing).
      path: the choices file (:func:`choices_path`), or None to measure without keeping.
      rounds: timed calls per candidate.
      timer: the clock (injectable for tests).

    Returns:
      ``(name, reason)``: the chosen candidate and a line that says why, e.g.
      ``"loop: 9.1 ms/step against vmap 12.0 ms (measured)"``.

    Raises:
      ValueError: no candidates.

    Example:
      >>> name, why = choose(key, {"vmap": make_vmap, "loop": make_loop}, path)
    """
    if not candidates:
        raise ValueError("choose needs at least one candidate")
    recorded = read_choices(path).get(key)
    if isinstance(recorded, dict) and recorded.get("choice") in candidates:
        name = recorded["choice"]
        return name, _reason(name, recorded.get("seconds", {}), "measured earlier, cached")
    if len(candidates) == 1:
        name = next(iter(candidates))
        return name, f"{name}: the only candidate"
    seconds = time_candidates({n: make() for n, make in candidates.items()}, rounds, timer)
    name = min(seconds, key=seconds.get)
    if path:
        _write_choice(path, key, {"choice": name, "seconds": seconds})
    return name, _reason(name, seconds, "measured now")


def _reason(name: str, seconds: Mapping[str, float], how: str) -> str:
    others = ", ".join(f"{n} {1e3 * s:.1f} ms" for n, s in seconds.items() if n != name)
    mine = seconds.get(name)
    head = f"{name}: {1e3 * mine:.1f} ms/step" if mine is not None else name
    return f"{head}{' against ' + others if others else ''} ({how})"


def precision_ratio(
    fp32: Callable[[], Any],
    bf16: Callable[[], Any],
    rounds: int = 3,
    timer: Callable[[], float] = time.perf_counter,
) -> float:
    """How long a bf16 step takes against the fp32 one, timed interleaved.

    Args:
      fp32: one fp32 step (the chosen candidate).
      bf16: the same candidate in bf16 (mixed precision).
      rounds: timed calls of each.
      timer: the clock (injectable for tests).

    Returns:
      ``bf16 seconds / fp32 seconds`` (medians); below 1 means bf16 is faster.

    Example:
      >>> precision_ratio(step_fp32, step_bf16)
      0.62
    """
    seconds = time_candidates({"fp32": fp32, "bf16": bf16}, rounds, timer)
    return seconds["bf16"] / seconds["fp32"]


def bf16_line(ratio: float) -> str:
    """The line a run prints about bf16 when it measured fp32 candidates.

    Args:
      ratio: from :func:`precision_ratio`.

    Returns:
      e.g. ``"bf16 would run 0.62x the fp32 step time; precision stays fp32: pass
      --precision bf16 to use it"``.

    Example:
      >>> bf16_line(0.62)[:30]
      'bf16 would run 0.62x the fp32 '
    """
    return (
        f"bf16 would run {ratio:.2f}x the fp32 step time; precision stays fp32: "
        "pass --precision bf16 to use it"
    )


def recorded(path: str | None, key: str) -> dict[str, Any]:
    """The record of ``key`` in the choices file (``{}`` when absent).

    Args:
      path: the choices file, or None.
      key: from :func:`tuning_key`.

    Returns:
      ``{"choice": name, "seconds": {...}, ...}`` with any extra fields :func:`remember`
      added (e.g. ``"bf16_ratio"``).

    Example:
      >>> recorded(path, key).get("bf16_ratio")
    """
    record = read_choices(path).get(key)
    return record if isinstance(record, dict) else {}


def remember(path: str | None, key: str, **extra: Any) -> None:
    """Adds fields to the recorded choice of ``key`` (nothing when it is not recorded).

    Args:
      path: the choices file, or None.
      key: from :func:`tuning_key`.
      **extra: JSON-serialisable fields, e.g. ``bf16_ratio=0.62``.

    Example:
      >>> remember(path, key, bf16_ratio=0.62)
    """
    record = recorded(path, key)
    if path and record:
        _write_choice(path, key, {**record, **extra})
