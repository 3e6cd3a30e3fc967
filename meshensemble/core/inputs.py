"""Checks and small transforms of what users hand the ``Ensemble``, at the boundary.

Every check raises one line naming the bad value and the fix, before anything runs.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.errors import ScopeParamShapeError

from meshensemble.core.mesh import AXES, MODEL
from meshensemble.core.state import EnsembleState
from meshensemble.errors import UsageError


def compute_dtype(value: Any) -> Any:
    """``value`` as a floating numpy dtype (None stays None); ValueError otherwise."""
    if value is None:
        return None
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"compute_dtype={value!r} is not a floating dtype; use 'bfloat16' or None")
    if dtype == jnp.float16:
        raise ValueError(
            "compute_dtype=float16 needs loss scaling (its gradients underflow), which "
            "meshensemble does not do; use 'bfloat16' (float32's range, the same speed on "
            "accelerators) or None"
        )
    return dtype


def check_optimizer(optimizer: Any) -> None:
    """One-line TypeError unless ``optimizer`` is an optax ``GradientTransformation``."""
    if callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)):
        return
    name = getattr(optimizer, "__qualname__", type(optimizer).__name__)
    module = str(getattr(optimizer, "__module__", "optax"))
    module = "optax" if module.startswith("optax") else module
    hint = (
        f"call it first, e.g. {module}.{name}(learning_rate=0.1)"
        if callable(optimizer)
        else "pass e.g. optax.sgd(0.1, momentum=0.9)"
    )
    raise TypeError(
        f"optimizer {name} is not an optax GradientTransformation (no init/update); {hint}"
    )


def as_array(x: Any, what: str) -> Any:
    """``x`` unchanged if it is a numpy or jax array, else ``np.asarray(x)`` (lists, tuples)."""
    if isinstance(x, np.ndarray | jax.Array):
        return x
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what} cannot be made an array ({err}); pass a numpy array") from None


def check_batch(
    images: Any,
    labels: Any,
    num_members: int,
    data_size: int,
    target_ndim: int = 0,
    words: tuple[str, str] = ("images", "labels"),
) -> bool:
    """Checks a training batch's shapes; returns whether it is per member.

    Args:
      images: inputs ``[B, ...]`` or per member ``[members, B, ...]``.
      labels: targets ``[B, *t]`` or ``[members, B, *t]``, ``t`` of ``target_ndim`` axes.
      num_members: the ensemble's size.
      data_size: the mesh's ``data`` axis, which must divide ``B``.
      target_ndim: the axes of one example's target (0 for a class id).
      words: what the messages call the inputs and the targets.

    Returns:
      True for per-member batches.

    Raises:
      ValueError: one line naming the shapes and the fix.

    Example:
      >>> check_batch(np.zeros((8, 28, 28, 1)), np.zeros(8, int), 4, 2)
      False
    """
    (xw, yw), ishape, lshape = words, np.shape(images), np.shape(labels)
    one = "".join(f", T{i}" if target_ndim > 1 else ", T" for i in range(target_ndim))
    if len(lshape) not in (target_ndim + 1, target_ndim + 2):
        raise ValueError(f"{yw} of shape {lshape} must be [B{one}] or per-member [members, B{one}]")
    per_member = len(lshape) == target_ndim + 2
    if per_member and lshape[0] != num_members:
        raise ValueError(
            f"per-member {yw} of shape {lshape} have {lshape[0]} members, the ensemble has "
            f"{num_members}; give [{num_members}, B{one}] or shared [B{one}]"
        )
    lead = len(lshape) - target_ndim
    if tuple(ishape[:lead]) != tuple(lshape[:lead]):
        raise ValueError(
            f"{xw} of shape {ishape} and {yw} of shape {lshape} differ in length; give one "
            f"{yw.rstrip('s')} per {xw.rstrip('s')}"
        )
    batch = lshape[lead - 1]
    if batch == 0 or batch % data_size:
        raise ValueError(
            f"batch size {batch} is not a positive multiple of the mesh's data axis "
            f"({data_size}); use a batch size divisible by {data_size}"
        )
    return per_member


def consume(state: EnsembleState) -> None:
    """Marks a state given to ``train_step`` as used on every backend (as donation does).

    Under ``shard_map`` the jitted step donates the state's buffers when they are already in
    place; a state that had to be moved first, or the ``pmap`` backend's per-device copies,
    would otherwise leave the old state alive on one path and dead on another. Deleting the
    input's arrays makes every path behave alike: the next use raises the clear error of
    :meth:`meshensemble.Ensemble.train_step`.
    """
    for leaf in jax.tree.leaves(state):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


def check_positive_int(name: str, value: Any) -> None:
    """One-line ValueError unless ``value`` is a positive whole number (bools are not)."""
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer, e.g. {name}=1000")


def check_state(state: Any, num_members: int) -> None:
    """One-line ValueError unless ``state`` is a live :class:`EnsembleState` of ``num_members``.

    Args:
      state: what was handed to ``train_step``, ``predict`` or ``evaluate``.
      num_members: the ensemble's size.

    Raises:
      ValueError: not an ``EnsembleState``, another member count, or consumed (donated)
        by an earlier ``train_step``.

    Example:
      >>> check_state(state, ens.num_members)
    """
    if not isinstance(state, EnsembleState):
        raise ValueError(
            f"state is a {type(state).__name__}, not an EnsembleState; make it with ens.init"
        )
    if state.num_members != num_members:
        raise ValueError(
            f"state has {state.num_members} members but this Ensemble has "
            f"{num_members}; use the state made by this ensemble's init"
        )
    if any(isinstance(v, jax.Array) and v.is_deleted() for v in jax.tree.leaves(state)):
        raise ValueError(
            "state was consumed by an earlier train_step (its buffers are donated and "
            "reused); use the state that call returned: state, metrics = "
            "ens.train_step(state, images, labels)"
        )


def explains_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorates an ``Ensemble`` method ``(self, state, images, ...)``: raw errors of a state
    or images that do not fit the ensemble become one :class:`~meshensemble.errors.UsageError`.

    Only the failure path does any work: images whose shape does not fit the parameters
    (Flax's ``ScopeParamShapeError``), an optimizer state of another optimizer (an
    ``AttributeError``/``TypeError`` while tracing, e.g. ``'TraceState' object has no
    attribute 'mu'``: an SGD state given to an Adam ensemble), and, with split members, a
    step shard_map's type check refuses (:data:`SPLIT_MEMBERS_UPDATE`). Other errors pass
    unchanged.

    Example:
      >>> @explains_errors
      ... def train_step(self, state, images, labels): ...
    """

    @functools.wraps(method)
    def checked(self: Any, state: Any, images: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, state, images, *args, **kwargs)
        except ScopeParamShapeError as err:
            raise UsageError(images_mismatch(images, err)) from None
        except (AttributeError, TypeError):
            line = optimizer_mismatch(state, self.optimizer)
            if line is None:
                raise
            raise UsageError(line) from None
        except ValueError as err:  # shard_map's type check of a step on split members
            text = str(err)
            if not (self._sharded and text.startswith("shard_map applied") and "vma" in text):
                raise
            raise UsageError(SPLIT_MEMBERS_UPDATE) from err

    return checked


