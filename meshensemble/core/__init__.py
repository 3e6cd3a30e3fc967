"""The core: the mesh, the stacked ensemble state, per-device steps, backends and ``Ensemble``.

Nothing here imports another room of the package (models, metrics, data, training,
evaluation, cli): those build on the core.

* :mod:`meshensemble.core.mesh`: axis names, ``make_mesh``, shardings, fake CPU devices.
* :mod:`meshensemble.core.adapters`: the ``Model`` interface and its adapters.
* :mod:`meshensemble.core.state`: ``EnsembleState``.
* :mod:`meshensemble.core.steps`: per-device functions, the only home of collectives.
* :mod:`meshensemble.core.stats`: the sums an evaluation streams over batches, and their
  finalisation on the host; :mod:`meshensemble.core.statmath`, the arithmetic they share.
* :mod:`meshensemble.core.inputs`: checks of what users hand the ``Ensemble``.
* :mod:`meshensemble.core.compilation`: the persistent compilation cache and a compile log.
* :mod:`meshensemble.core.autotune`: defaults chosen by timing candidates on the device.
* :mod:`meshensemble.core.backends`: ``shard_map`` and legacy ``pmap`` behind one interface.
* :mod:`meshensemble.core.ensemble`: ``Ensemble``.
* :mod:`meshensemble.core.distributed`: the multi-process runtime and global fetch.
* :mod:`meshensemble.core.tasks`: the task seam (classification, Gaussian regression);
  :mod:`meshensemble.core.gaussian` the mixture's arithmetic and
  :mod:`meshensemble.core.regression` a regression ensemble's predict and evaluate.
"""

from meshensemble.core import autotune as autotune
from meshensemble.core import compilation as compilation
from meshensemble.core import ensemble as ensemble
from meshensemble.core import mesh as mesh
from meshensemble.core import stats as stats
from meshensemble.core import steps as steps
from meshensemble.core import tasks as tasks

__all__ = ["autotune", "compilation", "ensemble", "mesh", "stats", "steps", "tasks"]
