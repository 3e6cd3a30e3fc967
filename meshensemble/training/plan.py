"""A run's plan: the mesh, batch, steps, chunk and evaluations, from the config and data size.

Pure (no device is touched): :func:`plan_training` is what
:func:`meshensemble.training.train` runs on, decided before anything is built or
written, so a bad combination fails with one line and a test can check a plan without
devices.
"""

from __future__ import annotations

import dataclasses

from meshensemble.core.mesh import parse_mesh
from meshensemble.training.config import (
    EVALUATIONS,
    TrainConfig,
    default_chunk_steps,
    default_mesh_shape,
)

DEFAULT_BATCH = 128
"""The batch of a run whose ``batch_size`` is None, when its training split is larger."""


@dataclasses.dataclass(frozen=True)
class TrainPlan:
    """What a run does, from its config and data size alone.

    Attributes:
      mesh: the mesh's axis sizes, for ``make_mesh(**mesh)`` (a missing ``data`` is 1).
      steps_per_epoch: full batches in the training set.
      total_steps: the steps the run ends at (``epochs`` epochs, at most ``max_steps``).
      chunk: ``K``, steps per compiled call (a divisor of ``steps_per_epoch``).
      batch: the global batch (``batch_size``, or for None the whole training split up to
        :data:`DEFAULT_BATCH` examples).
      eval_every: evaluate (and checkpoint) every this many epochs, and at the end
        (``eval_every``, or for None about :data:`EVALUATIONS` times a run).

    Example:
      >>> plan_training(me.TrainConfig(batch_size=100, epochs=2), 1000, 8, "cpu").total_steps
      20
    """

    mesh: dict[str, int]
    steps_per_epoch: int
    total_steps: int
    chunk: int
    batch: int = DEFAULT_BATCH
    eval_every: int = 1


def plan_training(cfg: TrainConfig, num_train: int, devices: int, platform: str) -> TrainPlan:
    """The :class:`TrainPlan` of ``cfg`` on ``num_train`` examples and ``devices`` devices.

    Args:
      cfg: the run's config (``batch_size``, ``mesh``, ``members``, ``epochs``,
        ``max_steps``, ``chunk_steps``, ``eval_every``).
      num_train: training examples (after the validation split).
      devices: the devices the mesh may use (for the default mesh).
      platform: ``"cpu"``, ``"gpu"`` ... (for the default chunk).

    Returns:
      The plan.

    Raises:
      ValueError: the batch is larger than the training set or not divisible by the
        mesh's ``data`` axis, a bad ``mesh``, or a chunk that does not divide an epoch.

    Example:
      >>> plan_training(me.TrainConfig(mesh="ensemble=4,data=2"), 60000, 8, "cpu").mesh
      {'ensemble': 4, 'data': 2}
    """
    batch = cfg.batch_size if cfg.batch_size is not None else min(DEFAULT_BATCH, num_train)
    if batch > num_train:
        raise ValueError(
            f"batch_size={batch} is larger than the {num_train} training examples; "
            f"use --batch-size {num_train} or less"
        )
    mesh = parse_mesh(cfg.mesh) if cfg.mesh else default_mesh_shape(cfg.members, devices)
    steps_per_epoch = num_train // batch
    total_steps = cfg.epochs * steps_per_epoch
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    data_size = int(mesh.get("data", 1))
    if batch % data_size:
        what = f"batch_size={batch}" if batch == cfg.batch_size else (
            f"the batch of all {num_train} training examples (batch_size=None)"
        )
        raise ValueError(
            f"{what} is not divisible by the mesh's data axis ({data_size}); use a "
            f"--batch-size that is a multiple of {data_size}"
        )
    k = min(cfg.chunk_steps or default_chunk_steps(platform, steps_per_epoch), steps_per_epoch)
    if steps_per_epoch % k:
        raise ValueError(
            f"chunk_steps={k} does not divide the {steps_per_epoch} steps of an epoch; "
            f"pick a divisor of {steps_per_epoch}"
        )
    every = cfg.eval_every or max(1, cfg.epochs // EVALUATIONS)
    return TrainPlan(dict(mesh), steps_per_epoch, total_steps, k, batch, every)
