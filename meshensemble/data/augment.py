"""On-device data augmentation: per member, per step, seeded, mesh-invariant, resume-exact.

An augmentation is a pure function ``fn(key, image) -> image`` of ONE example ``[H, W, C]``
(after the ensemble's ``input_transform``). The training step (``StepConfig.augment``) calls
it through :func:`augment_batch`, which gives every example of the GLOBAL batch its own key
drawn from the member's key and the step (:func:`augment_key`), then keeps the keys of the
rows this ``data`` shard holds. So:

* each member draws its own augmentations (its own key, ``EnsembleState.rng``), new ones
  every step (the key is folded with ``EnsembleState.step``);
* the result does not depend on the mesh: example ``j`` of a batch gets the same key
  whether the batch is split over 1, 2 or 4 ``data`` devices, and whether it was gathered
  on device or streamed from the host;
* a resumed run draws exactly what the uninterrupted one would (both keys live in the
  checkpointed state).

Example:
  >>> fn = me.data.augment.make_augment("shift", 2)
  >>> ens = me.Ensemble(me.models.CNN(), optax.sgd(0.1, 0.9), 8, augment=fn,
  ...                   input_transform=me.data.normalize)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from meshensemble.core.keys import AUGMENT_SALT as AUGMENT_SALT
from meshensemble.core.keys import Augment as Augment
from meshensemble.core.keys import augment_batch as augment_batch
from meshensemble.core.keys import augment_key as augment_key

AUGMENTS = ("none", "shift", "crop_flip")
"""Names :func:`make_augment` knows (``TrainConfig.augment``)."""


def _pad(image: jax.Array, pad: int) -> jax.Array:
    return jnp.pad(image, ((pad, pad), (pad, pad), (0, 0)))


def _crop(padded: jax.Array, dy: jax.Array, dx: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return lax.dynamic_slice(padded, (dy, dx, jnp.zeros_like(dy)), shape)


def random_shift(key: jax.Array, image: jax.Array, max_shift: int) -> jax.Array:
    """Translates one image by up to ``max_shift`` pixels each way, filling with zeros.

    Args:
      key: a PRNG key (raw or typed).
      image: ``[H, W, C]``.
      max_shift: the largest shift in pixels (>= 0); the row and column shifts are
        uniform integers in ``[-max_shift, max_shift]``, independent.

    Returns:
      ``[H, W, C]``, same dtype; pixels shifted in from outside are 0.

    Raises:
      ValueError: ``image`` is not ``[H, W, C]`` or ``max_shift`` is negative.

    Example:
      >>> random_shift(jax.random.key(0), jnp.ones((28, 28, 1)), 2).shape
      (28, 28, 1)
    """
    _check(image, max_shift, "max_shift")
    if max_shift == 0:
        return image
    d = jax.random.randint(key, (2,), 0, 2 * max_shift + 1)
    return _crop(_pad(image, max_shift), d[0], d[1], image.shape)


def random_crop_flip(key: jax.Array, image: jax.Array, pad: int) -> jax.Array:
    """Pads one image with ``pad`` zeros, crops it back at random, flips it left-right w.p. 1/2.

    The CIFAR recipe (``pad=4``): a translation by up to ``pad`` pixels each way with zero
    fill, then a horizontal mirror of half the examples.

    Args:
      key: a PRNG key (raw or typed).
      image: ``[H, W, C]``.
      pad: zeros added on each side before the crop (>= 0).

    Returns:
      ``[H, W, C]``, same dtype.

    Raises:
      ValueError: ``image`` is not ``[H, W, C]`` or ``pad`` is negative.

    Example:
      >>> random_crop_flip(jax.random.key(0), jnp.ones((32, 32, 3)), 4).shape
      (32, 32, 3)
    """
    _check(image, pad, "pad")
    k_crop, k_flip = jax.random.split(key)
    d = jax.random.randint(k_crop, (2,), 0, 2 * pad + 1)
    out = _crop(_pad(image, pad), d[0], d[1], image.shape) if pad else image
    return jnp.where(jax.random.bernoulli(k_flip), out[:, ::-1], out)


def _check(image: jax.Array, size: int, name: str) -> None:
    if image.ndim != 3:
        raise ValueError(
            f"augmentation got an example of shape {image.shape}; it takes one image [H, W, C]"
        )
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"{name}={size!r} must be an integer >= 0 (pixels)")


def make_augment(name: str, size: int = 2) -> Augment | None:
    """The augmentation called ``name`` (``TrainConfig.augment``), or None for ``"none"``.

    Args:
      name: one of :data:`AUGMENTS`: ``"none"``; ``"shift"`` (:func:`random_shift` by up to
        ``size`` pixels, for MNIST-like digits); ``"crop_flip"`` (:func:`random_crop_flip`
        with ``pad=size``, for CIFAR-like photos, where 4 is usual).
      size: pixels (``TrainConfig.augment_shift``), >= 0.

    Returns:
      ``fn(key, image) -> image``, or None.

    Raises:
      ValueError: an unknown name or a negative size.

    Example:
      >>> fn = make_augment("shift", 2)
      >>> fn(jax.random.key(0), jnp.ones((28, 28, 1))).shape
      (28, 28, 1)
    """
    if name not in AUGMENTS:
        raise ValueError(f"augment={name!r} is unknown; choose one of {', '.join(AUGMENTS)}")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"augment_shift={size!r} must be an integer >= 0 (pixels)")
    if name == "none":
        return None
    fn = random_shift if name == "shift" else random_crop_flip
    return _Named(fn, size, name)


class _Named:
    """``fn(key, image, size)`` bound to its size, comparable and readable (``repr``)."""

    def __init__(self, fn: Callable[..., jax.Array], size: int, name: str):
        self.fn, self.size, self.name = fn, size, name

    def __call__(self, key: jax.Array, image: jax.Array) -> jax.Array:
        return self.fn(key, image, self.size)

    def __repr__(self) -> str:
        return f"make_augment({self.name!r}, {self.size})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Named) and (self.fn, self.size) == (other.fn, other.size)

    def __hash__(self) -> int:
        return hash((self.fn, self.size))
