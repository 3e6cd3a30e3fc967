"""What an :class:`~meshensemble.Ensemble` derives from its arguments by shapes alone.

Pure functions (nothing runs on a device): the signature of an input batch, whose shape
the state layout of sharded members follows, and the number of classes a model predicts.
The ``Ensemble`` caches their results under their arguments, so no answer depends on
which call came first.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from meshensemble.core.state import EnsembleState, whole_params


def row(x: Any, per_member: bool = False) -> jax.ShapeDtypeStruct:
    """One example of ``x`` as a batch of one, ``[1, ...]``: what a layout depends on.

    Args:
      x: a batch ``[B, ...]`` (or ``[members, B, ...]`` with ``per_member``), an array or
        a ``jax.ShapeDtypeStruct``.
      per_member: whether ``x`` has a leading member axis.

    Returns:
      ``jax.ShapeDtypeStruct((1, *example_shape), dtype)``.

    Example:
      >>> row(np.zeros((32, 28, 28, 1), np.uint8)).shape
      (1, 28, 28, 1)
    """
    shape = tuple(np.shape(x))[2 if per_member else 1 :]
    dtype = getattr(x, "dtype", None) or np.result_type(x)
    return jax.ShapeDtypeStruct((1, *shape), np.dtype(dtype))


def signature(x: jax.ShapeDtypeStruct | None) -> Any:
    """A hashable key of :func:`row`'s result (None stays None)."""
    return None if x is None else (tuple(x.shape), str(x.dtype))


def num_classes(model: Any, input_transform: Any, state: EnsembleState, x: Any) -> int:
    """The size of the model's last output axis, from shapes (``jax.eval_shape``).

    Args:
      model: the :class:`meshensemble.Model`.
      input_transform: applied before the model (None: none).
      state: an ensemble state (its shapes are used, not its values).
      x: an input batch of the model's shape (array or ``jax.ShapeDtypeStruct``).

    Returns:
      ``C``.

    Example:
      >>> num_classes(ens.model, None, state, images[:1])
      10
    """
    member = lambda v: jax.ShapeDtypeStruct(v.shape[1:], v.dtype)
    params, model_state, rng = jax.tree.map(member, (state.params, state.model_state, state.rng))
    shared = getattr(state, "shared", None)  # a layout's shared leaves: shapes, no sharding
    params = whole_params(
        params, jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), shared)
    )
    transform = input_transform or (lambda v: v)
    apply = lambda p, ms, xx, r: model.apply(p, ms, transform(xx), False, r)[0]
    return int(jax.eval_shape(apply, params, model_state, row(x), rng).shape[-1])


def member_params(model: Any, input_transform: Any, x: Any) -> Any:
    """One member's parameters as shapes (``jax.ShapeDtypeStruct``): what filters look at.

    Args:
      model: the :class:`meshensemble.Model`.
      input_transform: applied before the model (None: none).
      x: an input batch of the model's shape (array or ``jax.ShapeDtypeStruct``).

    Returns:
      The model's parameter tree of shapes, no member axis.

    Example:
      >>> member_params(ens.model, None, images[:1])["Dense_0"]["kernel"].shape
      (784, 8)
    """
    transform = input_transform or (lambda v: v)
    init = lambda xx: model.init(jax.random.PRNGKey(0), transform(xx))[0]
    return jax.eval_shape(init, row(x))


def state_signature(state: EnsembleState) -> Any:
    """A hashable key of a state's tree structure, shapes and dtypes."""
    parts = (state.params, state.model_state, state.rng, getattr(state, "shared", None))
    leaves, tree = jax.tree.flatten(parts)
    return tree, tuple((tuple(np.shape(v)), str(v.dtype)) for v in leaves)


def check_label_range(labels: Any, classes: int) -> None:
    """ValueError naming the labels' range when one is outside ``[0, classes)``.

    Args:
      labels: integer class indices, numpy or a (fully addressable) ``jax.Array``.
      classes: the number of classes the model predicts.

    Raises:
      ValueError: a label below 0 or at least ``classes``.

    Example:
      >>> check_label_range(np.array([0, 9]), 10)
    """
    if isinstance(labels, jax.Array):
        lo, hi = (int(v) for v in jax.device_get((jax.numpy.min(labels), jax.numpy.max(labels))))
    else:
        lo, hi = int(np.min(labels)), int(np.max(labels))
    if lo < 0 or hi >= classes:
        raise ValueError(
            f"labels range over [{lo}, {hi}] but the model predicts {classes} classes; "
            f"give class indices in [0, {classes})"
        )
