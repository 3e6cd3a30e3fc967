"""A small Vision Transformer (Flax Linen) whose parameters carry logical axis names.

Every parameter is made by ``nn.with_logical_partitioning(init, names)``, the MaxText /
Flax way of annotating a model for tensor and FSDP sharding: each dimension of each
parameter gets a *logical* name, and a rules table (:data:`LOGICAL_AXIS_RULES`, or one
of your own) maps logical names to mesh axes. The names:

=============  ===========================================  ==============================
logical name   the dimension                                 example parameter
=============  ===========================================  ==============================
``patch``      a flattened patch (``patch_size**2 * C``)     ``patch_embed/kernel``
``embed``      the residual stream (``hidden``)              every LayerNorm, most kernels
``position``   the token (patches, plus the class token)     ``pos_embed``
``heads``      attention heads (``num_heads``)               ``attention/query/kernel``
``kv``         one head's features (``hidden / num_heads``)  ``attention/out/kernel``
``mlp``        the MLP's hidden layer (``mlp_dim``)          ``mlp/up/kernel``
``classes``    the outputs (``num_classes``)                 ``head/kernel``
=============  ===========================================  ==============================

``None`` marks a dimension never sharded (the leading 1 of ``pos_embed`` and
``cls_token``). :func:`param_logical_axes` returns the names of any Linen model's
parameters (``PartitionSpec()`` for unannotated ones), from shapes only.

Example:
  >>> model = me.models.ViT()                    # MNIST [B, 28, 28, 1] -> [B, 10]
  >>> names = me.models.param_logical_axes(model, images[:1])
  >>> names["encoder_0"]["mlp"]["up"]["kernel"]
  P('embed', 'mlp')
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import einops
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from meshensemble.errors import UsageError

PyTree = Any
Names = tuple[str | None, ...]

LOGICAL_AXIS_RULES: tuple[tuple[str, str | None], ...] = (
    ("patch", None),
    ("embed", None),
    ("position", None),
    ("heads", "model"),
    ("kv", None),
    ("mlp", "model"),
    ("classes", None),
)
"""Megatron-style tensor parallelism for :class:`ViT`: heads and the MLP's hidden layer
split over the mesh axis ``"model"``, everything else replicated. For
``nn.logical_to_mesh_sharding(specs, mesh, LOGICAL_AXIS_RULES)`` or
``nn.logical_axis_rules``; FSDP would map ``embed`` to ``"data"`` as well."""


_KERNEL = nn.initializers.xavier_uniform()
_BIAS = nn.initializers.zeros_init()


class _Annotated(nn.Module):
    """Base of the ViT's modules: makes initialisers carry logical names when asked."""

    def axes(self, init: Callable[..., Any], names: Names) -> Callable[..., Any]:
        """``init`` boxed with logical ``names`` if ``self.logical_axes``, else ``init``."""
        return nn.with_logical_partitioning(init, names) if self.logical_axes else init

    def dense(self, n: int, names: Names, name: str) -> nn.Dense:
        """``nn.Dense(n)`` with its kernel named ``names`` and its bias ``names[1:]``."""
        kernel, bias = self.axes(_KERNEL, names), self.axes(_BIAS, names[1:])
        return nn.Dense(n, dtype=self.dtype, kernel_init=kernel, bias_init=bias, name=name)

    def norm(self, name: str) -> nn.LayerNorm:
        """``nn.LayerNorm`` with its scale and bias named ``("embed",)``."""
        scale = self.axes(nn.initializers.ones_init(), ("embed",))
        bias = self.axes(_BIAS, ("embed",))
        return nn.LayerNorm(dtype=self.dtype, scale_init=scale, bias_init=bias, name=name)


