"""FLOPs counted from a function's jaxpr: matmuls and convolutions, whatever runs them.

XLA's ``cost_analysis()`` does not count the FLOPs of custom calls, and on a GPU the
convolutions (and often the matmuls) of a training step are cuDNN or cuBLAS custom
calls, so FLOP/s derived from it came out about 5x low there. This module counts the
arithmetic the program states instead: it walks ``jax.make_jaxpr(fn)(*args)``, nested
jaxprs included (``jit``, ``custom_jvp``/``custom_vjp`` bodies, ``shard_map``,
``cond`` branches, ``scan`` bodies times their length), and sums

* ``dot_general``: ``2 * out_elements * contracted_size`` (``2*M*N*K`` for a matmul,
  times the batch dimensions' sizes);
* ``conv_general_dilated``: ``2 * out_elements * kernel_spatial_size *
  kernel_in_features`` (the kernel's input-feature dimension is already
  ``in_channels / feature_group_count``; with ``batch_group_count`` the same formula
  holds), the nominal count: positions that read padding or dilation holes count too.

Everything else (elementwise ops, reductions, the optimizer's update) is left out: for
the bench's models those are a few percent of the work and no accelerator runs them on
its matrix units. Backward passes are just more ``dot_general`` and
``conv_general_dilated`` equations (with transposed dimension numbers) in the jaxpr of
``jax.value_and_grad``, so they are counted the same way; a gradient JAX does not need
(the input image's) is never traced, so it is never counted. The count is the same
whatever computes a convolution: an im2col matmul does the same multiply-adds. What the
jaxpr states is what is counted: a ``custom_vjp`` whose backward rule returns a
cotangent that is then dropped (``meshensemble.models.conv.conv_canonical``'s input
gradient of a first layer) is counted although XLA removes it when compiling.
``while`` loops have no static trip count: their body is counted once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import jax

COUNTED = ("dot_general", "conv_general_dilated")
"""The primitives whose FLOPs are counted."""


def eqn_flops(eqn: Any) -> float:
    """FLOPs of one jaxpr equation (0 for primitives not in :data:`COUNTED`).

    Args:
      eqn: a ``JaxprEqn``.

    Returns:
      ``2 * out_elements * contracted_size`` for ``dot_general``;
      ``2 * out_elements * kernel_spatial_size * kernel_in_features`` for
      ``conv_general_dilated``; else 0.

    Example:
      >>> eqn = jax.make_jaxpr(jnp.matmul)(jnp.ones((2, 3)), jnp.ones((3, 4))).eqns[0]
      >>> eqn_flops(eqn)
      48.0
    """
    name = eqn.primitive.name
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        out = eqn.outvars[0].aval.shape
        return 2.0 * math.prod(out) * math.prod(lhs[d] for d in lhs_contract)
    if name == "conv_general_dilated":
        rhs_spec = eqn.params["dimension_numbers"].rhs_spec  # (out feat, in feat, spatial...)
        rhs = eqn.invars[1].aval.shape
        out = eqn.outvars[0].aval.shape
        window = math.prod(rhs[d] for d in rhs_spec[2:])
        return 2.0 * math.prod(out) * window * rhs[rhs_spec[1]]
    return 0.0


def _sub_jaxprs(eqn: Any) -> Iterator[Any]:
    for value in eqn.params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if hasattr(v, "eqns"):
                yield v
            elif hasattr(getattr(v, "jaxpr", None), "eqns"):
                yield v.jaxpr


def jaxpr_flops(jaxpr: Any) -> dict[str, float]:
    """FLOPs of a jaxpr by primitive, nested jaxprs included.

    A ``scan`` body counts ``length`` times, a ``cond`` its costliest branch, a ``while``
    body once (its trip count is not static).

    Args:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.

    Returns:
      ``{"dot_general": f, "conv_general_dilated": f, "total": f}``.

    Example:
      >>> a, b = jnp.ones((2, 3)), jnp.ones((3, 4))
      >>> jaxpr_flops(jax.make_jaxpr(jnp.matmul)(a, b))["total"]
      48.0
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    out = dict.fromkeys(COUNTED, 0.0)
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in COUNTED:
            out[name] += eqn_flops(eqn)
        subs = [jaxpr_flops(s) for s in _sub_jaxprs(eqn)]
        if not subs:
            continue
        if name == "cond":
            subs = [max(subs, key=lambda s: s["total"])]
        times = float(eqn.params.get("length", 1)) if name == "scan" else 1.0
        for sub in subs:
            for key in COUNTED:
                out[key] += times * sub[key]
    out["total"] = sum(out[k] for k in COUNTED)
    return out


def count_flops(fn: Callable[..., Any], *args: Any) -> dict[str, float]:
    """FLOPs of one call of ``fn(*args)``, from its jaxpr (nothing runs).

    Args:
      fn: a JAX-traceable function.
      *args: its arguments (arrays or ``jax.ShapeDtypeStruct``).

    Returns:
      See :func:`jaxpr_flops`.

    Example:
      >>> a = jax.ShapeDtypeStruct((256, 256), jnp.float32)
      >>> count_flops(jnp.matmul, a, a)["total"] == 2 * 256**3
      True
    """
    return jaxpr_flops(jax.make_jaxpr(fn)(*args))


def train_flops(loss: Callable[..., Any], params: Any, *batch: Any) -> dict[str, float]:
    """FLOPs of one training step's forward and backward pass: ``value_and_grad(loss)``.

    Args:
      loss: ``loss(params, *batch) -> []``.
      params: the parameters (arrays or shapes).
      *batch: the rest of ``loss``'s arguments, e.g. images ``[B, ...]`` and labels
        ``[B]``.

    Returns:
      See :func:`jaxpr_flops` (for the whole batch; divide by ``B`` for one example).

    Example:
      >>> from meshensemble.bench.workloads import make_model, member_loss
      >>> params = ctx.member_params("mlp32", 0)           # MLP((32,)) on 28 x 28 images
      >>> train_flops(member_loss(make_model("mlp32")), params, images, labels)["total"] / 32
      102272.0
    """
    return count_flops(jax.value_and_grad(loss), params, *batch)
