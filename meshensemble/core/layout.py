"""Member layouts: which parameter leaves each member owns, which all share, which are frozen.

An :class:`~meshensemble.Ensemble` made with ``shared=FILTER`` and/or ``frozen=FILTER``
splits the model's parameter tree by these filters, functions
``(path: tuple[str, ...], leaf) -> bool`` of a leaf's path in one member's tree (e.g.
``("Dense_0", "kernel")``) and the leaf itself (one member's array or its shape, never
with the member axis):

* **member** leaves (the default): stacked on the member axis, one value per member, each
  updated with the gradient of its member's own loss (as without a layout);
* **shared** leaves: one copy without the member axis (replicated over ``ensemble``),
  initialised once (as member 0's) and updated once per step with the gradient of the mean
  of the members' losses;
* **frozen** leaves (shared or not): no gradient, no optimizer state, never changed.

The trees here mark what is absent with ``None`` (an empty subtree to JAX and orbax), so
the member part and the shared part of a tree keep the model's structure and merge back
by :func:`combine`. This module holds the pure tree functions; the state and the steps
use them (:mod:`meshensemble.core.state`, :mod:`meshensemble.core.steps`).

Example:
  >>> params = {"Dense_0": {"kernel": np.ones((3, 2)), "bias": np.zeros(2)}}
  >>> layout = Layout(shared=lambda path, leaf: path[-1] == "kernel")
  >>> own, shared = partition(params, layout.shared_mask(params))
  >>> own["Dense_0"]["kernel"] is None, shared["Dense_0"]["bias"] is None
  (True, True)
  >>> combine(own, shared)["Dense_0"]["kernel"].shape
  (3, 2)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from meshensemble.errors import UsageError

PyTree = Any
Filter = Callable[[tuple[str, ...], Any], bool]
"""A leaf filter: ``(path, leaf) -> bool``, ``path`` the leaf's keys as strings."""


def key_name(key: Any) -> str:
    """One entry of a JAX key path as a string (a dict key, an attribute, an index).

    Example:
      >>> key_name(jax.tree_util.DictKey("kernel")), key_name(jax.tree_util.SequenceKey(2))
      ('kernel', '2')
    """
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_names(path: tuple[Any, ...]) -> tuple[str, ...]:
    """A JAX key path as the tuple of strings filters see, e.g. ``("Dense_0", "kernel")``."""
    return tuple(key_name(k) for k in path)


def is_none(x: Any) -> bool:
    """Whether ``x`` is ``None`` (the ``is_leaf`` of trees with absent leaves)."""
    return x is None


def partition(tree: PyTree, mask: PyTree) -> tuple[PyTree, PyTree]:
    """Splits ``tree`` by a tree of booleans: ``(where False, where True)``, ``None`` elsewhere.

    Args:
      tree: a tree (absent leaves ``None`` stay absent in both parts).
      mask: a tree of the same structure with a bool per leaf (None: nothing is True).

    Returns:
      Two trees of ``tree``'s structure; each leaf is in exactly one of them.

    Example:
      >>> partition({"a": 1, "b": 2}, {"a": True, "b": False})
      ({'a': None, 'b': 2}, {'a': 1, 'b': None})
    """
    if mask is None:
        return tree, jax.tree.map(lambda _: None, tree)
    out = jax.tree.map(lambda v, m: None if m else v, tree, mask, is_leaf=is_none)
    into = jax.tree.map(lambda v, m: v if m else None, tree, mask, is_leaf=is_none)
    return out, into


def combine(*trees: PyTree) -> PyTree:
    """Merges trees of one structure whose leaves are each present in one of them.

    Args:
      *trees: trees from :func:`partition` (or None, nothing to add).

    Returns:
      The tree with each leaf taken from the first tree that has it (None if none does).

    Example:
      >>> combine({"a": None, "b": 2}, {"a": 1, "b": None})
      {'a': 1, 'b': 2}
    """
    present = [t for t in trees if t is not None]
    if len(present) == 1:
        return present[0]
    first = lambda *xs: next((x for x in xs if x is not None), None)
    return jax.tree.map(first, *present, is_leaf=is_none)


