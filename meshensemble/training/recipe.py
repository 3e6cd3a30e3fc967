"""The recipe's defaults that need no config object: the optimizer, the mesh, K.

:func:`make_optimizer` builds the optax optimizer a :class:`~meshensemble.TrainConfig`
names; :func:`default_mesh_shape` and :func:`default_chunk_steps` are the defaults a run
takes when no mesh or ``--chunk-steps`` is given. All three are also importable from
:mod:`meshensemble.training.config`, where they were first.

Example:
  >>> default_mesh_shape(8, 8)
  {'ensemble': 8, 'data': 1}
"""

from __future__ import annotations

import math
from typing import Any

import optax


def make_optimizer(
    cfg: Any, total_steps: int, steps_per_epoch: int
) -> optax.GradientTransformation:
    """The optax optimizer a config asks for.

    Args:
      cfg: the run's config.
      total_steps: the run's length, for decaying schedules.
      steps_per_epoch: for the warm-up length.

    Returns:
      An ``optax.GradientTransformation``.

    Example:
      >>> tx = make_optimizer(me.TrainConfig(), total_steps=4690, steps_per_epoch=469)
    """
    lr: Any = cfg.learning_rate
    if cfg.schedule == "cosine":
        lr = optax.cosine_decay_schedule(cfg.learning_rate, max(total_steps, 1))
    elif cfg.schedule == "warmup_cosine":
        warmup = max(1, int(cfg.warmup_epochs * steps_per_epoch))
        lr = optax.warmup_cosine_decay_schedule(
            0.0, cfg.learning_rate, min(warmup, max(total_steps - 1, 1)), max(total_steps, 2)
        )
    if cfg.optimizer == "adamw":
        return optax.adamw(lr, weight_decay=cfg.weight_decay)
    base = optax.sgd(lr, cfg.momentum or None) if cfg.optimizer == "sgd" else optax.adam(lr)
    if cfg.weight_decay:
        return optax.chain(optax.add_decayed_weights(cfg.weight_decay), base)
    return base


def default_mesh_shape(members: int, devices: int) -> dict[str, int]:
    """The mesh a run uses when none is given: every device, members spread first.

    Args:
      members: the ensemble size.
      devices: the number of devices.

    Returns:
      ``{"ensemble": gcd(members, devices), "data": devices / ensemble}``.

    Example:
      >>> default_mesh_shape(8, 8), default_mesh_shape(1, 8), default_mesh_shape(8, 1)
      ({'ensemble': 8, 'data': 1}, {'ensemble': 1, 'data': 8}, {'ensemble': 1, 'data': 1})
    """
    e = math.gcd(members, devices)
    return {"ensemble": e, "data": devices // e}


def default_chunk_steps(platform: str, steps_per_epoch: int) -> int:
    """Steps per compiled call measured best on ``platform``.

    On CPU a train step inside a ``lax.scan`` body runs several times slower than as its
    own jitted call, so K=1 (asynchronous dispatch of on-device steps already hides the
    host); on accelerators a whole epoch per call removes the dispatch overhead.

    Args:
      platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``.
      steps_per_epoch: the run's steps per epoch.

    Returns:
      K, the steps per compiled call.

    Example:
      >>> default_chunk_steps("cpu", 469), default_chunk_steps("gpu", 469)
      (1, 469)
    """
    return 1 if platform == "cpu" else steps_per_epoch