class Attention(_Annotated):
    """Multi-head self-attention with per-parameter logical names.

    Query, key and value kernels are ``[hidden, heads, kv]`` (``("embed", "heads",
    "kv")``), the query's and value's biases ``[heads, kv]``; the output kernel is
    ``[heads, kv, hidden]`` (``("heads", "kv", "embed")``). The key has no bias: the
    softmax ignores it (its gradient is zero, and an optimizer like Adam would turn that
    zero's rounding noise into steps that differ between meshes). The softmax is
    computed in float32.

    Attributes:
      num_heads: attention heads; must divide the input's features.
      dtype: computation dtype (None: the inputs' and parameters' dtype).
      logical_axes: annotate the parameters (``nn.LogicallyPartitioned`` boxes).

    Example:
      >>> x = jnp.zeros((2, 49, 64))                       # [B, N, hidden]
      >>> variables = jax.eval_shape(Attention(num_heads=4).init, key, x)  # shapes only
      >>> y = jax.eval_shape(Attention(num_heads=4).apply, variables, x)  # x, y: [B, N, hidden]
      >>> y.shape
      (2, 49, 64)
    """

    num_heads: int
    dtype: Any = None
    logical_axes: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = x.shape[-1]
        if hidden % self.num_heads:
            raise ValueError(
                f"hidden={hidden} does not split into num_heads={self.num_heads}; "
                "use a hidden size divisible by num_heads"
            )
        head_dim = hidden // self.num_heads

        def project(name: str, bias: bool = True) -> jax.Array:
            return nn.DenseGeneral(
                (self.num_heads, head_dim),
                use_bias=bias,
                dtype=self.dtype,
                kernel_init=self.axes(_KERNEL, ("embed", "heads", "kv")),
                bias_init=self.axes(_BIAS, ("heads", "kv")),
                name=name,
            )(x)

        q, k, v = project("query"), project("key", bias=False), project("value")
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(q.dtype)
        weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
        y = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        return nn.DenseGeneral(
            hidden,
            axis=(-2, -1),
            dtype=self.dtype,
            kernel_init=self.axes(_KERNEL, ("heads", "kv", "embed")),
            bias_init=self.axes(_BIAS, ("embed",)),
            name="out",
        )(y)


class MlpBlock(_Annotated):
    """The transformer's MLP: ``Dense(mlp_dim)``, GELU, dropout, ``Dense(hidden)``.

    Kernels ``("embed", "mlp")`` and ``("mlp", "embed")``.

    Attributes:
      mlp_dim: hidden width.
      dropout: dropout rate after the GELU (training only).
      dtype: computation dtype (None: the inputs' and parameters' dtype).
      logical_axes: annotate the parameters.

    Example:
      >>> x = jnp.zeros((2, 49, 64))
      >>> block = MlpBlock(128)
      >>> variables = jax.eval_shape(lambda: block.init(key, x, train=False))  # shapes only
      >>> y = jax.eval_shape(lambda v: block.apply(v, x, train=False), variables)
      >>> y.shape   # x, y: [B, N, hidden]
      (2, 49, 64)
    """

    mlp_dim: int
    dropout: float = 0.0
    dtype: Any = None
    logical_axes: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        y = nn.gelu(self.dense(self.mlp_dim, ("embed", "mlp"), "up")(x))
        y = nn.Dropout(self.dropout, deterministic=not train)(y)
        return self.dense(x.shape[-1], ("mlp", "embed"), "down")(y)


class EncoderBlock(_Annotated):
    """A pre-norm transformer layer: ``x + Attention(LN(x))``, then ``x + MLP(LN(x))``.

    Attributes:
      num_heads: attention heads.
      mlp_dim: the MLP's hidden width.
      dropout: dropout rate on both residual branches (training only).
      dtype: computation dtype (None: the inputs' and parameters' dtype).
      logical_axes: annotate the parameters.

    Example:
      >>> x = jnp.zeros((2, 49, 64))
      >>> block = EncoderBlock(4, 128)
      >>> variables = jax.eval_shape(lambda: block.init(key, x, train=False))  # shapes only
      >>> y = jax.eval_shape(lambda v: block.apply(v, x, train=False), variables)  # [B, N, hidden]
      >>> y.shape
      (2, 49, 64)
    """

    num_heads: int
    mlp_dim: int
    dropout: float = 0.0
    dtype: Any = None
    logical_axes: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        drop = nn.Dropout(self.dropout, deterministic=not train)
        attention = Attention(self.num_heads, self.dtype, self.logical_axes, name="attention")
        x = x + drop(attention(self.norm("norm_attention")(x)))
        mlp = MlpBlock(self.mlp_dim, self.dropout, self.dtype, self.logical_axes, name="mlp")
        return x + drop(mlp(self.norm("norm_mlp")(x), train))


