"""How a device maps a function over its local members: ``vmap`` or an unrolled loop.

Also the strategies an :class:`~meshensemble.Ensemble` chooses from and the default one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def map_members(fn: Callable[..., Any], strategy: str, in_axes: tuple[Any, ...], *args: Any):
    """Applies ``fn`` to each local member, stacking the results on a leading axis.

    ``in_axes`` says for each argument whether it has a member axis (0) or is shared
    (None), as in ``jax.vmap``. ``strategy="vmap"`` vectorises; ``"loop"`` unrolls a
    Python loop inside the compiled step (faster for convolutions on CPU, where vmap
    turns them into grouped convolutions). One local member is vmapped either way.
    """
    m = next(jax.tree.leaves(a)[0].shape[0] for a, ax in zip(args, in_axes) if ax == 0)
    if strategy == "vmap" or m == 1:
        # One member: vmap over an axis of size 1 makes no grouped convolution, and the
        # results keep their leading axis, where the loop's index and stack let XLA
        # duplicate the optimizer's update into fusions that all read the donated state,
        # so it copied the state every step (the user CNN's step on 8 CPU devices was
        # ~5% slower for it).
        return jax.vmap(fn, in_axes=in_axes)(*args)
    outs = [
        fn(
            *(
                a if ax is None else jax.tree.map(lambda v, i=i: v[i], a)
                for a, ax in zip(args, in_axes)
            )
        )
        for i in range(m)
    ]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


STRATEGIES = ("auto", "vmap", "loop")
"""Ways to compute the members a device holds (see :func:`default_strategy`)."""


def default_strategy(platform: str) -> str:
    """The member strategy measured fastest on ``platform``.

    On CPU an unrolled loop over local members beats ``vmap`` (which turns each
    convolution into a slow grouped convolution); on accelerators ``vmap`` batches the
    members into one kernel.

    Args:
      platform: ``"cpu"``, ``"gpu"``, ``"tpu"`` ...

    Returns:
      ``"loop"`` or ``"vmap"``.

    Example:
      >>> me.default_strategy("cpu")
      'loop'
    """
    return "loop" if platform == "cpu" else "vmap"
