"""Checkpoints with orbax-checkpoint: the stacked, sharded ensemble state and the loop position."""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from meshensemble.mesh import member_sharding
from meshensemble.steps import EnsembleState

CHECKPOINT_DIR = "checkpoints"
"""Folder under a run's workdir that holds its checkpoints."""


def checkpoint_manager(workdir: str, keep: int = 3) -> ocp.CheckpointManager:
    """An orbax ``CheckpointManager`` for ``workdir/checkpoints`` (asynchronous saves).

    Args:
      workdir: the run's folder.
      keep: how many of the latest checkpoints to keep.

    Returns:
      The manager; items ``state`` (the :class:`EnsembleState`) and ``loop`` (a JSON
      dict with the loop's position: epoch, step).

    Example:
      >>> mngr = me.checkpoint_manager("runs/mnist")
    """
    path = os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR))
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    return ocp.CheckpointManager(path, options=options, item_names=("state", "loop"))


def save_checkpoint(
    mngr: ocp.CheckpointManager, step: int, state: EnsembleState, loop: dict[str, Any]
) -> None:
    """Saves ``state`` and the loop position ``loop`` as checkpoint ``step`` (async).

    Args:
      mngr: from :func:`checkpoint_manager`.
      step: the run's global step.
      state: the ensemble state.
      loop: JSON-serialisable loop position.

    Example:
      >>> me.save_checkpoint(mngr, 100, state, {"epoch": 1, "step": 100})
    """
    mngr.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), loop=ocp.args.JsonSave(loop)),
    )


def restore_checkpoint(
    workdir: str, ens: Any, sample: Any, step: int | None = None
) -> tuple[EnsembleState, dict[str, Any], int]:
    """Restores a checkpoint of ``workdir`` onto ``ens``'s mesh (any mesh shape).

    Args:
      workdir: the run's folder.
      ens: the :class:`meshensemble.Ensemble` to restore into; its mesh may differ from
        the one the checkpoint was written with.
      sample: an input batch for the state's structure, e.g. ``images[:1]``.
      step: which checkpoint; default the latest.

    Returns:
      ``(state, loop, step)``.

    Raises:
      FileNotFoundError: no checkpoint (or not that step) in ``workdir``.

    Example:
      >>> state, loop, step = me.restore_checkpoint("runs/mnist", ens, images[:1])
    """
    mngr = checkpoint_manager(workdir)
    steps = mngr.all_steps()
    if not steps:
        raise FileNotFoundError(
            f"no checkpoint in {os.path.join(workdir, CHECKPOINT_DIR)}; run "
            "`meshensemble train --workdir` there first"
        )
    if step is None:
        step = mngr.latest_step()
    elif step not in steps:
        raise FileNotFoundError(
            f"no checkpoint {step} in {workdir}; available: {', '.join(map(str, steps))}"
        )
    shapes = jax.eval_shape(lambda: ens.init(jax.random.PRNGKey(0), sample))
    sharding = member_sharding(ens.mesh)
    target = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes
    )
    restored = mngr.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), loop=ocp.args.JsonRestore()
        ),
    )
    mngr.close()
    return restored["state"], dict(restored["loop"]), int(step)
