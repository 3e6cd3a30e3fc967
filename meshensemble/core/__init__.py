"""The core: the mesh, the stacked ensemble state, per-device steps, backends and ``Ensemble``.

Nothing here imports another room of the package (models, metrics, data, training,
evaluation, cli): those build on the core.

* :mod:`meshensemble.core.mesh`: axis names, ``make_mesh``, shardings, fake CPU devices.
* :mod:`meshensemble.core.adapters`: the ``Model`` interface and its adapters.
* :mod:`meshensemble.core.state`: ``EnsembleState``.
* :mod:`meshensemble.core.steps`: per-device functions, the only home of collectives.
* :mod:`meshensemble.core.backends`: ``shard_map`` and legacy ``pmap`` behind one interface.
* :mod:`meshensemble.core.ensemble`: ``Ensemble``.
* :mod:`meshensemble.core.distributed`: the multi-process runtime and global fetch.
"""
