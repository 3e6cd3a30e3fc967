"""Compilation: JAX's persistent compilation cache, and a log of what a run compiles.

A training run compiles a handful of XLA programs (the member initialisation, the
training chunk, the evaluation, a few small ones). Compiling them dominates a short run on
an accelerator, and the same programs come back in every run of the same configuration,
so :func:`enable_compilation_cache` turns on JAX's persistent cache (every program,
small ones included) and :class:`CompileLog` records, per program, how long its
compilation took and whether it came from the cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
from jax import monitoring

from meshensemble.runtime import storage

ENV_CACHE_DIR = "JAX_COMPILATION_CACHE_DIR"
"""Environment variable naming the cache folder; JAX's own name, honoured when set."""

LINE_WIDTH = 120
"""The widest line a run prints; the compile line names as many slow programs as fit."""
_COMPILE = "/jax/core/compile/backend_compile_duration"
_HIT = "/jax/compilation_cache/cache_hits"
_MISS = "/jax/compilation_cache/cache_misses"


def default_cache_dir() -> str:
    """The per-user cache folder: ``$JAX_COMPILATION_CACHE_DIR`` or ``~/.cache/meshensemble/jax``.

    ``$XDG_CACHE_HOME`` replaces ``~/.cache`` when set.

    Returns:
      An absolute path (not created here).

    Example:
      >>> me.runtime.compilation.default_cache_dir()   # ~/.cache/..., or $MESHENSEMBLE_...
      '.../jax'
    """
    if os.environ.get(ENV_CACHE_DIR):
        return storage.absolute(os.path.expanduser(os.environ[ENV_CACHE_DIR]))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return storage.absolute(os.path.join(base, "meshensemble", "jax"))


def enable_compilation_cache(path: str | None = None) -> str | None:
    """Turns on JAX's persistent compilation cache for every program this process compiles.

    Sets ``jax_compilation_cache_dir`` and lowers JAX's thresholds
    (``jax_persistent_cache_min_compile_time_secs`` and
    ``..._min_entry_size_bytes`` to 0) so that small programs are cached too. A second
    run of the same configuration then loads its programs instead of compiling them.

    Args:
      path: the cache folder; default :func:`default_cache_dir`.

    Returns:
      The folder in use, or None when it cannot be created or written (the run then
      compiles as usual; the cache is an optimisation, never a reason to fail).

    Example:
      >>> me.runtime.compilation.enable_compilation_cache()   # doctest: +SKIP
      '/home/me/.cache/meshensemble/jax'

    (Skipped in the tests: it would point the test process's cache elsewhere. Call it
    before the first compilation.)
    """
    path = storage.absolute(os.path.expanduser(path)) if path else default_cache_dir()
    try:  # a gs:// folder is JAX's to use (through etils.epath: its docs' "Google Cloud")
        storage.makedirs(path)
        if storage.is_local(path) and not os.access(path, os.W_OK):
            return None
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


@dataclasses.dataclass
class CompiledProgram:
    """One compilation seen by a :class:`CompileLog`.

    Attributes:
      name: JAX's name of the program, e.g. ``"jit(train_chunk)"``.
      seconds: time in XLA's compiler, or loading the program from the cache.
      cache: ``"hit"`` (loaded from the persistent cache), ``"miss"`` (compiled, then
        stored) or ``"off"`` (no persistent cache).
      purpose: ``"run"``, or ``"tuning"`` for a candidate the auto-tuner compiled to time
        it (see :meth:`CompileLog.tuning`).
    """

    name: str
    seconds: float
    cache: str
    purpose: str = "run"