class ViT(_Annotated):
    """A small Vision Transformer for MNIST/CIFAR-sized images.

    The image ``[B, H, W, C]`` is cut into ``patch_size x patch_size`` patches, each
    flattened and embedded by a dense layer (``[patch**2 * C, hidden]``); a learned class
    token is prepended (``pool="cls"``) and learned position embeddings added; then
    ``num_layers`` pre-norm :class:`EncoderBlock` s, a final LayerNorm, and a dense head on
    the class token (or on the mean of the patch tokens, ``pool="mean"``). The defaults
    (patch 4, hidden 64, 4 heads, 4 layers, MLP 128: about 0.14 M parameters) take
    MNIST's ``[B, 28, 28, 1]`` (49 patches) and CIFAR's ``[B, 32, 32, 3]`` (64 patches).

    Every parameter carries logical axis names (see the module's table) unless
    ``logical_axes=False``; ``model.init`` then returns ``nn.LogicallyPartitioned``
    boxes, which ``apply`` accepts boxed or unboxed (``nn.meta.unbox``).

    Train it with Adam(W) at about 1e-3 (``meshensemble train --model vit --optimizer
    adamw --learning-rate 1e-3``: 78% on the 4,000-image MNIST sample after 62 steps);
    plain SGD at the CLI's default 0.1 stays at chance.

    Attributes:
      num_classes: number of outputs.
      patch_size: side of the square patches; must divide the image's height and width.
      hidden: width of the residual stream (token features).
      num_heads: attention heads; must divide ``hidden``.
      num_layers: transformer layers.
      mlp_dim: hidden width of each layer's MLP.
      dropout: dropout rate after the embedding and on every residual branch, in
        training only (``train=True``); 0 turns it off.
      pool: ``"cls"`` (a class token) or ``"mean"`` (average of the patch tokens).
      dtype: computation dtype, e.g. ``jnp.bfloat16``; None computes in the inputs' and
        parameters' dtype (so an ensemble's ``compute_dtype`` decides). Parameters are
        float32; the logits are float32 whatever the dtype.
      logical_axes: make every parameter an ``nn.LogicallyPartitioned`` with its names.

    Example:
      >>> model = me.models.ViT()
      >>> x = me.data.normalize(images[:2])
      >>> variables = jax.eval_shape(model.init, key, x)   # shapes; model.init(key, x): arrays
      >>> logits = jax.eval_shape(lambda v: model.apply(v, x, train=False), variables)
      >>> logits.shape, logits.dtype                       # [B, 10] float32
      ((2, 10), dtype('float32'))
      >>> cifar = me.models.ViT(hidden=128, num_layers=6, pool="mean", dtype=jnp.bfloat16)
    """

    num_classes: int = 10
    patch_size: int = 4
    hidden: int = 64
    num_heads: int = 4
    num_layers: int = 4
    mlp_dim: int = 128
    dropout: float = 0.0
    pool: str = "cls"
    dtype: Any = None
    logical_axes: bool = True

    def check_input(self, input_shape: tuple[int, ...]) -> None:
        """Refuses inputs other than images ``[H, W, C]`` whose sides the patch size divides.

        Args:
          input_shape: one example's shape.

        Raises:
          UsageError: one line naming the shape, the patch size and the fix.

        Example:
          >>> me.models.ViT(patch_size=4).check_input((32, 32, 3))   # None: it fits
          >>> me.models.ViT(patch_size=5).check_input((32, 32, 3))
          Traceback (most recent call last):
          ...
          meshensemble.errors.UsageError: model 'vit': patch_size=5 does not divide the 32x32 ...
        """
        shape = tuple(int(d) for d in input_shape)
        if len(shape) != 3:
            raise UsageError(
                f"model 'vit' takes images [H, W, C]; this data's examples have shape "
                f"{shape}: use --model mlp for other inputs"
            )
        h, w, _ = shape
        p = self.patch_size
        if h % p or w % p:
            fits = [d for d in range(1, min(h, w) + 1) if h % d == 0 and w % d == 0]
            raise UsageError(
                f"model 'vit': patch_size={p} does not divide the {h}x{w} images; use a "
                f"patch size that divides both sides ({', '.join(map(str, fits))})"
            )

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        if self.pool not in ("cls", "mean"):
            raise ValueError(f"pool={self.pool!r} is unknown; use 'cls' or 'mean'")
        if x.ndim != 4:
            raise ValueError(f"ViT takes images [B, H, W, C], not shape {x.shape}; add axes")
        p = self.patch_size
        if x.shape[1] % p or x.shape[2] % p:
            raise ValueError(
                f"patch_size={p} does not divide the image size {x.shape[1]}x{x.shape[2]}; "
                "use a patch size dividing both (4 fits 28x28 and 32x32)"
            )
        x = einops.rearrange(x, "b (h p) (w q) c -> b (h w) (p q c)", p=p, q=p)
        x = self.dense(self.hidden, ("patch", "embed"), "patch_embed")(x)
        if self.pool == "cls":
            cls = self.param(
                "cls_token", self.axes(_BIAS, (None, None, "embed")), (1, 1, self.hidden)
            )
            cls = jnp.broadcast_to(cls.astype(x.dtype), (x.shape[0], 1, self.hidden))
            x = jnp.concatenate([cls, x], axis=1)
        pos_init = self.axes(nn.initializers.truncated_normal(0.02), (None, "position", "embed"))
        pos = self.param("pos_embed", pos_init, (1, x.shape[1], self.hidden))
        x = x + pos.astype(x.dtype)
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        for i in range(self.num_layers):
            x = EncoderBlock(
                self.num_heads,
                self.mlp_dim,
                self.dropout,
                self.dtype,
                self.logical_axes,
                name=f"encoder_{i}",
            )(x, train)
        x = self.norm("norm")(x)
        x = x[:, 0] if self.pool == "cls" else jnp.mean(x, axis=1)
        return self.dense(self.num_classes, ("embed", "classes"), "head")(x).astype(jnp.float32)


