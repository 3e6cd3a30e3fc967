"""Default config of the 2-D mesh example: a ``me.TrainConfig``."""

from __future__ import annotations

import meshensemble as me


def get_config() -> me.TrainConfig:
    """8 CNN members on the mesh ``ensemble=4, data=2`` (2 members per device).

    Every other field keeps ``TrainConfig``'s default (the Flax MNIST example's SGD 0.1
    with momentum 0.9, batch 128, MNIST from ``--source auto``). Checkpoints are off:
    this example is about the mesh, not about resuming.
    """
    return me.TrainConfig(
        members=8,
        mesh="ensemble=4,data=2",
        epochs=3,
        batch_size=128,
        workdir="runs/mesh_2d",
        checkpoint=False,
    )