SPLIT_MEMBERS_UPDATE = (
    "the step does not trace with members split over data (shard_members=True): an "
    "optimizer transform that combines values across parameters (e.g. "
    "optax.clip_by_global_norm) cannot run on each device's slices; use per-parameter "
    "transforms (e.g. optax.clip) or shard_members=False"
)
"""The line for a step whose optimizer (or model) needs whole members under FSDP."""


def images_mismatch(images: Any, err: Exception) -> str:
    """The one line for images of a shape the state's parameters do not fit."""
    found = re.search(
        r'parameter "(\w+)" in "([^"]*)".*?generate shape (\([^)]*\)).*?has shape (\([^)]*\))',
        str(err),
        re.DOTALL,
    )
    detail = (
        f"parameter {found[2]}/{found[1]} has shape {found[4]}, these images need {found[3]}"
        if found
        else str(err).split(". ")[0]
    )
    shape = tuple(np.shape(images))
    return (
        f"images of shape {shape} do not fit the state's parameters ({detail}); give images "
        f"of the shape ens.init was given a sample of ([B, ...same per-example shape])"
    )


def optimizer_mismatch(state: Any, optimizer: Any) -> str | None:
    """A line when ``state.opt_state`` is not what ``optimizer`` makes, else None.

    Args:
      state: an :class:`EnsembleState` (leaves ``[members, ...]``).
      optimizer: the ensemble's optax optimizer.

    Returns:
      The one-line message naming both optimizer states' types, or None when their
      structures agree (or cannot be compared).

    Example:
      >>> optimizer_mismatch(state, optax.sgd(0.1)) is None   # the namespace's state: SGD
      True
      >>> print(optimizer_mismatch(state, optax.adam(1e-3)))
      state's optimizer state (...) is not ...
    """
    if not isinstance(state, EnsembleState):
        return None
    try:
        want = jax.eval_shape(jax.vmap(optimizer.init), state.params)
    except Exception:  # noqa: BLE001 (only an explanation: the original error stands)
        return None
    if jax.tree.structure(want) == jax.tree.structure(state.opt_state):
        return None
    return (
        f"state's optimizer state ({_kinds(state.opt_state)}) is not what this ensemble's "
        f"optimizer makes ({_kinds(want)}): the state was made by an Ensemble with another "
        "optimizer; use the state of this ensemble's init, or build the Ensemble with the "
        "optimizer the state was made with"
    )


def _kinds(tree: Any) -> str:
    """The optimizer state classes in ``tree`` (e.g. ``ScaleByAdamState, EmptyState``)."""
    found: list[str] = []

    def visit(x: Any) -> None:
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            found.append(type(x).__name__)
        if isinstance(x, tuple | list):
            for v in x:
                visit(v)
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)

    visit(tree)
    return ", ".join(dict.fromkeys(found)) or type(tree).__name__


def check_mesh_axes(mesh: Any) -> Any:
    """``mesh`` when its axes are ``("ensemble", "data")`` (or with ``"model"``); ValueError."""
    if tuple(mesh.axis_names) not in (AXES, (*AXES, MODEL)):
        raise ValueError(
            f"mesh axes {tuple(mesh.axis_names)} are not {AXES} (or with {MODEL!r}); "
            "build it with me.make_mesh(ensemble=..., data=..., model=...)"
        )
    return mesh


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """ValueError naming ``name``'s value and the choices when ``value`` is not one of them."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is unknown; choose one of {', '.join(choices)}")


def num_examples(images: Any) -> int:
    """``N`` of ``images [N, ...]``; ValueError naming the shape when it holds no example."""
    n = int(np.shape(images)[0]) if np.ndim(images) else 0
    if n == 0:
        raise ValueError(
            f"images of shape {np.shape(images)} hold no example; give at least one image"
        )
    return n
