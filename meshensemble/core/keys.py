"""Which PRNG implementation a state's raw key words belong to (a pure function of them).

An :class:`~meshensemble.core.state.EnsembleState` stores each member's stochastic stream
as raw ``uint32`` key data, ``[members, words]``. The steps turn it back into a key from
its number of words alone, so a program follows the state it is given: the default
implementation's word count (2 for ``threefry2x32``) is used as a legacy raw key (the
same bits as the typed key), 2 words otherwise mean ``threefry2x32`` and 4 words
``rbg``. ``unsafe_rbg`` also has 4 words: name it with ``Ensemble(..., key_impl=...)``.

It also holds the keys of an on-device augmentation (:func:`augment_key`,
:func:`augment_batch`: every example of the global batch its own key, so the result does
not depend on the mesh); the augmentations themselves are in
:mod:`meshensemble.data.augment`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax import lax

BY_WORDS = {2: "threefry2x32", 4: "rbg"}
"""The implementation a state's key words name when the ensemble declares none."""


@functools.cache
def words(impl: str) -> int:
    """The raw ``uint32`` words of one key of implementation ``impl`` (nothing runs).

    Args:
      impl: ``"threefry2x32"``, ``"rbg"``, ``"unsafe_rbg"`` ...

    Returns:
      The key data's last dimension.

    Example:
      >>> words("rbg")
      4
    """
    shape = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape
    return int(shape[-1])


def impl_for(num_words: int, declared: str | None = None) -> str | None:
    """The implementation of a state whose keys have ``num_words`` words.

    Args:
      num_words: the last dimension of ``state.rng``.
      declared: the ensemble's ``key_impl`` (used when its word count matches), or None.

    Returns:
      None when the keys are used raw (legacy keys of the default implementation), else
      the implementation's name for ``jax.random.wrap_key_data``.

    Raises:
      ValueError: no implementation has ``num_words`` words.

    Example:
      >>> impl_for(4)
      'rbg'
    """
    if declared is not None and words(declared) == num_words:
        return declared
    if words(str(jax.config.jax_default_prng_impl)) == num_words:
        return None
    if num_words not in BY_WORDS:
        raise ValueError(
            f"the state's keys have {num_words} words, which no known PRNG implementation "
            f"has ({', '.join(f'{v}: {k}' for k, v in BY_WORDS.items())}); pass "
            "Ensemble(..., key_impl=<name>)"
        )
    return BY_WORDS[num_words]


def name_of(impl: str | None) -> str:
    """``impl``'s name, the default implementation's for None (raw legacy keys)."""
    return str(jax.config.jax_default_prng_impl) if impl is None else impl


def check_key(key: jax.Array, declared: str | None = None) -> bool:
    """Checks that ``key`` is one PRNG key whose state the steps will read back as it is.

    Args:
      key: a legacy ``jax.random.PRNGKey`` or a typed ``jax.random.key``.
      declared: the ensemble's ``key_impl``, or None.

    Returns:
      Whether ``key`` is a typed key.

    Raises:
      ValueError: not one key, or a typed key whose implementation its word count does
        not name (``unsafe_rbg`` without ``key_impl="unsafe_rbg"``).

    Example:
      >>> check_key(jax.random.key(0, impl="rbg"))
      True
    """
    typed = jax.numpy.issubdtype(key.dtype, jax.dtypes.prng_key)
    if (typed and key.shape != ()) or (not typed and key.shape != (2,)):
        raise ValueError(
            f"key of shape {key.shape} and dtype {key.dtype} is not one PRNG key; "
            "pass jax.random.key(seed) or jax.random.PRNGKey(seed)"
        )
    if typed:
        impl = str(jax.random.key_impl(key))
        read = name_of(impl_for(words(impl), declared))
        if read != impl:
            raise ValueError(
                f"a {impl} key's state would be read back as {read} (both have "
                f"{words(impl)} words); pass Ensemble(..., key_impl={impl!r})"
            )
    return typed


def check_impl(impl: str | None) -> str | None:
    """``impl`` if it names a PRNG implementation (None stays None); ValueError otherwise.

    Example:
      >>> check_impl("unsafe_rbg")
      'unsafe_rbg'
    """
    if impl is None:
        return None
    try:
        words(str(impl))
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(
            f"key_impl={impl!r} is not a PRNG implementation; use 'threefry2x32', 'rbg', "
            "'unsafe_rbg' or None"
        ) from err
    return str(impl)


# --------------------------------------------------------------------------- augmentation keys

Augment = Callable[[jax.Array, jax.Array], jax.Array]
"""``fn(key, image [H, W, C]) -> image [H, W, C]``: one example's augmentation."""

AUGMENT_SALT = 0x61756721
"""Folded into a member's key before the step, so augmentation keys never equal the
dropout keys (``fold_in(fold_in(key, step), data_index)``) of any step below 1.6e9."""


def augment_key(key: jax.Array, step: jax.Array) -> jax.Array:
    """The key a member's augmentations of step ``step`` are drawn from.

    Args:
      key: the member's key (a row of ``EnsembleState.rng``, raw or wrapped).
      step: the member's step count (``EnsembleState.step``).

    Returns:
      ``fold_in(fold_in(key, AUGMENT_SALT), step)``.

    Example:
      >>> k = augment_key(jax.random.key(0), 3)
      >>> k.shape, jax.random.key_data(k).tolist() == jax.random.key_data(
      ...     augment_key(jax.random.key(0), 3)).tolist()   # the same key and step: the same key
      ((), True)
    """
    return jax.random.fold_in(jax.random.fold_in(key, AUGMENT_SALT), step)


def augment_batch(
    fn: Augment,
    key: jax.Array,
    step: jax.Array,
    images: jax.Array,
    start: jax.Array | int = 0,
    total: int | None = None,
) -> jax.Array:
    """Augments rows ``start .. start + b - 1`` of a global batch of ``total`` examples.

    Example ``j`` of the global batch uses key ``split(augment_key(key, step), total)[j]``,
    so the result of a row does not depend on how the batch is split.

    Args:
      fn: the augmentation of one example.
      key: the member's key.
      step: the member's step count.
      images: this shard's rows ``[b, H, W, C]``.
      start: the global index of ``images[0]`` (``axis_index(data) * b`` in a step).
      total: the global batch size (default ``b``: ``images`` is the whole batch).

    Returns:
      ``[b, H, W, C]`` augmented images.

    Example:
      >>> from meshensemble.data.augment import make_augment
      >>> x = augment_batch(make_augment("shift", 2), jax.random.key(0), 0, images)
      >>> x.shape, x.dtype
      ((32, 28, 28, 1), dtype('uint8'))
    """
    b = images.shape[0]
    keys = jax.random.split(augment_key(key, step), b if total is None else total)
    keys = lax.dynamic_slice_in_dim(keys, start, b) if total is not None else keys
    return jax.vmap(fn)(keys, images)
