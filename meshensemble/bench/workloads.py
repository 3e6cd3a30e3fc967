"""What the cases share: the models, the data, the members' initial states and their costs.

Everything a case trains starts here, on the host: member ``i`` of a model has the same
parameters in every case, so the cases differ only in how they train, never in what.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshensemble import data, models
from meshensemble.bench.config import BenchConfig, plain_model
from meshensemble.bench.flops import train_flops
from meshensemble.core.mesh import member_sharding
from meshensemble.core.state import EnsembleState
from meshensemble.models.conv import CONV_IMPLS, conv_general_dilated

CNN_TRAIN_FLOPS_PER_EXAMPLE = 27.4e6
"""Forward + backward FLOPs of :class:`meshensemble.models.CNN` per 28x28 example, by hand.

Multiply-adds of the forward pass: conv 3x3x1->32 on 28x28 (225,792), conv 3x3x32->64 on
14x14 (3,612,672), dense 3136->256 (802,816), dense 256->10 (2,560): 4,643,840. The
backward pass computes every kernel's gradient (the same again) and the input gradient
of every layer but the first (4,418,048): 13,705,728 multiply-adds, 27.41 MFLOP.
:func:`meshensemble.bench.flops.train_flops` counts exactly this from the jaxpr."""


class TinyConvNet(nn.Module):
    """One 4-feature 3x3 convolution, ReLU, 2x2 average pooling and the output layer.

    The conv model of the ``reform`` and ``scan`` cases when the main model is an MLP
    (the tiny CI configuration): those cases compare convolution implementations, and
    :class:`meshensemble.models.CNN` (32 and 64 features, a 256-wide dense layer, about
    27 MFLOP per example) is far too large for a bench that must finish in a minute. The
    zoo has no conv model this small, so the bench keeps this one. Inputs
    ``[B, 28, 28, 1]``, outputs ``[B, num_classes]``; parameters ``Conv_0``, ``Dense_0``.

    Attributes:
      impl: the convolution, ``"auto"``, ``"xla"``, ``"im2col"`` or ``"canonical"``
        (see :mod:`meshensemble.models.conv`).
      num_classes: outputs.

    Example:
      >>> model = TinyConvNet(impl="im2col")
      >>> params = jax.eval_shape(model.init, key, images[:1])   # shapes only: nothing runs
      >>> jax.eval_shape(model.apply, params, images).shape  # [B, 10]
      (32, 10)
    """

    impl: str = "auto"
    num_classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        conv = nn.Conv(4, (3, 3), conv_general_dilated=conv_general_dilated(self.impl))
        x = nn.avg_pool(nn.relu(conv(x)), window_shape=(2, 2), strides=(2, 2))
        return nn.Dense(self.num_classes)(x.reshape((x.shape[0], -1)))


def make_model(model_id: str) -> nn.Module:
    """The Linen module of a bench model id.

    Args:
      model_id: ``"cnn"`` (:class:`meshensemble.models.CNN` as the library runs it, with
        ``conv="auto"``), ``"cnn-xla"`` (the plain Flax CNN, XLA's convolution: what the
        HOWTO and a sequential loop run), ``"cnn-im2col"``, ``"cnn-canonical"`` (the CNN
        with those convolutions, see :mod:`meshensemble.models.conv`), ``"mlp"``
        (:class:`meshensemble.models.MLP`), ``"mlp32"`` (``MLP((32,))``, the tiny
        configuration's), ``"tinyconv"``, ``"tinyconv-xla"``, ``"tinyconv-im2col"``,
        ``"tinyconv-canonical"`` (:class:`TinyConvNet`).

    Returns:
      A ``flax.linen.Module``.

    Raises:
      ValueError: an unknown id.

    Example:
      >>> make_model("cnn-im2col").conv, make_model("mlp32").features
      ('im2col', (32,))
    """
    if model_id == "mlp":
        return models.MLP()
    if model_id == "mlp32":
        return models.MLP((32,))
    base, _, impl = model_id.partition("-")
    if base == "cnn" and impl in ("", *CONV_IMPLS):
        return models.CNN(conv=impl or "auto")
    if base == "tinyconv" and impl in ("", *CONV_IMPLS):
        return TinyConvNet(impl=impl or "auto")
    raise ValueError(f"bench model {model_id!r} is unknown; choose cnn[-impl], mlp, mlp32")


def load_data(cfg: BenchConfig, say: Callable[[str], None]) -> data.Dataset:
    """The bench's data: ``cfg.data_file``, else the embedded sample, else synthetic.

    Args:
      cfg: the config (``tiny`` keeps the first 1,024 training examples).
      say: where a note about a fallback goes.

    Returns:
      The :class:`meshensemble.data.Dataset`.

    Raises:
      DataError: an unreadable ``cfg.data_file``.

    Example:
      >>> ds = load_data(BenchConfig(tiny=True), print)
      >>> ds.num_train   # tiny: the first 1,024 training examples
      1024
    """
    if cfg.data_file:
        ds = data.load_npz(cfg.data_file)
    else:
        try:
            ds = data.load_sample()
        except data.DataError as err:
            say(f"embedded sample unavailable ({err.reason}); using synthetic data")
            ds = data.synthetic(num_train=2048, num_test=64, seed=cfg.seed)
    if cfg.tiny and ds.num_train > 1024:
        head = (
            ds.train_images[:1024],
            ds.train_labels[:1024],
            ds.test_images[:64],
            ds.test_labels[:64],
        )
        ds = data.Dataset(ds.name, *head, ds.source, f"{ds.note}; first 1,024 training examples")
    return ds


def member_loss(module: nn.Module) -> Callable[..., jax.Array]:
    """One member's training loss on uint8 images, as every case computes it.

    Args:
      module: a Linen model.

    Returns:
      ``loss(params, images [B, 28, 28, 1] uint8, labels [B] int) -> []``: the mean
      softmax cross-entropy of the normalised images.

    Example:
      >>> params = ctx.member_params("mlp32", 0)
      >>> member_loss(make_model("mlp32"))(params, images, labels).shape
      ()
    """

    def loss(params, images, labels):
        logits = module.apply({"params": params}, data.normalize(images))
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))

    return loss


def single_step(module: nn.Module, tx: optax.GradientTransformation) -> Callable[..., Any]:
    """One model's train step on uint8 images: the sequential baseline's step.

    Args:
      module: a Linen model.
      tx: the optimizer.

    Returns:
      ``step(params, opt_state, images [B, 28, 28, 1] uint8, labels [B]) -> (params,
      opt_state, loss [])``, not jitted.

    Example:
      >>> step = jax.jit(single_step(make_model("mlp32"), optax.sgd(0.1)))
      >>> params = ctx.member_params("mlp32", 0)
      >>> params, opt_state, loss = step(params, optax.sgd(0.1).init(params), images, labels)
    """

    loss_fn = member_loss(module)

    def step(params, opt_state, images, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, images, labels)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def cost_flops(compiled: Any) -> float | None:
    """FLOPs of one call of a compiled program, from XLA's cost analysis.

    Args:
      compiled: a ``jax.stages.Compiled``.

    Returns:
      The FLOPs, or None where the backend reports none.

    Example:
      >>> a, b = jnp.ones((2, 3)), jnp.ones((3, 4))
      >>> cost_flops(jax.jit(jnp.matmul).lower(a, b).compile())   # XLA's count: 2 * 2 * 3 * 4
      48.0
    """
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


def _nbytes(tree: Any) -> int:
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


class Context:
    """The cases' shared inputs: data, host batches, members' states, cached costs.

    Attributes:
      cfg: the config.
      dataset: the training data.
      images: ``[N, 28, 28, 1]`` uint8 training images.
      labels: ``[N]`` int32 labels.
      steps_per_epoch: full batches in the training set.
      batches: up to 32 batches of example indices ``[batch_size]`` the cases cycle over.
      tx: the optimizer, ``optax.sgd(0.1, 0.9)`` (the Flax MNIST example's and HOWTO's).
      flops: FLOPs per training example of each plain model id, counted from the jaxpr
        of one member's forward and backward pass (:mod:`meshensemble.bench.flops`).
      flops_by_primitive: the same split into ``dot_general`` and
        ``conv_general_dilated``.
      cost_analysis_flops: per plain model id, XLA's ``cost_analysis()`` FLOPs per
        example of a compiled step, or None where the backend reports none (a
        cross-check only: it misses custom calls such as cuDNN convolutions).

    Example:
      >>> ctx = Context(cfg, load_data(cfg, print))
      >>> ctx.steps_per_epoch, len(ctx.batches[0])   # batches of cfg.batch_size
      (32, 32)
    """

    def __init__(self, cfg: BenchConfig, dataset: data.Dataset):
        self.cfg = cfg
        self.dataset = dataset
        self.images = dataset.train_images
        self.labels = dataset.train_labels.astype(np.int32)
        self.steps_per_epoch = len(self.labels) // cfg.batch_size
        perm = np.random.default_rng(cfg.seed).permutation(len(self.labels))
        n = min(self.steps_per_epoch, 32)
        self.batches = [perm[i * cfg.batch_size : (i + 1) * cfg.batch_size] for i in range(n)]
        self.tx = optax.sgd(0.1, 0.9)
        self.flops: dict[str, float] = {}
        self.flops_by_primitive: dict[str, dict[str, float]] = {}
        self.cost_analysis_flops: dict[str, float | None] = {}
        self._float_images: np.ndarray | None = None
        self._shapes: dict[str, Any] = {}
        self._params: dict[tuple[str, int], Any] = {}
        self._footprints: dict[str, dict[str, int]] = {}

    def host_batch(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch ``i`` (cycling) as uint8 images ``[B, 28, 28, 1]`` and labels ``[B]``."""
        idx = self.batches[i % len(self.batches)]
        return self.images[idx], self.labels[idx]

    def howto_batch(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch ``i`` as the HOWTO feeds it: float32 images in ``[0, 1]``, labels ``[B]``.

        The HOWTO normalises the whole set to float32 once, then indexes on the host.
        """
        if self._float_images is None:
            self._float_images = self.images.astype(np.float32) / 255.0
        idx = self.batches[i % len(self.batches)]
        return self._float_images[idx], self.labels[idx]

    def member_params(self, model_id: str, i: int) -> Any:
        """Member ``i``'s parameters as numpy: LeCun-normal kernels, zero biases.

        Made on the host, so no case compiles an initialiser; every case that trains
        member ``i`` of a model starts from the same values.
        """
        key = (model_id, i)
        if key not in self._params:
            if model_id not in self._shapes:
                module = make_model(model_id)
                sample = jnp.zeros((1, *self.images.shape[1:]), jnp.float32)
                self._shapes[model_id] = jax.eval_shape(
                    lambda k: module.init(k, sample)["params"], jax.random.key(0)
                )
            rng = np.random.default_rng([self.cfg.seed, i])

            def leaf(path: Any, s: Any) -> np.ndarray:
                if str(getattr(path[-1], "key", "")) == "kernel":
                    fan_in = math.prod(s.shape[:-1])
                    return (rng.standard_normal(s.shape) / math.sqrt(fan_in)).astype(s.dtype)
                return np.zeros(s.shape, s.dtype)

            self._params[key] = jax.tree_util.tree_map_with_path(leaf, self._shapes[model_id])
        return self._params[key]

    def stacked_params(self, model_id: str, members: int, first: int = 0) -> Any:
        """Members ``first .. first + members - 1``, leaves ``[members, ...]`` (numpy)."""
        trees = [self.member_params(model_id, first + i) for i in range(members)]
        return jax.tree.map(lambda *v: np.stack(v), *trees)

    def opt_state(self, params: Any) -> Any:
        """The optimizer's initial state of ``params`` (stacked or not), as numpy zeros.

        ``sgd`` with momentum starts from zeros of the parameters' shapes.
        """
        shapes = jax.eval_shape(self.tx.init, params)
        return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)

    def ensemble_state(self, model_id: str, members: int, mesh: jax.sharding.Mesh) -> Any:
        """An :class:`meshensemble.EnsembleState` of the members, placed on ``mesh``."""
        params = self.stacked_params(model_id, members)
        rng = np.random.default_rng([self.cfg.seed, 1 << 20])
        state = EnsembleState(
            step=np.zeros((members,), np.int32),
            params=params,
            opt_state=self.opt_state(params),
            model_state={},
            rng=rng.integers(0, 2**32, (members, 2), dtype=np.uint32),  # raw legacy keys
        )
        return jax.device_put(state, member_sharding(mesh))

    def footprint(self, model_id: str) -> dict[str, int]:
        """One member's state and activation bytes, the floor of a step's memory.

        ``state``: parameters + optimizer state. ``activations``: what the backward pass
        keeps of one member's step on one batch (the residuals of ``jax.vjp`` of the
        loss: the layers' saved inputs and outputs, the batch, and any parameter the
        backward pass reads), measured with ``jax.eval_shape``, so nothing runs.
        """
        if model_id not in self._footprints:
            module = make_model(model_id)
            params = self.member_params(model_id, 0)
            x, y = self.host_batch(0)

            loss = member_loss(module)

            def residuals(p):
                return jax.tree.leaves(jax.vjp(lambda q: loss(q, x, y), p)[1])

            self._footprints[model_id] = {
                "state": _nbytes(params) + _nbytes(self.opt_state(params)),
                "activations": _nbytes(jax.eval_shape(residuals, params)),
            }
        return self._footprints[model_id]

    def flops_per_example(self, model_id: str) -> float:
        """Training FLOPs per example of ``model_id``'s useful work, counted analytically.

        The count is of :func:`~meshensemble.bench.config.plain_model` (a reformulated
        convolution does the same multiply-adds): the ``dot_general`` and
        ``conv_general_dilated`` FLOPs of ``jax.value_and_grad`` of one member's loss on
        one batch, over the batch size. Nothing is compiled or run.

        Args:
          model_id: a bench model id.

        Returns:
          FLOPs per member-example (forward and backward pass).
        """
        fid = plain_model(model_id)
        if fid not in self.flops:
            x, y = self.host_batch(0)
            counted = train_flops(member_loss(make_model(fid)), self.member_params(fid, 0), x, y)
            self.flops_by_primitive[fid] = {k: v / len(y) for k, v in counted.items()}
            self.flops[fid] = counted["total"] / len(y)
        return self.flops[fid]

    def cost_analysis_per_example(self, model_id: str) -> float | None:
        """XLA's ``cost_analysis()`` FLOPs per example of a plain step (the cross-check).

        Taken from a program a case compiled (:meth:`record_flops`), else from a plain
        jitted step compiled here.

        Args:
          model_id: a bench model id.

        Returns:
          The FLOPs per example, or None where the backend reports none.
        """
        fid = plain_model(model_id)
        if fid not in self.cost_analysis_flops:
            step = single_step(make_model(fid), self.tx)
            x, y = self.host_batch(0)
            params = self.member_params(fid, 0)
            compiled = jax.jit(step).lower(params, self.opt_state(params), x, y).compile()
            self.record_flops(fid, compiled)
        return self.cost_analysis_flops[fid]

    def record_flops(self, model_id: str, compiled: Any, examples: int | None = None) -> None:
        """Keeps XLA's cost-analysis FLOPs per example of a one-device program (cross-check).

        Args:
          model_id: the program's model; reformulated models are skipped.
          compiled: the compiled train step.
          examples: member-examples per call (default one member's batch).
        """
        fid = plain_model(model_id)
        if fid in self.cost_analysis_flops or fid != model_id:
            return
        flops = cost_flops(compiled)
        examples = examples or self.cfg.batch_size
        self.cost_analysis_flops[fid] = flops / examples if flops else None