def param_logical_axes(model: nn.Module, sample: Any) -> PyTree:
    """The logical axis names of a Linen model's parameters, from shapes only.

    Initialises ``model`` under ``jax.eval_shape`` (nothing is computed or allocated) and
    reads each parameter's names with ``nn.get_partition_spec``.

    Args:
      model: a Linen module, e.g. :class:`ViT`; one whose ``__call__`` takes ``train``
        is initialised with ``train=False``.
      sample: a sample batch (e.g. ``images[:1]``, ``[1, H, W, C]``), or a
        ``jax.ShapeDtypeStruct``.

    Returns:
      The ``params`` tree (unboxed structure: the same keys as ``nn.meta.unbox(params)``)
      with a ``PartitionSpec`` of logical names per leaf, one name (or None) per
      dimension; ``PartitionSpec()`` for parameters without annotations. Map it to mesh
      axes with ``nn.logical_to_mesh_sharding(specs, mesh, LOGICAL_AXIS_RULES)``.

    Example:
      >>> specs = param_logical_axes(ViT(), jnp.zeros((1, 28, 28, 1)))
      >>> specs["head"]["kernel"]
      P('embed', 'classes')
    """
    kwargs = {"train": False} if "train" in _call_parameters(model) else {}
    shape = jax.ShapeDtypeStruct(jnp.shape(sample), jnp.result_type(sample))
    variables = jax.eval_shape(lambda x: model.init(jax.random.key(0), x, **kwargs), shape)
    specs = nn.get_partition_spec(variables.get("params", {}))
    return jax.tree.map(
        lambda s: s if isinstance(s, PartitionSpec) else PartitionSpec(),
        specs,
        is_leaf=lambda s: isinstance(s, PartitionSpec),
    )


def _call_parameters(model: nn.Module) -> tuple[str, ...]:
    """Names of ``model.__call__``'s parameters (empty when it has no signature)."""
    try:
        return tuple(inspect.signature(model.__call__).parameters)
    except (TypeError, ValueError):
        return ()
