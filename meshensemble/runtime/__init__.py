"""How programs are compiled, chosen and run across processes (below the core).

* :mod:`meshensemble.runtime.compilation`: JAX's persistent compilation cache, and a
  log of what a run compiles.
* :mod:`meshensemble.runtime.precompile`: programs compiled ahead of time in a thread,
  used when the shapes match.
* :mod:`meshensemble.runtime.autotune`: defaults chosen by timing candidates on the
  device, within a budget, the choice cached.
* :mod:`meshensemble.runtime.distributed`: the multi-process runtime, global fetch, a
  local launcher.

Example:
  >>> from meshensemble.runtime import compilation
  >>> compilation.enable_compilation_cache("/tmp/jax-cache")  # doctest: +SKIP
  '/tmp/jax-cache'

(Skipped in the tests: it points the whole process's compilation cache elsewhere.)
"""

from meshensemble.runtime import autotune as autotune
from meshensemble.runtime import compilation as compilation
from meshensemble.runtime import distributed as distributed
from meshensemble.runtime import precompile as precompile

__all__ = ["autotune", "compilation", "distributed", "precompile"]
