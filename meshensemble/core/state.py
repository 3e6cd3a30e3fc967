"""``EnsembleState``: the whole ensemble's training state, stacked on a leading member axis."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax

PyTree = Any


@flax.struct.dataclass
class EnsembleState:
    """The whole ensemble's training state; every leaf has leading axis ``num_members``.

    Attributes:
      step: ``[members]`` int32, steps taken by each member.
      params: model parameters, leaves ``[members, ...]``.
      opt_state: optimizer state, leaves ``[members, ...]``.
      model_state: mutable collections such as ``batch_stats``, leaves ``[members, ...]``
        (``{}`` for models without any).
      rng: ``[members, *key_shape]`` uint32 raw key data of each member's stochastic
        stream (dropout); step ``s`` uses ``fold_in(rng, s)``.

    Example:
      >>> state = ens.init(key, images[:1])
      >>> state.params["Dense_0"]["kernel"].shape  # (members, 3136, 256)
    """

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    model_state: PyTree
    rng: jax.Array

    @property
    def num_members(self) -> int:
        """Number of members (the leading axis of every leaf)."""
        return int(self.step.shape[0])