def flags(tree: PyTree, fn: Filter | None, what: str) -> PyTree:
    """``fn(path, leaf)`` for every leaf of ``tree`` as a tree of bools (all False for None).

    Raises:
      UsageError: the filter raised or returned a non-bool (one line naming the path).
    """

    def one(path: tuple[Any, ...], leaf: Any) -> bool:
        if fn is None:
            return False
        names = path_names(path)
        try:
            value = fn(names, leaf)
        except Exception as err:  # noqa: BLE001 (the user's filter: say where it failed)
            raise UsageError(
                f"{what} filter raised {type(err).__name__}: {err} on {'/'.join(names)}; a "
                "filter takes (path: tuple[str, ...], leaf) and returns a bool"
            ) from None
        if not isinstance(value, bool | np.bool_):
            raise UsageError(
                f"{what} filter returned {value!r} for {'/'.join(names)}; return True or False"
            )
        return bool(value)

    return jax.tree_util.tree_map_with_path(one, tree)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which leaves of a member's parameters are shared and which are frozen.

    Attributes:
      shared: the filter of the shared leaves (one copy without the member axis), or None.
      frozen: the filter of the frozen leaves (no gradient, no optimizer state), or None.

    Example:
      >>> Layout().trivial, Layout(frozen=lambda path, leaf: "backbone" in path).trivial
      (True, False)
    """

    shared: Filter | None = None
    frozen: Filter | None = None

    def __post_init__(self) -> None:
        for name in ("shared", "frozen"):
            fn = getattr(self, name)
            if fn is not None and not callable(fn):
                raise UsageError(
                    f"{name}={fn!r} is not a filter; pass a function (path: tuple[str, ...], "
                    f"leaf) -> bool, e.g. {name}=lambda path, leaf: path[-1] == 'kernel', or None"
                )

    @property
    def trivial(self) -> bool:
        """No filter: every leaf is a member's own and trained (the plain ensemble)."""
        return self.shared is None and self.frozen is None

    def shared_mask(self, params: PyTree) -> PyTree:
        """The shared filter over one member's parameters, a tree of bools."""
        return flags(params, self.shared, "shared")

    def frozen_mask(self, params: PyTree) -> PyTree:
        """The frozen filter over one member's parameters, a tree of bools."""
        return flags(params, self.frozen, "frozen")

    def frozen_flags(self, params: PyTree) -> tuple[bool, ...]:
        """:meth:`frozen_mask` as one bool per leaf, in the tree's flattening order."""
        return tuple(jax.tree.leaves(self.frozen_mask(params)))


def frozen_split(tree: PyTree, frozen: tuple[bool, ...] | None) -> tuple[PyTree, PyTree]:
    """``(trainable, frozen)`` parts of ``tree`` from per-leaf flags (flattening order).

    Args:
      tree: a tree whose present leaves line up with ``frozen``; absent leaves (None)
        are skipped by the flags as by JAX.
      frozen: one bool per present leaf, or None (nothing frozen: ``(tree, None)``).

    Returns:
      The two parts (None where absent), or ``(tree, None)``.

    Example:
      >>> frozen_split({"a": 1, "b": 2}, (True, False))
      ({'a': None, 'b': 2}, {'a': 1, 'b': None})
    """
    if frozen is None:
        return tree, None
    leaves, treedef = jax.tree.flatten(tree)
    if len(leaves) != len(frozen):
        raise ValueError(f"{len(frozen)} frozen flags for a tree of {len(leaves)} leaves")
    return partition(tree, jax.tree.unflatten(treedef, list(frozen)))


def given_values(
    abstract: PyTree, given: PyTree, shared: PyTree, num_members: int, what: str = "params"
) -> tuple[PyTree, Any]:
    """Checks the values given for some leaves; returns them on the model's full structure.

    Args:
      abstract: one member's parameters (shapes: ``jax.ShapeDtypeStruct`` or arrays).
      given: a tree of values for any subset of its leaves (numpy or JAX arrays), the
        model's paths (e.g. ``{"Dense_0": {"kernel": w}}``), or None.
      shared: :meth:`Layout.shared_mask` of ``abstract`` (a shared leaf takes the member's
        shape only; a member leaf also ``[num_members, *shape]``, one value per member).
      num_members: ``M``.
      what: how the messages name the given tree (e.g. ``"--backbone runs/b"``).

    Returns:
      ``(full, signature)``: a tree of ``abstract``'s structure with the given values cast
      to each leaf's dtype and None elsewhere, and a hashable key of their shapes.

    Raises:
      UsageError: a given path is not a parameter of the model, or a value's shape does not
        fit its leaf (one line naming the path and both shapes).

    Example:
      >>> abstract = {"w": jax.ShapeDtypeStruct((3, 2), np.float32)}
      >>> full, _ = given_values(abstract, {"w": np.ones((3, 2))}, {"w": False}, 4)
      >>> full["w"].dtype, full["w"].shape
      (dtype('float32'), (3, 2))
    """
    if given is None:
        return None, None
    want = {path_names(p): v for p, v in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    is_shared = dict(zip(want, jax.tree.leaves(shared)))
    have: dict[tuple[str, ...], Any] = {}
    for path, value in jax.tree_util.tree_flatten_with_path(given)[0]:
        names = path_names(path)
        if names not in want:
            tops = ", ".join(sorted({p[0] for p in want if p}))
            raise UsageError(
                f"{what}: {'/'.join(names)} is not a parameter of the model (its leaves are "
                f"under {tops}); give values at the model's own paths"
            )
        leaf, shape = want[names], tuple(np.shape(value))
        fits = shape == tuple(leaf.shape) or (
            not is_shared[names] and shape == (num_members, *leaf.shape)
        )
        if not fits:
            per = "" if is_shared[names] else f" (or {(num_members, *leaf.shape)}, one per member)"
            raise UsageError(
                f"{what}: {'/'.join(names)} has shape {shape}; the model's is "
                f"{tuple(leaf.shape)}{per}: give values of this model (the same architecture)"
            )
        have[names] = np.asarray(value, dtype=leaf.dtype)
    full = jax.tree_util.tree_map_with_path(lambda p, _: have.get(path_names(p)), abstract)
    signature = tuple(sorted((k, v.shape, str(v.dtype)) for k, v in have.items()))
    return full, signature
