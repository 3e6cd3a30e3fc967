"""Programs compiled ahead of time in a thread, used when the call matches what was compiled.

A run knows the shapes of its programs before their first call (the state's from
``jax.eval_shape`` of the initialisation, the batches' from the data), so it can compile
them while something else runs: XLA releases the GIL while it compiles, so the
initialisation, the training chunk and the evaluation compile at the same time.
:class:`AheadOfTime` wraps a global callable (from
:meth:`~meshensemble.core.ensemble.Ensemble.build` or a backend) and calls the program
compiled ahead when the arguments have the shapes and dtypes it was compiled for; any
other call (or a compilation that failed) goes to the wrapped callable, which compiles
at its first call as usual. The results are the same either way: it is the same program.

Example:
  >>> fn = AheadOfTime(jax.jit(lambda x, y: x @ y))     # e.g. ens.build(...)'s programs
  >>> x, y = jnp.ones((2, 3)), jnp.ones((3, 4))
  >>> fn.compile_ahead(x, y)                           # returns at once
  True
  >>> fn(x, y).shape                                   # waits for the compile, calls it
  (2, 4)
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import jax


def start_compiling(compile_fn: Callable[[], Any]) -> concurrent.futures.Future:
    """Runs ``compile_fn`` in its own daemon-free worker thread and returns its future.

    Args:
      compile_fn: ``() -> compiled``, e.g. ``lambda: fn.lower(*shapes).compile()``.

    Returns:
      A future of the compiled program (its exception when compiling failed).

    Example:
      >>> fn, args = jax.jit(lambda x: 2 * x), (jnp.ones(3),)
      >>> future = start_compiling(lambda: fn.lower(*args).compile())
      >>> future.result()(*args)
      Array([2., 2., 2.], dtype=float32)
    """
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meshensemble-aot")
    future = pool.submit(compile_fn)
    pool.shutdown(wait=False)
    return future


def signature(args: Any) -> tuple[Any, ...]:
    """The shapes and dtypes of ``args``' leaves (what decides which program a call runs).

    Args:
      args: a tree of arrays, numpy arrays, scalars or ``jax.ShapeDtypeStruct``.

    Returns:
      A hashable tuple: the tree structure, then ``(shape, dtype)`` per leaf.

    Example:
      >>> signature((np.zeros((2, 3), np.float32),))[1:]
      (((2, 3), dtype('float32')),)
    """
    leaves, tree = jax.tree.flatten(args)
    shapes = tuple((tuple(getattr(a, "shape", ())), jax.numpy.dtype(_dtype(a))) for a in leaves)
    return (tree, *shapes)


def _dtype(a: Any) -> Any:
    dtype = getattr(a, "dtype", None)
    return dtype if dtype is not None else jax.numpy.result_type(a)


class AheadOfTime:
    """A global callable whose program for one signature may be compiled ahead of time.

    Args:
      fn: the global callable; it needs a ``lower(*args)`` method for compiling ahead
        (the ``shard_map`` backend's programs have one, ``pmap``'s do not).

    Example:
      >>> fn = AheadOfTime(jax.jit(lambda x: x.sum()))
      >>> shapes = (jax.ShapeDtypeStruct((4,), jnp.float32),)   # or the arrays themselves
      >>> fn.compile_ahead(*shapes)
      True
      >>> out = fn(jnp.arange(4.0))     # the same signature: the program compiled ahead
      >>> out
      Array(6., dtype=float32)
    """

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self._future: concurrent.futures.Future | None = None
        self._signature: tuple[Any, ...] | None = None

    def lower(self, *args: Any) -> Any:
        """``fn.lower(*args)``: lowers the wrapped program (AttributeError without one)."""
        return self.fn.lower(*args)

    def compile_ahead(self, *args: Any) -> bool:
        """Starts compiling the program for ``args``' shapes in a thread.

        Args:
          *args: the arguments of the calls to come, as arrays or
            ``jax.ShapeDtypeStruct`` (with the shardings the calls will have).

        Returns:
          Whether compiling was started (not with ``pmap``'s programs or several
          processes: those compile at their first call).
        """
        if not hasattr(self.fn, "lower") or jax.process_count() > 1:
            return False
        self._signature = signature(args)
        self._future = start_compiling(lambda: self.fn.lower(*args).compile())
        return True

    def __call__(self, *args: Any) -> Any:
        """Calls the program compiled ahead when ``args`` match it, else ``fn``."""
        if self._future is not None and signature(args) == self._signature:
            try:
                compiled = self._future.result()
            except Exception:  # e.g. a layout it cannot take: compile at the call instead
                self._future = None
            else:
                return compiled(*args)
        return self.fn(*args)