class CompileLog:
    """Records every XLA compilation in this process while it is open (a context manager).

    Listens to JAX's monitoring events (backend compile time, cache hits and misses), so it
    sees programs compiled anywhere: the library's, a user's ``jax.jit``, JAX's own small
    ones. Several logs may be open at once.

    Attributes:
      programs: the :class:`CompiledProgram` records, in order.

    Example:
      >>> with me.runtime.compilation.CompileLog() as log:
      ...     state = ens.init(key, images[:1])
      >>> sorted(log.summary())[:4]
      ['by_program', 'cache_hits', 'cache_misses', 'programs']
    """

    _lock = threading.Lock()
    _open: list[CompileLog] = []
    _pending: dict[int, str] = {}  # thread id -> "hit" / "miss" of the compilation under way
    _purpose = "run"

    def __init__(self) -> None:
        self.programs: list[CompiledProgram] = []
        self._started = 0.0
        self.wall_seconds = 0.0

    def __enter__(self) -> CompileLog:
        with CompileLog._lock:
            if not CompileLog._open:
                monitoring.register_event_listener(CompileLog._on_event)
                monitoring.register_event_duration_secs_listener(CompileLog._on_duration)
            CompileLog._open.append(self)
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall_seconds = time.perf_counter() - self._started
        with CompileLog._lock:
            CompileLog._open.remove(self)
            if not CompileLog._open:
                monitoring.unregister_event_listener(CompileLog._on_event)
                monitoring.unregister_event_duration_listener(CompileLog._on_duration)

    @staticmethod
    def _on_event(event: str, **kwargs: Any) -> None:
        if event in (_HIT, _MISS):
            CompileLog._pending[threading.get_ident()] = "hit" if event == _HIT else "miss"

    @staticmethod
    def _on_duration(event: str, duration: float, **kwargs: Any) -> None:
        if event != _COMPILE:
            return
        cache = CompileLog._pending.pop(threading.get_ident(), "off")
        name = str(kwargs.get("fun_name", "?"))
        record = CompiledProgram(name, float(duration), cache, CompileLog._purpose)
        with CompileLog._lock:
            for log in CompileLog._open:
                log.programs.append(record)

    @staticmethod
    @contextlib.contextmanager
    def tuning() -> Iterator[None]:
        """Marks what compiles inside the block as the auto-tuner's (``purpose="tuning"``).

        The tuner compiles each candidate it times (once per device, model and shapes
        when its choice can be stored), so a run reports those programs apart from its
        own.

        Example:
          >>> x = jnp.ones(5)
          >>> with CompileLog() as log, CompileLog.tuning():   # e.g. around autotune.choose
          ...     _ = jax.jit(lambda x: x * 3)(x)
          >>> [p.purpose for p in log.programs]
          ['tuning']
        """
        previous, CompileLog._purpose = CompileLog._purpose, "tuning"
        try:
            yield
        finally:
            CompileLog._purpose = previous

    def summary(self) -> dict[str, Any]:
        """The log as JSON-ready numbers: the run's own programs, the tuner's apart.

        Returns:
          ``{"programs": count, "seconds": total compile seconds, "cache_hits": n,
          "cache_misses": n, "by_program": [{"name", "seconds", "cache"}, ...],
          "tuning": {"programs": n, "seconds": s}}``: the first five count the run's own
          programs (``by_program`` sorted by time, longest first); ``tuning`` the
          candidates the auto-tuner compiled (0 when it read its choice or measured nothing).

        Example:
          >>> x = jnp.ones(6)
          >>> with CompileLog() as log:
          ...     _ = jax.jit(lambda x: x * 5)(x)
          >>> log.summary()["by_program"][0]      # e.g. jit(train_chunk) in a run
          {'name': 'jit(<lambda>)', 'seconds': ..., 'cache': ...}
        """
        own = [p for p in self.programs if p.purpose == "run"]
        tuned = [p for p in self.programs if p.purpose == "tuning"]
        ordered = sorted(own, key=lambda p: -p.seconds)
        total = lambda ps: {"programs": len(ps), "seconds": round(sum(p.seconds for p in ps), 4)}
        return {
            **total(own),
            "cache_hits": sum(p.cache == "hit" for p in own),
            "cache_misses": sum(p.cache == "miss" for p in own),
            "by_program": [
                {"name": p.name, "seconds": round(p.seconds, 4), "cache": p.cache} for p in ordered
            ],
            "tuning": total(tuned),
        }

    def line(self) -> str:
        """One line for a run's output, e.g. ``compiled 5 programs in 7.2s (cache: 0 hits)``.

        Returns:
          The line.

        Example:
          >>> x = jnp.ones(7)
          >>> with CompileLog() as log:
          ...     _ = jax.jit(lambda x: x * 7)(x)
          >>> print(log.line())
          compiled 1 programs in ...s (persistent cache: ... hits, ... misses); jit(<lambda>) ...s
        """
        s = self.summary()
        tuned = s["tuning"]
        extra = (  # whether its choice is kept, the tuner's own line says
            f"; the auto-tuner compiled {tuned['programs']} more in {tuned['seconds']:.1f}s"
            if tuned["programs"]
            else ""
        )
        line = (
            f"compiled {s['programs']} programs in {s['seconds']:.1f}s (persistent cache: "
            f"{s['cache_hits']} hits, {s['cache_misses']} misses){extra}"
        )
        for i, p in enumerate(s["by_program"][:3]):  # the slowest, as many as fit 120
            more = f"{'; ' if not i else ', '}{p['name']} {p['seconds']:.1f}s"
            if len(line + more) > LINE_WIDTH:
                break
            line += more
        return line
