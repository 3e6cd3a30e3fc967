"""The core: the ensemble on the mesh, and nothing else.

It imports only the rooms below it (:mod:`meshensemble.errors`,
:mod:`meshensemble.numerics`, :mod:`meshensemble.runtime`); models, metrics, data,
training, calibration, evaluation and the CLI build on it.

* :mod:`meshensemble.core.mesh`: axis names, ``make_mesh``, shardings, fake CPU devices.
* :mod:`meshensemble.core.sharding`: per-leaf specs (members, FSDP over ``data``, the
  ``model`` axis), state bytes per device.
* :mod:`meshensemble.core.adapters`: the ``Model`` interface and its adapters.
* :mod:`meshensemble.core.state`: ``EnsembleState``, and ``SharedState`` for member layouts.
* :mod:`meshensemble.core.layout`: member layouts: which parameter leaves each member owns,
  which all members share (one copy per device) and which are frozen.
* :mod:`meshensemble.core.steps`: per-device functions, the only home of collectives.
* :mod:`meshensemble.core.backends`: ``shard_map`` and legacy ``pmap`` behind one interface.
* :mod:`meshensemble.core.ensemble`: ``Ensemble``.
* :mod:`meshensemble.core.streaming`: a dataset through the mesh in padded, masked
  batches, a bounded number in flight.
* :mod:`meshensemble.core.tasks`: the task seam: the open ``Task`` protocol the engine
  asks, the ``Reducer`` it gets, the registry of task names (the implementations are in
  :mod:`meshensemble.tasks`).
* :mod:`meshensemble.core.keys`: PRNG implementations of a state, per-example keys of
  an augmentation.

Example:
  >>> from meshensemble.core import mesh
  >>> dict(mesh.make_mesh(ensemble=2, data=1).shape)
  {'ensemble': 2, 'data': 1}
"""

from meshensemble.core import ensemble as ensemble
from meshensemble.core import mesh as mesh
from meshensemble.core import steps as steps
from meshensemble.core import tasks as tasks

__all__ = ["ensemble", "mesh", "steps", "tasks"]
