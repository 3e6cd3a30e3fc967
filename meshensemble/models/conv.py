"""Convolutions for members on the same device: XLA's, im2col matmuls, and a canonical backward.

A stride-1 ``SAME`` 2-D convolution can be computed three ways here, with equal values
and gradients (up to float rounding):

* ``"xla"``: ``lax.conv_general_dilated``, what ``flax.linen.Conv`` does by default.
* ``"im2col"``: image patches times the kernel, one matmul. It stays fast inside
  ``lax.scan`` bodies and under ``vmap`` (a batched matmul instead of a grouped
  convolution); it keeps the patch matrix for the backward pass (about 1.6x the
  activation memory of the CNN).
* ``"canonical"``: XLA's convolution with a backward pass stated as convolutions in the
  NHWC/HWIO layout XLA:CPU's fast kernels take, so that it is fast inside loop bodies
  too (at one step per call it is XLA's program).
* ``"gemm_grad"``: XLA's convolution forward and for the input gradient, the kernel
  gradient a GEMM (``einsum``) over image patches; under ``vmap`` over members no
  grouped convolution at all (:func:`conv_gemm_grad`). Also covers strides and any
  padding.

``"auto"`` picks per platform at trace time (:func:`default_conv`): ``"canonical"`` on
CPU, ``"im2col"`` on GPU (where vmapped members would otherwise run a grouped
convolution), ``"xla"`` on TPU.
:func:`conv_general_dilated` returns a drop-in for ``lax.conv_general_dilated`` that
``flax.linen.Conv`` takes as its ``conv_general_dilated`` attribute, so a model keeps
its parameters and only the computation changes; :class:`meshensemble.models.CNN` has a
``conv`` attribute that does this.

Example:
  >>> conv = nn.Conv(32, (3, 3), conv_general_dilated=me.conv.conv_general_dilated("auto"))
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from meshensemble.core.mesh import varying_axes

_DN = ("NHWC", "HWIO", "NHWC")


# ---------------------------------------------------------------------------------------
# Convolutions and the reformulated CNN


def conv_xla(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """A stride-1 ``SAME`` convolution, as ``flax.linen.Conv`` computes it.

    Args:
      x: ``[B, H, W, C]`` inputs.
      kernel: ``[kh, kw, C, F]`` with odd ``kh``, ``kw``.

    Returns:
      ``[B, H, W, F]``.

    Example:
      >>> conv_xla(jnp.ones((2, 8, 8, 1)), jnp.ones((3, 3, 1, 4))).shape
      (2, 8, 8, 4)
    """
    return lax.conv_general_dilated(x, kernel, (1, 1), "SAME", dimension_numbers=_DN)


def conv_im2col(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """:func:`conv_xla` as one matmul of image patches (``im2col``) by the kernel.

    Under ``jax.vmap`` over members this becomes a batched matmul (or, when the input is
    shared by all members, one matmul with the members' kernels side by side) instead
    of a grouped convolution, which XLA:CPU runs slowly.

    Args:
      x: ``[B, H, W, C]``.
      kernel: ``[kh, kw, C, F]`` with odd ``kh``, ``kw``.

    Returns:
      ``[B, H, W, F]``, equal to :func:`conv_xla` up to float rounding.

    Example:
      >>> conv_im2col(jnp.ones((2, 8, 8, 1)), jnp.ones((3, 3, 1, 4))).shape
      (2, 8, 8, 4)
    """
    b, h, w, c = x.shape
    kh, kw, _, f = kernel.shape
    xp = jnp.pad(x, ((0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2), (0, 0)))
    cols = jnp.concatenate(
        [xp[:, i : i + h, j : j + w, :] for i in range(kh) for j in range(kw)], axis=-1
    )
    out = cols.reshape(b * h * w, kh * kw * c) @ kernel.reshape(kh * kw * c, f)
    return out.reshape(b, h, w, f)


def _match_varying(*xs: jax.Array) -> list[jax.Array]:
    """Casts the arguments to the union of their varying mesh axes (inside shard_map).

    A ``custom_vjp``'s backward rule must return cotangents of its inputs' types; casting
    before the call keeps the implicit broadcast (and its transpose, a ``psum``) outside.
    """
    axes = frozenset().union(*(varying_axes(x) for x in xs))
    out = []
    for x in xs:
        missing = tuple(sorted(axes - varying_axes(x)))
        out.append(lax.pcast(x, missing, to="varying") if missing else x)
    return out


@jax.custom_vjp
def _conv_canonical(x: jax.Array, kernel: jax.Array) -> jax.Array:
    return conv_xla(x, kernel)


def _conv_canonical_fwd(x: jax.Array, kernel: jax.Array):
    return conv_xla(x, kernel), (x, kernel)


def _conv_canonical_bwd(res: tuple[jax.Array, jax.Array], g: jax.Array):
    x, kernel = res
    kh, kw = kernel.shape[:2]
    # Input gradient: a SAME convolution of g with the flipped kernel, in NHWC/HWIO.
    dx = conv_xla(g, jnp.transpose(kernel[::-1, ::-1], (0, 1, 3, 2)))
    # Kernel gradient: channels as the batch, the batch as features, g as the kernel.
    dk = lax.conv_general_dilated(
        jnp.transpose(x, (3, 1, 2, 0)),  # [C, H, W, B]
        jnp.transpose(g, (1, 2, 0, 3)),  # [H, W, B, F]
        (1, 1),
        ((kh // 2, kh // 2), (kw // 2, kw // 2)),
        dimension_numbers=_DN,
    )  # [C, kh, kw, F]
    return dx, jnp.transpose(dk, (1, 2, 0, 3))


_conv_canonical.defvjp(_conv_canonical_fwd, _conv_canonical_bwd)


def conv_canonical(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """:func:`conv_xla` whose backward convolutions are NHWC/HWIO, as XLA:CPU wants them.

    XLA:CPU runs a convolution with its fast library kernels only in the canonical
    layout (input NHWC, kernel HWIO). The gradients JAX derives for a convolution are
    convolutions in other layouts; XLA's ``ConvCanonicalization`` pass rewrites them
    with transposes, but only in the entry computation. Inside a ``lax.scan`` (a while
    loop) they stay as they are and run through a slow generic loop nest. This function
    states its backward pass as canonical convolutions with explicit transposes, so
    they are fast anywhere. Values and gradients equal :func:`conv_xla`'s.

    Args:
      x: ``[B, H, W, C]``.
      kernel: ``[kh, kw, C, F]`` with odd ``kh``, ``kw``.

    Returns:
      ``[B, H, W, F]``.

    Example:
      >>> jax.grad(lambda k: conv_canonical(jnp.ones((2, 8, 8, 1)), k).sum())(
      ...     jnp.ones((3, 3, 1, 4))).shape
      (3, 3, 1, 4)
    """
    x, kernel = _match_varying(x, kernel)
    return _conv_canonical(x, kernel)


# ---------------------------------------------------------------------------------------
# "gemm_grad": XLA's convolution forward, the kernel gradient as a GEMM over patches


@functools.cache
def _gemm_grad_conv(strides: tuple[int, int], pads: tuple[tuple[int, int], ...], precision: Any):
    """The custom-VJP convolution for one geometry (stride, explicit padding)."""

    def conv(x, k):
        return lax.conv_general_dilated(
            x, k, strides, pads, dimension_numbers=_DN, precision=precision
        )

    def dx_of(g, k, x_shape):
        # at zeros as varying as g (inside shard_map): else the transpose psums dx
        zeros = _match_varying(jnp.zeros(x_shape, g.dtype), g, k)[0]
        return jax.vjp(lambda x: conv(x, k), zeros)[1](g)[0]

    fwd_conv = _members_batched(conv, wide=True)

    @functools.cache
    def dx_conv(x_shape):
        return _members_batched(lambda g, k: dx_of(g, k, x_shape), wide=False)

    @jax.custom_vjp
    def f(x, k):
        return fwd_conv(x, k)

    def f_fwd(x, k):
        return fwd_conv(x, k), (x, k)

    def f_bwd(res, g):
        x, k = res
        dx = dx_conv(tuple(x.shape))(g, k)
        kh, kw, c, feat = k.shape
        cols = _patches(x, (kh, kw), strides, pads)  # [B, Ho, Wo, kh*kw*C]
        dk = jnp.einsum("bhwp,bhwf->pf", cols, g.astype(cols.dtype), precision=precision)
        return dx.astype(x.dtype), dk.reshape(kh, kw, c, feat).astype(k.dtype)

    f.defvjp(f_fwd, f_bwd)
    return f


def _patches(x, window, strides, pads) -> jax.Array:
    """``[B, Ho, Wo, kh*kw*C]`` image patches (kernel row, column, channel order), by slicing."""
    kh, kw = window
    xp = jnp.pad(x, ((0, 0), *pads, (0, 0)))
    b, hp, wp, c = xp.shape
    ho = (hp - kh) // strides[0] + 1
    wo = (wp - kw) // strides[1] + 1
    cols = [
        lax.slice(
            xp,
            (0, i, j, 0),
            (b, i + strides[0] * (ho - 1) + 1, j + strides[1] * (wo - 1) + 1, c),
            (1, strides[0], strides[1], 1),
        )
        for i in range(kh)
        for j in range(kw)
    ]
    return jnp.concatenate(cols, axis=-1)


def _members_batched(op: Callable[[jax.Array, jax.Array], jax.Array], wide: bool):
    """``op(x, k)`` (a convolution-like NHWC/HWIO op) whose ``vmap`` is no grouped convolution.

    JAX batches a convolution whose input and kernel are both batched into one grouped
    convolution (``feature_group_count`` = the batch). Here instead: a batched input with a
    shared kernel folds the batch into the images; a shared input with batched kernels is
    one wide convolution (the kernels stacked on the output features) when ``wide``; both
    batched is one ordinary convolution per member.
    """

    @jax.custom_batching.custom_vmap
    def batched(x, k):
        return op(x, k)

    @batched.def_vmap
    def rule(axis_size, in_batched, x, k):
        x_b, k_b = in_batched
        if x_b and not k_b:
            out = batched(x.reshape(-1, *x.shape[2:]), k)
            return out.reshape(axis_size, -1, *out.shape[1:]), True
        if k_b and not x_b and wide:
            stacked = jnp.moveaxis(k, 0, -2).reshape(*k.shape[1:-1], -1)  # [kh, kw, C, M*F]
            out = batched(x, stacked)
            out = out.reshape(*out.shape[:-1], axis_size, k.shape[-1])
            return jnp.moveaxis(out, -2, 0), True
        if not (x_b or k_b):
            return batched(x, k), False
        xs = [x[m] if x_b else x for m in range(axis_size)]
        ks = [k[m] if k_b else k for m in range(axis_size)]
        return jnp.stack([batched(a, b) for a, b in zip(xs, ks)]), True

    return batched


def conv_gemm_grad(
    x: jax.Array,
    kernel: jax.Array,
    strides: Sequence[int] = (1, 1),
    padding: str | Sequence[tuple[int, int]] = "SAME",
    precision: Any = None,
) -> jax.Array:
    """XLA's convolution whose kernel gradient is a GEMM over image patches.

    Forward and input gradient are ``lax.conv_general_dilated`` (what cuDNN and XLA:CPU
    run well); the kernel gradient is an ``einsum`` of the input's patches (im2col, made in
    the backward pass from the saved input) with the output gradient. Under ``jax.vmap``
    over members none of it is a grouped convolution (JAX's batching rule turns a
    convolution whose input and kernel are both member-batched into one with
    ``feature_group_count`` = members, slow on GPU and CPU): the kernel gradient becomes a
    batched GEMM over members, a shared input (the first layer: the batch replicated over
    members) is one wide convolution with the members' kernels stacked on the output
    features, and member-batched inputs take one ordinary convolution per member.

    Args:
      x: ``[B, H, W, C]`` inputs.
      kernel: ``[kh, kw, C, F]``.
      strides: the window strides ``(sh, sw)``.
      padding: ``"SAME"``, ``"VALID"`` or ``[(lo, hi), (lo, hi)]``.
      precision: passed to the convolutions and the GEMM.

    Returns:
      ``[B, Ho, Wo, F]``, equal to ``lax.conv_general_dilated`` in NHWC/HWIO (values and
      gradients, up to float rounding).

    Example:
      >>> conv_gemm_grad(jnp.ones((2, 8, 8, 1)), jnp.ones((3, 3, 1, 4)), (2, 2)).shape
      (2, 4, 4, 4)
    """
    strides = tuple(int(s) for s in strides)
    if isinstance(padding, str):
        pads = lax.padtype_to_pads(x.shape[1:3], kernel.shape[:2], strides, padding)
    else:
        pads = padding
    pads = tuple((int(lo), int(hi)) for lo, hi in pads)
    x, kernel = _match_varying(x, kernel)
    return _gemm_grad_conv(strides, pads, precision)(x, kernel)


CONV_IMPLS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "xla": conv_xla,
    "im2col": conv_im2col,
    "canonical": conv_canonical,
    "gemm_grad": conv_gemm_grad,
}
"""Convolution implementations by name (``"auto"`` resolves to one of them)."""

CONV_CHOICES = ("auto", *CONV_IMPLS)
"""What :func:`conv_general_dilated` and :class:`meshensemble.models.CNN` accept."""


def default_conv(platform: str) -> str:
    """The convolution the CNN uses on ``platform`` unless told (or measured) otherwise.

    On CPU (XLA:CPU with JAX 0.10, whose convolutions run in YNNPACK) XLA's convolution
    is faster than ``im2col``: the 8-member CNN step on one device, batch 128, ran
    0.86-0.93x the time of ``im2col`` in one ``meshensemble bench`` run and one A/B run
    (2 cores, 2026-11-26; ``im2col`` was the faster one with earlier jaxlibs).
    ``canonical`` is that convolution with its backward pass in XLA:CPU's fast layout, so
    it stays fast inside ``lax.scan`` bodies (``--chunk-steps`` > 1), where XLA's own
    backward convolutions are not rewritten. On a GPU members are vmapped, and JAX
    batches XLA's convolution over members into a grouped convolution
    (``feature_group_count`` = members); ``im2col`` makes them batched matmuls instead,
    and its compiled 8-member step stays within 1.3x state + activations (both checked
    on CPU by the tests; the auto-tuner times ``xla`` and ``gemm_grad`` against it).
    TPUs keep XLA's convolution.

    Args:
      platform: ``"cpu"``, ``"gpu"``, ``"tpu"`` ...

    Returns:
      ``"canonical"`` on CPU, ``"im2col"`` on GPU, ``"xla"`` elsewhere.

    Example:
      >>> me.conv.default_conv("cpu"), me.conv.default_conv("gpu"), me.conv.default_conv("tpu")
      ('canonical', 'im2col', 'xla')
    """
    return {"cpu": "canonical", "gpu": "im2col"}.get(platform, "xla")


def resolve_conv(impl: str) -> str:
    """``impl`` itself, or for ``"auto"`` :func:`default_conv` of JAX's default backend.

    Raises:
      ValueError: ``impl`` is not one of :data:`CONV_CHOICES`.

    Example:
      >>> me.conv.resolve_conv("auto")  # 'canonical' on a CPU-only machine
      'canonical'
    """
    if impl not in CONV_CHOICES:
        raise ValueError(f"conv={impl!r} is unknown; choose one of {', '.join(CONV_CHOICES)}")
    return default_conv(jax.default_backend()) if impl == "auto" else impl


def conv_general_dilated(impl: str) -> Callable[..., jax.Array]:
    """A drop-in ``lax.conv_general_dilated`` that computes with :data:`CONV_IMPLS`.

    Pass it as ``flax.linen.Conv(..., conv_general_dilated=conv_general_dilated("im2col"))``:
    the module keeps its parameters (names, shapes, initialisers), only the convolution
    changes. Convolutions the implementation does not cover (strides, dilations, groups,
    padding other than ``SAME``-like, layouts other than NHWC/HWIO, even kernels) go to
    ``lax.conv_general_dilated`` unchanged.

    Args:
      impl: ``"auto"`` (:func:`default_conv` of the platform, decided when the model is
        traced), ``"xla"``, ``"im2col"``, ``"canonical"`` or ``"gemm_grad"`` (which also
        takes strided convolutions and any padding).

    Returns:
      A function with ``lax.conv_general_dilated``'s signature.

    Raises:
      ValueError: an unknown ``impl``.

    Example:
      >>> conv = nn.Conv(32, (3, 3), conv_general_dilated=conv_general_dilated("im2col"))
    """
    if impl not in CONV_CHOICES:
        raise ValueError(f"conv={impl!r} is unknown; choose one of {', '.join(CONV_CHOICES)}")

    def conv(
        lhs: jax.Array,
        rhs: jax.Array,
        window_strides: Sequence[int],
        padding: Any,
        lhs_dilation: Sequence[int] | None = None,
        rhs_dilation: Sequence[int] | None = None,
        dimension_numbers: Any = None,
        feature_group_count: int = 1,
        batch_group_count: int = 1,
        precision: Any = None,
        preferred_element_type: Any = None,
    ) -> jax.Array:
        geometry = (
            window_strides,
            padding,
            lhs_dilation,
            rhs_dilation,
            dimension_numbers,
            feature_group_count,
            batch_group_count,
        )
        chosen = resolve_conv(impl)
        if chosen == "gemm_grad":
            if preferred_element_type is None and _covered(lhs, rhs, *geometry, any_stride=True):
                return conv_gemm_grad(lhs, rhs, window_strides, padding, precision)
        elif chosen != "xla" and preferred_element_type is None and _covered(lhs, rhs, *geometry):
            return CONV_IMPLS[chosen](lhs, rhs)
        return lax.conv_general_dilated(lhs, rhs, *geometry, precision, preferred_element_type)

    conv.__name__ = f"conv_general_dilated_{impl}"
    return conv


def _covered(
    lhs, rhs, strides, padding, lhs_dil, rhs_dil, dnums, groups, batch_groups, any_stride=False
) -> bool:
    """Whether a convolution is a stride-1 SAME 2-D NHWC/HWIO one with an odd kernel.

    With ``any_stride``: any 2-D NHWC/HWIO convolution without dilation or groups.
    """
    if lhs.ndim != 4 or rhs.ndim != 4 or groups != 1 or batch_groups != 1:
        return False
    ones = lambda v: v is None or all(int(d) == 1 for d in v)
    if not ((any_stride or ones(strides)) and ones(lhs_dil) and ones(rhs_dil)):
        return False
    want = lax.conv_dimension_numbers(lhs.shape, rhs.shape, _DN)
    if dnums is None or lax.conv_dimension_numbers(lhs.shape, rhs.shape, dnums) != want:
        return False
    if any_stride:
        return isinstance(padding, str) or len(padding) == 2
    kh, kw = rhs.shape[:2]
    if kh % 2 == 0 or kw % 2 == 0:
        return False
    same = [(kh // 2, kh // 2), (kw // 2, kw // 2)]
    if isinstance(padding, str):
        return padding.upper() == "SAME"
    return [tuple(int(v) for v in p) for p in padding] == same
