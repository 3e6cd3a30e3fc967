"""Pure array math that the core and the metrics share (imports no other room).

* :mod:`meshensemble.numerics.statmath`: per-example arithmetic (clipped logs, entropy,
  one-hot, bins, weights) and the checks of probability arrays.
* :mod:`meshensemble.numerics.sums`: the sums an evaluation streams over batches, and
  their finalisation on the host.
* :mod:`meshensemble.numerics.gaussian`: a Gaussian mixture's densities, CDF, CRPS
  kernel and moments.

Example:
  >>> from meshensemble.numerics import statmath
  >>> statmath.shannon_entropy(np.full((1, 4), 0.25))  # log 4 nats
  Array([1.3862944], dtype=float32)
"""

from meshensemble.numerics import gaussian as gaussian
from meshensemble.numerics import statmath as statmath
from meshensemble.numerics import sums as sums
from meshensemble.numerics import temperature as temperature

__all__ = ["gaussian", "statmath", "sums", "temperature"]
