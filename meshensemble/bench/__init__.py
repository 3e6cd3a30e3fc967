"""``meshensemble bench``: how fast ensembles train, against the Flax HOWTO and a loop.

Runs every case in one process on the same model, data and machine, and times them
round-robin (one call of each case per round, after compilation and warm-up rounds), so
that load from other jobs falls on all cases alike; each case's time per step is the
median over ``--repeats`` rounds, with its interquartile range.

The library's cases run the model as the library runs it (for the CNN: ``conv="auto"``,
im2col matmuls on CPU, see :mod:`meshensemble.models.conv`); the baselines (``howto``,
``sequential``) run the plain Flax CNN with XLA's convolution, as their users' code does.

Cases (``--cases`` takes these names or the group names in brackets):

* ``matmul`` [matmul]: a large float32 matmul on one device, the FLOP/s yardstick.
* ``howto`` [howto]: the Flax "Ensembling on multiple devices" HOWTO: ``jax.pmap``
  ``apply_model`` + ``update_model`` with one member per device, host-side batch
  indexing and ``jax_utils.replicate`` of every batch. With fewer devices than members,
  a step runs ``members / devices`` such HOWTO runs one after another.
* ``ens_pmap``, ``ens_shard_map`` [backends]: :meth:`meshensemble.Ensemble.train_step`
  on host batches with ``backend="pmap"`` / ``"shard_map"``, one step per call.
* ``chunk_default``, ``chunk_k1``, ``chunk_k8``, ``chunk_epoch`` [chunk]: the training
  loop's on-device chunk exactly as :func:`meshensemble.training.train` builds it (data on
  the devices, ``K`` steps per compiled call, a ``lax.scan`` when ``K > 1``); ``default``
  is ``train.default_chunk_steps`` for the platform.
* ``sequential`` [sequential]: the members trained one after another with a jitted
  single-model step on one device (the baseline an ensemble must beat).
* ``mpd_1`` ... ``mpd_32`` [members]: 1 to 32 members on one device (cost growth).
* ``mesh_1`` ... ``mesh_8`` [mesh]: the members on meshes of 1 to 8 devices.
* ``strategy_vmap``, ``strategy_loop`` [strategy]: the member strategies, all members on
  one device.
* ``reform_base_loop``, ``reform_im2col_vmap``, ``reform_im2col_loop``,
  ``reform_im2col_sequential`` [reform]: the CNN with XLA's convolution in the unrolled
  loop (``base``), against the CNN whose convolutions are ``im2col`` matmuls, so that
  ``vmap`` batches the members into batched matmuls (and the first layer, whose input
  all members share, into one wide matmul) instead of grouped convolutions; and the
  im2col model trained member after member, which tells a faster convolution from a
  gain of batching members.
* ``scan_base_k1``, ``scan_base_k8``, ``scan_canonical_k1``, ``scan_canonical_k8``
  [scan]: the on-device chunk of the conv model with XLA's convolution and with
  :func:`meshensemble.models.conv.conv_canonical` (the same convolution with a backward pass
  in the layout XLA:CPU's fast kernels take), at ``K = 1`` and ``K = 8``.
* ``precision_fp32``, ``precision_bf16`` [precision]: the members on one device in
  float32 and with mixed precision (``compute_dtype=bfloat16``, float32 master weights).

Cases that describe the same computation (e.g. ``mesh_8`` and ``ens_shard_map``) are
timed once and reported under each name (``same_as`` in the JSON).

Example:
  $ meshensemble bench --fake-devices 8 --data-file mnist.npz --out bench.json
  $ meshensemble bench --tiny --out /tmp/bench.json  # CI: a tiny configuration, < 60 s
  $ python -m meshensemble.bench --tiny --cases howto,backends
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import platform as platform_lib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshensemble.models.conv import CONV_IMPLS, conv_general_dilated

GROUPS: dict[str, tuple[str, ...]] = {
    "matmul": ("matmul",),
    "howto": ("howto",),
    "backends": ("ens_pmap", "ens_shard_map"),
    "chunk": ("chunk_default", "chunk_k1", "chunk_k8", "chunk_epoch"),
    "sequential": ("sequential",),
    "members": ("mpd_1", "mpd_2", "mpd_4", "mpd_8", "mpd_16", "mpd_32"),
    "mesh": ("mesh_1", "mesh_2", "mesh_4", "mesh_8"),
    "strategy": ("strategy_vmap", "strategy_loop"),
    "reform": (
        "reform_base_loop",
        "reform_im2col_vmap",
        "reform_im2col_loop",
        "reform_im2col_sequential",
    ),
    "scan": ("scan_base_k1", "scan_base_k8", "scan_canonical_k1", "scan_canonical_k8"),
    "precision": ("precision_fp32", "precision_bf16"),
}
"""Case groups of ``--cases``, in the order the cases run and print."""

TARGETS: dict[str, tuple[str, float]] = {
    "one_device_over_sequential": ("<=", 0.75),
    "shard_map_over_pmap": ("<=", 1.05),
    "on_device_loop_over_howto": ("<=", 0.9),
    "members_per_device_scaling_max": ("<=", 1.0),
    "memory_over_state_activations": ("<=", 1.3),
}
"""The issue's targets: ratio name -> (comparison, bound)."""

CNN_TRAIN_FLOPS_PER_EXAMPLE = 27.4e6
"""Forward + backward FLOPs of :class:`meshensemble.models.CNN` per 28x28 example."""


def _conv_net_class():
    import flax.linen as nn

    class ConvNet(nn.Module):
        """The Flax MNIST CNN with a choice of convolution (see :data:`CONV_IMPLS`).

        The same layers, parameter names and initialisers as
        :class:`meshensemble.models.CNN`; ``impl`` picks the convolution through
        ``nn.Conv``'s ``conv_general_dilated`` hook.

        Attributes:
          features: the convolutions' widths.
          dense: the hidden dense layer's width (0 for none).
          impl: ``"auto"``, ``"xla"``, ``"im2col"`` or ``"canonical"``.
          num_classes: outputs.
        """

        features: tuple[int, ...] = (32, 64)
        dense: int = 256
        impl: str = "auto"
        num_classes: int = 10

        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            conv = conv_general_dilated(self.impl)
            for width in self.features:
                x = nn.Conv(width, (3, 3), conv_general_dilated=conv)(x)
                x = nn.relu(x)
                x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
            x = x.reshape((x.shape[0], -1))
            if self.dense:
                x = nn.relu(nn.Dense(self.dense)(x))
            return nn.Dense(self.num_classes)(x)

    return ConvNet


@functools.cache
def _conv_net() -> type:
    return _conv_net_class()


def make_model(model_id: str) -> Any:
    """The Linen module of a bench model id.

    Args:
      model_id: ``"cnn"`` (:class:`meshensemble.models.CNN` as the library runs it, with
        ``conv="auto"``), ``"cnn-xla"`` (the plain Flax CNN, XLA's convolution: what the
        HOWTO and a sequential loop run), ``"cnn-im2col"``, ``"cnn-canonical"`` (the CNN
        with those convolutions, see :mod:`meshensemble.models.conv`), ``"mlp"``
        (:class:`meshensemble.models.MLP`), ``"mlp32"`` (``MLP((32,))``, the tiny
        configuration's), ``"tinyconv"``, ``"tinyconv-xla"``, ``"tinyconv-im2col"``,
        ``"tinyconv-canonical"`` (one 4-feature convolution, pooling and the output
        layer: the conv model of the ``reform`` and ``scan`` cases when the main model
        is an MLP).

    Returns:
      A ``flax.linen.Module``.

    Raises:
      ValueError: an unknown id.

    Example:
      >>> make_model("cnn-im2col")
    """
    from meshensemble import models

    if model_id == "mlp":
        return models.MLP()
    if model_id == "mlp32":
        return models.MLP((32,))
    base, _, impl = model_id.partition("-")
    if base == "cnn" and impl in ("", *CONV_IMPLS):
        return models.CNN(conv=impl or "auto")
    if base == "tinyconv" and impl in ("", *CONV_IMPLS):
        return _conv_net()(features=(4,), dense=0, impl=impl or "auto")
    raise ValueError(f"bench model {model_id!r} is unknown")


def _plain(model_id: str) -> str:
    """The model as its users' own code runs it (a conv model with XLA's convolution).

    Also the model whose FLOPs a reformulated model performs: its useful work.
    """
    base = model_id.split("-")[0]
    return f"{base}-xla" if base in ("cnn", "tinyconv") else base


# ---------------------------------------------------------------------------------------
# Configuration


@dataclasses.dataclass
class BenchConfig:
    """What ``meshensemble bench`` runs; the CLI's flags map onto these fields.

    Attributes:
      members: ensemble size of the main cases.
      conv_members: ensemble size of the ``reform`` and ``scan`` cases (None: ``members``).
      batch_size: examples per member per step.
      repeats: timed rounds (each case's time is the median over them).
      warmup: untimed rounds after compilation (each case also makes one untimed first
        call, compiling, unless it runs an ahead-of-time compiled program).
      cases: case and group names to run; empty for all.
      tiny: the CI configuration (see :func:`resolve`).
      data_file: a Keras-layout MNIST ``.npz``; else the embedded sample, else synthetic.
      model: ``"cnn"`` or ``"mlp"`` (the tiny configuration's default: ``MLP((32,))``).
      out: the JSON file to write.
      plot: a PNG of time per step against members per device, or None.
      epoch_cap: the most steps ``chunk_epoch`` runs per call (None: a whole epoch).
      case_budget: stop timing a case once its timed calls add up to this many seconds
        (it keeps at least one sample); None for no limit.
      matmul_size: side of the square matmul of the ``matmul`` case.
      members_per_device: the ``mpd_*`` sizes.
      seed: seeds initialisation and batch order.
    """

    members: int = 8
    conv_members: int | None = None
    batch_size: int = 128
    repeats: int = 5
    warmup: int = 1
    cases: tuple[str, ...] = ()
    tiny: bool = False
    data_file: str | None = None
    model: str = "cnn"
    out: str = "bench.json"
    plot: str | None = None
    epoch_cap: int | None = None
    case_budget: float | None = None
    matmul_size: int = 2048
    members_per_device: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    seed: int = 0


def resolve(args: argparse.Namespace) -> BenchConfig:
    """Builds the :class:`BenchConfig` of parsed ``bench`` flags, checking every value.

    ``--tiny`` changes the defaults (flags still override them): model ``MLP((32,))``,
    4 members (2 in the conv cases), batch 32, 2 repeats, members per device up to 4,
    at most 1,024 training examples, chunks capped at 8 steps, a 256 x 256 matmul.

    Args:
      args: from the ``bench`` subcommand's parser.

    Returns:
      The config.

    Raises:
      UsageError: a value out of range or an unknown case name.

    Example:
      >>> cfg = resolve(build_parser().parse_args(["bench", "--tiny"]))
    """
    from meshensemble.cli.app import UsageError

    tiny = bool(args.tiny)
    cfg = BenchConfig(tiny=tiny)
    if tiny:
        cfg = dataclasses.replace(
            cfg,
            model="mlp32",
            members=4,
            conv_members=2,
            batch_size=32,
            repeats=2,
            epoch_cap=8,
            matmul_size=256,
            members_per_device=(1, 2, 4),
        )
    for name in ("members", "batch_size", "repeats", "epoch_cap", "matmul_size"):
        value = getattr(args, name)
        if value is not None:
            if value < 1:
                raise UsageError(f"--{name.replace('_', '-')} {value} must be a positive integer")
            setattr(cfg, name, value)
    if args.warmup is not None:
        if args.warmup < 0:
            raise UsageError(f"--warmup {args.warmup} must be 0 or more")
        cfg.warmup = args.warmup
    if args.case_budget is not None:
        if not args.case_budget > 0:
            raise UsageError(f"--case-budget {args.case_budget} must be a positive number")
        cfg.case_budget = args.case_budget
    if args.model is not None:
        cfg.model = args.model
    cfg.data_file, cfg.out, cfg.plot, cfg.seed = args.data_file, args.out, args.plot, args.seed
    if args.cases:
        names = tuple(c.strip() for c in args.cases.split(",") if c.strip())
        known = set(GROUPS) | {c for cs in GROUPS.values() for c in cs}
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise UsageError(
                f"--cases {args.cases}: unknown {', '.join(unknown) or 'empty list'}; choose "
                f"from the groups {', '.join(GROUPS)} or their cases "
                f"{', '.join(c for cs in GROUPS.values() for c in cs)}"
            )
        cfg.cases = names
    return cfg


# ---------------------------------------------------------------------------------------
# Cases


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a case computes; cases with equal specs are timed once.

    Attributes:
      kind: ``"matmul"``, ``"howto"``, ``"ensemble"``, ``"chunk"`` or ``"sequential"``.
      model: a :func:`make_model` id (the matmul's size for ``"matmul"``).
      members: members trained per step.
      devices: devices used (for ``"howto"``: per HOWTO run).
      ensemble: the mesh's ``ensemble`` axis.
      data: the mesh's ``data`` axis.
      backend: ``"shard_map"`` or ``"pmap"``.
      strategy: the resolved member strategy, ``"vmap"`` or ``"loop"``.
      k: steps per call.
      precision: ``"fp32"`` or ``"bf16"`` (mixed precision, ``compute_dtype=bfloat16``).
    """

    kind: str
    model: str
    members: int = 1
    devices: int = 1
    ensemble: int = 1
    data: int = 1
    backend: str = "shard_map"
    strategy: str = "loop"
    k: int = 1
    precision: str = "fp32"


class _Context:
    """Shared inputs of the cases: data, host batches, the optimizer, cached FLOPs."""

    def __init__(self, cfg: BenchConfig, dataset: Any):
        import optax

        self.cfg = cfg
        self.dataset = dataset
        self.images = dataset.train_images
        self.labels = dataset.train_labels.astype(np.int32)
        self.steps_per_epoch = len(self.labels) // cfg.batch_size
        rng = np.random.default_rng(cfg.seed)
        perm = rng.permutation(len(self.labels))
        n = min(self.steps_per_epoch, 32)
        self.batches = [perm[i * cfg.batch_size : (i + 1) * cfg.batch_size] for i in range(n)]
        self._float_images: np.ndarray | None = None
        self.tx = optax.sgd(0.1, 0.9)  # the Flax MNIST example's and HOWTO's optimizer
        self.flops: dict[str, float] = {}
        self.flops_source: dict[str, str] = {}
        self._shapes: dict[str, Any] = {}
        self._params: dict[tuple[str, int], Any] = {}
        self._footprints: dict[str, dict[str, int]] = {}

    def host_batch(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        idx = self.batches[i % len(self.batches)]
        return self.images[idx], self.labels[idx]

    def howto_batch(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        # The HOWTO normalises the whole set to float32 once, then indexes on the host.
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
        """Members ``first .. first + members - 1`` stacked on a leading axis (numpy)."""
        trees = [self.member_params(model_id, first + i) for i in range(members)]
        return jax.tree.map(lambda *v: np.stack(v), *trees)

    def opt_state(self, params: Any) -> Any:
        """The optimizer's initial state of ``params`` (stacked or not), as numpy zeros.

        ``sgd`` with momentum starts from zeros of the parameters' shapes, stacked or not.
        """
        shapes = jax.eval_shape(self.tx.init, params)
        return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)

    def ensemble_state(self, model_id: str, members: int, mesh: Any) -> Any:
        """An :class:`meshensemble.EnsembleState` of the members, placed on ``mesh``."""
        from meshensemble.core.mesh import member_sharding
        from meshensemble.core.state import EnsembleState

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
            import optax

            module = make_model(model_id)
            params = self.member_params(model_id, 0)
            x, y = self.host_batch(0)

            def residuals(p):
                def loss(p):
                    logits = module.apply({"params": p}, _normalize(x))
                    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))

                return jax.tree.leaves(jax.vjp(loss, p)[1])

            nbytes = lambda tree: sum(
                math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)
            )
            self._footprints[model_id] = {
                "state": nbytes(params) + nbytes(self.opt_state(params)),
                "activations": nbytes(jax.eval_shape(residuals, params)),
            }
        return self._footprints[model_id]

    def flops_per_example(self, model_id: str) -> float:
        """Training FLOPs per example of ``model_id`` (cost analysis of a jitted step)."""
        fid = _plain(model_id)
        if fid not in self.flops:
            step = _single_step(make_model(fid), self.tx)
            x, y = self.host_batch(0)
            params = self.member_params(fid, 0)
            compiled = jax.jit(step).lower(params, self.opt_state(params), x, y).compile()
            self.record_flops(fid, compiled)
        return self.flops[fid]

    def record_flops(self, model_id: str, compiled: Any, examples: int | None = None) -> None:
        """Keeps the FLOPs per example of a compiled one-device program of ``model_id``.

        Args:
          model_id: the program's model; reformulated models are skipped (their FLOPs
            are counted as their base model's).
          compiled: the compiled train step.
          examples: member-examples per call (default one member's batch).
        """
        fid = _plain(model_id)
        if fid in self.flops or fid != model_id:
            return
        flops = _cost_flops(compiled)
        examples = examples or self.cfg.batch_size
        if flops:
            self.flops[fid], self.flops_source[fid] = flops / examples, "cost_analysis"
        elif fid == "cnn-xla":
            self.flops[fid], self.flops_source[fid] = CNN_TRAIN_FLOPS_PER_EXAMPLE, "analytic"
        else:
            self.flops[fid], self.flops_source[fid] = float("nan"), "unavailable"


def _normalize(x: Any) -> jax.Array:
    from meshensemble.data import normalize

    return normalize(x)


def _cost_flops(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


def _memory(compiled: Any) -> int | None:
    """Peak bytes of a compiled program per device: arguments, outputs and temporaries."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001
        return None
    if m is None:
        return None
    total = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )
    return int(total)


def _single_step(module: Any, tx: Any) -> Callable[..., Any]:
    """One model's train step on uint8 images: the sequential baseline's step."""
    import optax

    def step(params, opt_state, images, labels):
        x = _normalize(images)

        def loss_fn(p):
            logits = module.apply({"params": p}, x)
            return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


class _Runner:
    """One timed computation; ``run`` makes one call and waits for it."""

    needs_first_call = True

    def __init__(self, ctx: _Context, spec: Spec):
        self.ctx, self.spec = ctx, spec
        self.samples: list[float] = []
        self.compile_s: float | None = None
        self.first_call_s: float | None = None
        self.peak_bytes: int | None = None
        self.memory_source = "unavailable"
        self.program_bytes: int | None = None
        self.calls = 0

    def prepare(self) -> None:
        t = time.perf_counter()
        self.build()
        if self.compile_s is None:
            self.compile_s = time.perf_counter() - t
        if self.needs_first_call:
            t = time.perf_counter()
            self.run()
            self.first_call_s = time.perf_counter() - t
        stats = _device_memory(self.devices())
        if stats is not None:
            self.peak_bytes, self.memory_source = stats, "memory_stats"

    def set_compiled(self, compiled: Any, seconds: float) -> None:
        self.compile_s = seconds
        peak = _memory(compiled)
        self.program_bytes = peak
        if peak is not None:
            self.peak_bytes, self.memory_source = peak, "memory_analysis"

    def devices(self) -> list[jax.Device]:
        return jax.devices()[: self.spec.devices]

    def build(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        raise NotImplementedError


def _device_memory(devices: Sequence[jax.Device]) -> int | None:
    """Largest ``peak_bytes_in_use`` over ``devices`` (None where not reported, e.g. CPU)."""
    peaks = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


class _Matmul(_Runner):
    needs_first_call = False

    def build(self) -> None:
        n = int(self.spec.model)
        dev = jax.devices()[0]
        k1, k2 = jax.random.split(jax.random.key(1))
        self.a = jax.device_put(jax.random.normal(k1, (n, n), jnp.float32), dev)
        self.b = jax.device_put(jax.random.normal(k2, (n, n), jnp.float32), dev)
        t = time.perf_counter()
        self.fn = jax.jit(jnp.matmul).lower(self.a, self.b).compile()
        self.set_compiled(self.fn, time.perf_counter() - t)
        self.flops_per_call = 2.0 * n**3

    def run(self) -> None:
        self.fn(self.a, self.b).block_until_ready()


class _Howto(_Runner):
    """The Flax HOWTO's training step, ``members / devices`` HOWTO runs per step."""

    def build(self) -> None:
        import optax
        from flax import jax_utils
        from flax.training import train_state

        self.jax_utils = jax_utils
        module = make_model(self.spec.model)
        devs = self.devices()
        n = len(devs)
        self.runs = self.spec.members // n
        tx = self.ctx.tx
        line = jax.sharding.Mesh(np.asarray(devs), ("howto",))
        self._line = jax.sharding.NamedSharding(line, jax.sharding.PartitionSpec("howto"))

        def apply_model(state, images, labels):
            def loss_fn(params):
                logits = state.apply_fn({"params": params}, images)
                one_hot = jax.nn.one_hot(labels, 10)
                loss = jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot))
                return loss, logits

            grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
            (loss, logits), grads = grad_fn(state.params)
            probs = lax.pmean(jax.nn.softmax(logits), axis_name="ensemble")
            accuracy = jnp.mean(jnp.argmax(probs, -1) == labels)
            return grads, loss, accuracy

        # The HOWTO's TrainState of each run, made on the host (the bench never times
        # initialisation): member i of run r is the bench's member r * n + i.
        self.states = []
        for r in range(self.runs):
            params = self.ctx.stacked_params(self.spec.model, n, first=r * n)
            state = train_state.TrainState(
                step=np.zeros((n,), np.int32),
                apply_fn=module.apply,
                params=params,
                tx=tx,
                opt_state=self.ctx.opt_state(params),
            )
            self.states.append(jax.device_put(state, self._line))
        self.apply_model = jax.pmap(apply_model, axis_name="ensemble", devices=devs)
        self.update_model = jax.pmap(lambda s, g: s.apply_gradients(grads=g), devices=devs)
        self.step_index = 0
        self.losses: list[Any] = []
        x, y = self._replicated(0)
        t = time.perf_counter()
        compiled = self.apply_model.lower(self.states[0], x, y).compile()
        self.set_compiled(compiled, time.perf_counter() - t)

    def _replicated(self, i: int) -> tuple[Any, Any]:
        x, y = self.ctx.howto_batch(i)
        devs = self.devices()
        return self.jax_utils.replicate(x, devs), self.jax_utils.replicate(y, devs)

    def run(self) -> None:
        i, self.step_index = self.step_index, self.step_index + 1
        for r in range(self.runs):
            batch_images, batch_labels = self._replicated(i)
            grads, loss, _ = self.apply_model(self.states[r], batch_images, batch_labels)
            self.states[r] = self.update_model(self.states[r], grads)
            self.losses = [self.jax_utils.unreplicate(loss)]
        jax.block_until_ready((self.states, self.losses))


def _mesh(spec: Spec) -> Any:
    from meshensemble.core.mesh import make_mesh

    return make_mesh(spec.ensemble, spec.data, devices=jax.devices()[: spec.devices])


def _ensemble(ctx: _Context, spec: Spec) -> Any:
    from meshensemble.core.ensemble import Ensemble
    from meshensemble.data import normalize

    return Ensemble(
        make_model(spec.model),
        ctx.tx,
        spec.members,
        _mesh(spec),
        backend=spec.backend,
        member_strategy=spec.strategy,
        input_transform=normalize,
        compute_dtype=jnp.bfloat16 if spec.precision == "bf16" else None,
    )


class _EnsembleStep(_Runner):
    """``Ensemble.train_step`` on host batches, one step per call."""

    def build(self) -> None:
        from meshensemble.core.backends import put
        from meshensemble.core.mesh import BATCH

        self.ens = _ensemble(self.ctx, self.spec)
        x, y = self.ctx.host_batch(0)
        self.state = self.ctx.ensemble_state(self.spec.model, self.spec.members, self.ens.mesh)
        self.step_index = 0
        if self.spec.backend == "shard_map":  # compile ahead of time for the memory analysis
            jitted = self.ens.train_step_fn(False).jitted
            mesh = self.ens.mesh
            t = time.perf_counter()
            compiled = jitted.lower(self.state, put(x, mesh, BATCH), put(y, mesh, BATCH)).compile()
            self.set_compiled(compiled, time.perf_counter() - t)
            if self.spec.devices == 1:
                examples = self.spec.members * self.ctx.cfg.batch_size
                self.ctx.record_flops(self.spec.model, compiled, examples)

    def run(self) -> None:
        x, y = self.ctx.host_batch(self.step_index)
        self.step_index += 1
        self.state, metrics = self.ens.train_step(self.state, x, y)
        jax.block_until_ready((self.state, metrics))


class _Chunk(_Runner):
    """The training loop's on-device chunk of ``K`` steps, built as ``train.py`` builds it."""

    needs_first_call = False

    def build(self) -> None:
        from meshensemble.core.mesh import replicated_sharding
        from meshensemble.training import loop as train

        ens = _ensemble(self.ctx, self.spec)
        cfg = train.TrainConfig(
            members=self.spec.members, batch_size=self.ctx.cfg.batch_size, shuffle="shared"
        )
        self.state = self.ctx.ensemble_state(self.spec.model, self.spec.members, ens.mesh)
        feeder = train._Feeder(
            ens,
            self.ctx.dataset,
            cfg,
            jax.random.key(self.ctx.cfg.seed + 1),
            self.spec.k,
            self.ctx.steps_per_epoch,
        )
        call = feeder._make(self.spec.k)
        first = jax.device_put(jnp.int32(0), replicated_sharding(ens.mesh))
        self.args = (feeder.images, feeder.labels, feeder.order(1), first)
        t = time.perf_counter()
        self.fn = call.jitted.lower(self.state, *self.args).compile()
        self.set_compiled(self.fn, time.perf_counter() - t)

    def run(self) -> None:
        self.state, metrics = self.fn(self.state, *self.args)
        jax.block_until_ready((self.state, metrics))


class _Sequential(_Runner):
    """The members one after another with a jitted single-model step on one device."""

    def build(self) -> None:
        module = make_model(self.spec.model)
        tx = self.ctx.tx
        self.device = jax.devices()[0]
        x, y = self.ctx.host_batch(0)
        self.states = []
        for i in range(self.spec.members):
            params = self.ctx.member_params(self.spec.model, i)
            state = (params, self.ctx.opt_state(params))
            self.states.append(jax.device_put(state, self.device))
        self.step = jax.jit(_single_step(module, tx), donate_argnums=(0, 1))
        xd, yd = jax.device_put((x, y), self.device)
        t = time.perf_counter()
        compiled = self.step.lower(*self.states[0], xd, yd).compile()
        self.set_compiled(compiled, time.perf_counter() - t)
        self.ctx.record_flops(self.spec.model, compiled)
        self.step_index = 0

    def run(self) -> None:
        x, y = jax.device_put(self.ctx.host_batch(self.step_index), self.device)
        self.step_index += 1
        losses = []
        for j, (params, opt_state) in enumerate(self.states):
            params, opt_state, loss = self.step(params, opt_state, x, y)
            self.states[j] = (params, opt_state)
            losses.append(loss)
        jax.block_until_ready((self.states, losses))


_RUNNERS: dict[str, type[_Runner]] = {
    "matmul": _Matmul,
    "howto": _Howto,
    "ensemble": _EnsembleStep,
    "chunk": _Chunk,
    "sequential": _Sequential,
}


@dataclasses.dataclass
class Case:
    """A named case: its spec and a one-line description."""

    name: str
    group: str
    spec: Spec
    description: str


def plan(cfg: BenchConfig, num_devices: int, platform: str, steps_per_epoch: int) -> list[Case]:
    """The cases a config runs, in order, with their specs.

    Args:
      cfg: the bench config.
      num_devices: devices available.
      platform: ``"cpu"``, ``"gpu"`` ...
      steps_per_epoch: full batches in the training set.

    Returns:
      The selected cases (cases that need more devices than exist are left out).

    Example:
      >>> [c.name for c in plan(BenchConfig(cases=("mesh",)), 8, "cpu", 468)]
      ['mesh_1', 'mesh_2', 'mesh_4', 'mesh_8']
    """
    from meshensemble.core.ensemble import default_strategy
    from meshensemble.models.conv import default_conv
    from meshensemble.training import default_chunk_steps, default_mesh_shape

    m, model = cfg.members, cfg.model
    auto = default_strategy(platform)
    conv = "cnn" if model == "cnn" else "tinyconv"
    if model == "cnn":  # as the library runs it: the platform's default convolution
        model = f"cnn-{default_conv(platform)}"
    whole = default_mesh_shape(m, num_devices)
    e, d = whole["ensemble"], whole["data"]
    k_epoch = min(steps_per_epoch, cfg.epoch_cap or steps_per_epoch)
    k_default = min(default_chunk_steps(platform, steps_per_epoch), k_epoch)
    k8 = min(8, steps_per_epoch)
    on_all = dict(members=m, devices=num_devices, ensemble=e, data=d, strategy=auto)
    on_one = dict(members=m, devices=1, ensemble=1, data=1)
    # The HOWTO's layout, which the pmap backend also needs: one member per device.
    on_line = dict(members=m, devices=e, ensemble=e, data=1, strategy=auto)

    cases = [
        Case("matmul", "matmul", Spec("matmul", str(cfg.matmul_size)), "float32 matmul"),
        Case(
            "howto",
            "howto",
            Spec("howto", _plain(model), m, e),
            f"Flax HOWTO pmap, {e} member(s)/run x {m // e} run(s)",
        ),
        Case(
            "ens_pmap",
            "backends",
            Spec("ensemble", model, backend="pmap", **on_line),
            "Ensemble(backend=pmap).train_step",
        ),
        Case(
            "ens_shard_map",
            "backends",
            Spec("ensemble", model, **on_line),
            "Ensemble(backend=shard_map).train_step",
        ),
    ]
    for name, k, what in (
        ("chunk_default", k_default, f"train.py chunk, default K={k_default}"),
        ("chunk_k1", 1, "train.py chunk, K=1"),
        ("chunk_k8", k8, f"train.py chunk, K={k8} (lax.scan)"),
        ("chunk_epoch", k_epoch, f"train.py chunk, K={k_epoch} (epoch {steps_per_epoch})"),
    ):
        cases.append(Case(name, "chunk", Spec("chunk", model, k=k, **on_all), what))
    cases.append(
        Case(
            "sequential",
            "sequential",
            Spec("sequential", _plain(model), m),
            f"{m} members one after another, jitted step",
        )
    )
    for n in cfg.members_per_device:
        cases.append(
            Case(
                f"mpd_{n}",
                "members",
                Spec("ensemble", model, n, strategy=auto),
                f"{n} member(s) on 1 device ({auto})",
            )
        )
    for n in (1, 2, 4, 8):
        if n <= num_devices:
            en = math.gcd(m, n)
            spec = Spec("ensemble", model, m, n, en, n // en, strategy=auto)
            cases.append(Case(f"mesh_{n}", "mesh", spec, f"{m} members on {n} device(s)"))
    for strategy in ("vmap", "loop"):
        cases.append(
            Case(
                f"strategy_{strategy}",
                "strategy",
                Spec("ensemble", model, strategy=strategy, **on_one),
                f"{m} members on 1 device, {strategy}",
            )
        )
    mc = min(cfg.conv_members or m, m)
    ec = math.gcd(mc, num_devices)
    conv_one = dict(members=mc, devices=1, ensemble=1, data=1)
    conv_all = dict(members=mc, devices=num_devices, ensemble=ec, data=num_devices // ec)
    for name, model_id, strategy in (
        ("reform_base_loop", f"{conv}-xla", "loop"),
        ("reform_im2col_vmap", f"{conv}-im2col", "vmap"),
        ("reform_im2col_loop", f"{conv}-im2col", "loop"),
    ):
        spec = Spec("ensemble", model_id, strategy=strategy, **conv_one)
        cases.append(Case(name, "reform", spec, f"{model_id}, {mc} on 1 device, {strategy}"))
    cases.append(
        Case(
            "reform_im2col_sequential",
            "reform",
            Spec("sequential", f"{conv}-im2col", mc),
            f"{conv}-im2col, {mc} one after another, jitted step",
        )
    )
    for name, model_id, k in (
        ("scan_base_k1", f"{conv}-xla", 1),
        ("scan_base_k8", f"{conv}-xla", k8),
        ("scan_canonical_k1", f"{conv}-canonical", 1),
        ("scan_canonical_k8", f"{conv}-canonical", k8),
    ):
        spec = Spec("chunk", model_id, k=k, strategy=auto, **conv_all)
        cases.append(Case(name, "scan", spec, f"{model_id} chunk, K={k}"))

    for precision in ("fp32", "bf16"):
        spec = Spec("ensemble", model, precision=precision, **on_one, strategy=auto)
        what = f"{m} members on 1 device, {precision}"
        cases.append(Case(f"precision_{precision}", "precision", spec, what))

    if cfg.cases:
        chosen = {c for n in cfg.cases for c in GROUPS.get(n, (n,))}
        cases = [c for c in cases if c.name in chosen]
    return cases


# ---------------------------------------------------------------------------------------
# Running


def _load_data(cfg: BenchConfig, say: Callable[[str], None]) -> Any:
    from meshensemble import data

    if cfg.data_file:
        ds = data.load_npz(cfg.data_file)
    else:
        try:
            ds = data.load_sample()
        except data.DataError as err:
            say(f"embedded sample unavailable ({err.reason}); using synthetic data")
            ds = data.synthetic(num_train=2048, num_test=64, seed=cfg.seed)
    if cfg.tiny and ds.num_train > 1024:
        ds = data.Dataset(
            ds.name,
            ds.train_images[:1024],
            ds.train_labels[:1024],
            ds.test_images[:64],
            ds.test_labels[:64],
            ds.source,
            f"{ds.note}; first 1,024 training examples",
        )
    return ds


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _stats(samples: Sequence[float]) -> dict[str, Any]:
    a = np.asarray(samples, np.float64)
    q1, med, q3 = (float(v) for v in np.percentile(a, [25, 50, 75]))
    return {"median": med, "q1": q1, "q3": q3, "iqr": q3 - q1, "n": len(a), "samples": a.tolist()}


def run_bench(cfg: BenchConfig, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Runs the benchmark and returns the results (what ``--out`` holds).

    Args:
      cfg: what to run.
      say: where progress lines go (default: stderr).

    Returns:
      A dict with ``meta`` (date, versions, devices, config), ``cases`` (per case: time
      per step, member-examples per second, FLOP/s, peak memory, ...), ``ratios`` and
      ``targets``.

    Raises:
      ValueError: the batch is larger than the training set, or the members do not fit
        the devices.

    Example:
      >>> results = run_bench(BenchConfig(tiny=True, model="mlp32", batch_size=32))
      >>> results["ratios"]["shard_map_over_pmap"]
    """
    say = say or (lambda s: print(s, file=sys.stderr, flush=True))
    t_start = time.perf_counter()
    load_start = _loadavg()
    dataset = _load_data(cfg, say)
    if cfg.batch_size > dataset.num_train:
        raise ValueError(
            f"--batch-size {cfg.batch_size} is larger than the {dataset.num_train} training "
            "examples"
        )
    ctx = _Context(cfg, dataset)
    devices = jax.devices()
    platform = devices[0].platform
    cases = plan(cfg, len(devices), platform, ctx.steps_per_epoch)
    runners: dict[Spec, _Runner] = {}
    for case in cases:
        if case.spec not in runners:
            runners[case.spec] = _RUNNERS[case.spec.kind](ctx, case.spec)
    say(
        f"bench: {len(cases)} cases ({len(runners)} distinct) on {len(devices)} {platform} "
        f"device(s); model {cfg.model}, {cfg.members} members, batch {cfg.batch_size}; "
        f"data: {dataset.note}"
    )
    owner = {}
    for case in cases:
        owner.setdefault(case.spec, case.name)
    for spec, runner in runners.items():  # compile (and first calls); nothing is timed
        say(f"  prepared {owner[spec]:<20s} in {_timed(runner.prepare):6.1f}s")
    # FLOPs per example come from the one-device programs' cost analysis; compile a plain
    # step only for a model that has none.
    for model_id in sorted({_plain(s.model) for s in runners if s.kind != "matmul"}):
        ctx.flops_per_example(model_id)
    say(f"  compiled everything at {time.perf_counter() - t_start:6.1f}s")
    for _ in range(cfg.warmup):
        for runner in runners.values():
            runner.run()
    for rep in range(cfg.repeats):
        for runner in runners.values():
            spent = sum(runner.samples) * runner.spec.k
            if runner.samples and cfg.case_budget is not None and spent >= cfg.case_budget:
                continue
            t = time.perf_counter()
            runner.run()
            runner.samples.append((time.perf_counter() - t) / runner.spec.k)
        say(f"  round {rep + 1}/{cfg.repeats} done at {time.perf_counter() - t_start:6.1f}s")

    results = _results(cfg, ctx, cases, runners, owner, dataset)
    results["meta"]["wall_s"] = time.perf_counter() - t_start
    results["meta"]["loadavg_start"], results["meta"]["loadavg_end"] = load_start, _loadavg()
    return results


def _results(cfg, ctx, cases, runners, owner, dataset) -> dict[str, Any]:
    matmul = next((r for s, r in runners.items() if s.kind == "matmul"), None)
    matmul_flops = None
    if matmul is not None and matmul.samples:
        matmul_flops = matmul.flops_per_call / float(np.median(matmul.samples))
    out_cases: dict[str, Any] = {}
    for case in cases:
        r, spec = runners[case.spec], case.spec
        entry: dict[str, Any] = {
            "group": case.group,
            "description": case.description,
            "same_as": None if owner[spec] == case.name else owner[spec],
            **dataclasses.asdict(spec),
            "members_per_device": spec.members // max(spec.ensemble, 1),
            "time_per_step_s": _stats(r.samples),
            "compile_s": r.compile_s,
            "first_call_s": r.first_call_s,
            "peak_memory_bytes": r.peak_bytes,
            "memory_source": r.memory_source,
        }
        t = entry["time_per_step_s"]["median"]
        if spec.kind == "matmul":
            entry["members_per_device"] = None
            entry["flops_per_s"] = matmul_flops
            entry["member_examples_per_s"] = None
        else:
            if spec.kind == "howto":
                entry["members_per_device"] = 1
                entry["howto_runs"] = spec.members // spec.devices
            flops = ctx.flops_per_example(spec.model)
            entry["flops_per_example"] = flops
            if spec.kind in ("ensemble", "sequential") and r.program_bytes:
                on_device = 1 if spec.kind == "sequential" else entry["members_per_device"]
                floor = ctx.footprint(spec.model)
                per_member = r.program_bytes / on_device
                entry["memory_per_member_bytes"] = per_member
                entry["state_bytes_per_member"] = floor["state"]
                entry["activation_bytes_per_member"] = floor["activations"]
                entry["memory_over_state_activations"] = per_member / sum(floor.values())
            entry["member_examples_per_s"] = spec.members * cfg.batch_size / t
            entry["flops_per_s"] = entry["member_examples_per_s"] * flops
        entry["fraction_of_matmul_flops"] = (
            entry["flops_per_s"] / matmul_flops
            if matmul_flops and entry.get("flops_per_s") is not None
            else None
        )
        out_cases[case.name] = entry
    ratios = _ratios(out_cases, cfg)
    devices = jax.devices()
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "jaxlib_version": _version("jaxlib"),
        "flax_version": _version("flax"),
        "python": platform_lib.python_version(),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "cpu_count": os.cpu_count(),
        "machine": platform_lib.machine(),
        "processor": _cpu_name(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "argv": sys.argv,
        "config": dataclasses.asdict(cfg),
        "data": {
            "name": dataset.name,
            "source": dataset.source,
            "note": dataset.note,
            "num_train": dataset.num_train,
            "steps_per_epoch": ctx.steps_per_epoch,
        },
        "flops_per_example": ctx.flops,
        "flops_source": ctx.flops_source,
        "matmul_flops_per_s": matmul_flops,
        "peak_memory_note": (
            "per device: device.memory_stats() peak_bytes_in_use where the device reports it "
            "(a process-wide running peak), else the compiled program's memory_analysis() "
            "(arguments + outputs + temporaries - aliased)"
        ),
        "memory_per_member_note": (
            "the compiled step's memory_analysis() per device divided by the members on "
            "the device, against one member's parameters + optimizer state + the residuals "
            "jax.vjp keeps for the backward pass of one batch"
        ),
    }
    return {"meta": meta, "cases": out_cases, "ratios": ratios, "targets": _targets(ratios)}


def _loadavg() -> list[float] | None:
    """The machine's 1, 5 and 15 minute load averages (other jobs' load shows here)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform_lib.processor()


def _ratios(c: dict[str, Any], cfg: BenchConfig) -> dict[str, Any]:
    def t(name: str) -> float | None:
        return c[name]["time_per_step_s"]["median"] if name in c else None

    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    def per_member_example(name: str) -> float | None:
        return t(name) / (c[name]["members"] * cfg.batch_size) if t(name) is not None else None

    auto = next(
        (n for n in ("strategy_loop", "strategy_vmap") if n in c and c[n]["same_as"] is None),
        None,
    )
    one_device = next(
        (n for n in (f"mpd_{cfg.members}", "mesh_1", "strategy_loop", "strategy_vmap") if n in c),
        auto,
    )
    r: dict[str, Any] = {
        "shard_map_over_pmap": div(t("ens_shard_map"), t("ens_pmap")),
        "one_device_over_sequential": div(t(one_device), t("sequential")) if one_device else None,
        "one_device_case": one_device,
        "loop_over_sequential": div(t("strategy_loop"), t("sequential")),
        "vmap_over_sequential": div(t("strategy_vmap"), t("sequential")),
        "vmap_over_loop": div(t("strategy_vmap"), t("strategy_loop")),
        "reform_im2col_vmap_over_base_loop": div(t("reform_im2col_vmap"), t("reform_base_loop")),
        "reform_im2col_loop_over_base_loop": div(t("reform_im2col_loop"), t("reform_base_loop")),
        "reform_im2col_loop_over_im2col_sequential": div(
            t("reform_im2col_loop"), t("reform_im2col_sequential")
        ),
        "on_device_loop_over_howto": div(
            per_member_example("chunk_default"), per_member_example("howto")
        ),
        "on_device_loop_over_howto_by_k": {
            n: div(per_member_example(n), per_member_example("howto"))
            for n in ("chunk_k1", "chunk_k8", "chunk_epoch")
            if n in c and "howto" in c
        },
        "ens_shard_map_over_howto": div(t("ens_shard_map"), t("howto")),
        "scan_over_jit": div(t("chunk_k8"), t("chunk_k1")),
        "scan_base_k8_over_k1": div(t("scan_base_k8"), t("scan_base_k1")),
        "scan_canonical_k8_over_k1": div(t("scan_canonical_k8"), t("scan_canonical_k1")),
        "scan_canonical_k8_over_base_k1": div(t("scan_canonical_k8"), t("scan_base_k1")),
        "bf16_over_fp32": div(t("precision_bf16"), t("precision_fp32")),
    }
    # The fastest way found to train the members on one device, against the sequential
    # loop (for the CNN the reform cases train the same members as the main cases).
    same_model = cfg.model == "cnn" and (cfg.conv_members or cfg.members) == cfg.members
    options = ["strategy_loop", "strategy_vmap"]
    options += ["reform_im2col_loop", "reform_im2col_vmap"] if same_model else []
    timed = {n: t(n) for n in options if t(n) is not None}
    if timed and t("sequential"):
        best = min(timed, key=lambda n: timed[n])
        r["best_one_device_case"] = best
        r["best_one_device_over_sequential"] = timed[best] / t("sequential")
    else:
        r["best_one_device_case"], r["best_one_device_over_sequential"] = None, None
    # Memory per member of the members' step on one device, against state + activations.
    r["memory_over_state_activations"] = (
        c[one_device].get("memory_over_state_activations") if one_device else None
    )
    r["memory_over_state_activations_by_case"] = {
        n: e["memory_over_state_activations"]
        for n, e in c.items()
        if e.get("memory_over_state_activations") is not None and e["same_as"] is None
    }
    mpd = {n: t(f"mpd_{n}") for n in cfg.members_per_device if f"mpd_{n}" in c}
    if 1 in mpd:
        r["members_per_device_scaling"] = {str(n): v / (n * mpd[1]) for n, v in mpd.items()}
        r["members_per_device_scaling_max"] = max(r["members_per_device_scaling"].values())
    else:
        r["members_per_device_scaling"], r["members_per_device_scaling_max"] = {}, None
    mesh = {n: t(f"mesh_{n}") for n in (1, 2, 4, 8) if f"mesh_{n}" in c}
    if 1 in mesh:
        r["mesh_speedup"] = {str(n): mesh[1] / v for n, v in mesh.items()}
        r["mesh_efficiency"] = {str(n): mesh[1] / (n * v) for n, v in mesh.items()}
    else:
        r["mesh_speedup"], r["mesh_efficiency"] = {}, {}
    return r


def _targets(ratios: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, (op, bound) in TARGETS.items():
        value = ratios.get(name)
        met = None if value is None else (value <= bound if op == "<=" else value >= bound)
        out[name] = {"value": value, "target": f"{op} {bound}", "met": met}
    return out


# ---------------------------------------------------------------------------------------
# Output


def format_table(results: dict[str, Any]) -> str:
    """The results as a text table, then the ratios and targets.

    Args:
      results: from :func:`run_bench`.

    Returns:
      The text.

    Example:
      >>> print(format_table(run_bench(cfg)))
    """
    head = (
        f"{'case':<20} {'M':>3} {'dev':>3} {'M/dev':>5} {'K':>4} {'ms/step':>9} {'IQR':>7} "
        f"{'m-ex/s':>8} {'GFLOP/s':>8} {'%mm':>5} {'peak MiB':>8}  notes"
    )
    lines = [head, "-" * len(head)]
    for name, e in results["cases"].items():
        st = e["time_per_step_s"]
        mex = e.get("member_examples_per_s")
        fl = e.get("flops_per_s")
        frac = e.get("fraction_of_matmul_flops")
        peak = e.get("peak_memory_bytes")
        note = f"= {e['same_as']}" if e["same_as"] else e["description"]
        is_mm = e["kind"] == "matmul"
        lines.append(
            f"{name:<20} {'' if is_mm else e['members']:>3} {e['devices']:>3} "
            f"{e['members_per_device'] or '':>5} {e['k']:>4} {1e3 * st['median']:>9.1f} "
            f"{1e3 * st['iqr']:>7.1f} {'' if mex is None else f'{mex:.0f}':>8} "
            f"{'' if fl is None else f'{fl / 1e9:.1f}':>8} "
            f"{'' if frac is None else f'{100 * frac:.0f}':>5} "
            f"{'' if peak is None else f'{peak / 2**20:.0f}':>8}  {note}"
        )
    lines.append("")
    for name, v in results["ratios"].items():
        if isinstance(v, dict):
            if v:
                lines.append(f"{name}: " + ", ".join(f"{k}={x:.2f}" for k, x in v.items()))
        elif isinstance(v, float):
            lines.append(f"{name}: {v:.3f}")
    lines.append("")
    for name, tgt in results["targets"].items():
        met = {True: "MET", False: "NOT MET", None: "not measured"}[tgt["met"]]
        value = "-" if tgt["value"] is None else f"{tgt['value']:.3f}"
        lines.append(f"target {name} {tgt['target']}: {value} {met}")
    return "\n".join(lines)


def plot_members(results: dict[str, Any], path: str) -> bool:
    """Plots time per step against members per device (the ``mpd_*`` cases).

    Draws the measured median with its interquartile range, linear growth from one
    member, and the sequential baseline's time per member.

    Args:
      results: from :func:`run_bench`.
      path: the PNG to write.

    Returns:
      Whether there was anything to plot (at least one ``mpd_*`` case).

    Example:
      >>> plot_members(results, "docs/_static/bench_members.png")
    """
    cases = results["cases"]
    pts = sorted(
        (e["members"], e["time_per_step_s"]) for n, e in cases.items() if n.startswith("mpd_")
    )
    if not pts:
        return False
    from meshensemble.plots import _pyplot

    plt = _pyplot()
    m = np.array([p[0] for p in pts], float)
    med = np.array([p[1]["median"] for p in pts]) * 1e3
    lo = med - np.array([p[1]["q1"] for p in pts]) * 1e3
    hi = np.array([p[1]["q3"] for p in pts]) * 1e3 - med
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.errorbar(m, med, yerr=[lo, hi], marker="o", capsize=3, label="ensemble, 1 device")
    if m[0] == 1:
        ax.plot(m, med[0] * m, ls="--", color="gray", label="linear from 1 member")
    if "sequential" in cases:
        seq = cases["sequential"]
        per_member = seq["time_per_step_s"]["median"] * 1e3 / seq["members"]
        ax.plot(m, per_member * m, ls=":", color="tab:red", label="sequential (jitted step)")
    meta = results["meta"]
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="members per device",
        ylabel="time per step (ms)",
        title=(
            f"{meta['config']['model']}, batch {meta['config']['batch_size']}: "
            f"{meta['device_count']} {meta['device_kind']} device(s), "
            f"{meta['cpu_count']} CPU cores, JAX {meta['jax_version']}"
        ),
    )
    ax.set_xticks(m, [str(int(v)) for v in m])
    ticks = [
        v
        for v in (10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
        if med.min() / 1.5 <= v <= med.max() * 2
    ]
    if ticks:
        ax.set_yticks(ticks, [str(v) for v in ticks])
        ax.minorticks_off()
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------
# Command line


def add_parser(sub: Any) -> None:
    """Registers the ``bench`` subcommand.

    Args:
      sub: the ``argparse`` subparsers of the ``meshensemble`` parser.

    Example:
      >>> add_parser(parser.add_subparsers())
    """
    p = sub.add_parser(
        "bench",
        help="time ensemble training against the Flax HOWTO and a loop",
        description=(
            "Times the Flax HOWTO's pmap step, Ensemble.train_step on both backends, the "
            "training loop's on-device chunk, a sequential loop over members, member and "
            "mesh scaling and member strategies, in one process, round-robin."
        ),
    )
    p.set_defaults(run=run)
    add = p.add_argument
    add("--fake-devices", type=int, metavar="N", help="N simulated CPU devices (CPU platform)")
    add("--members", type=int, help="ensemble size (default 8)")
    add("--batch-size", type=int, help="examples per member per step (default 128; tiny 32)")
    add("--repeats", type=int, help="timed rounds (default 5; tiny 2)")
    add("--warmup", type=int, help="untimed rounds after compiling (default 1)")
    add("--cases", help=f"comma list of cases or groups ({', '.join(GROUPS)}); default all")
    add("--tiny", action="store_true", help="tiny configuration for CI (< 60 s)")
    add("--data-file", help="a Keras-layout MNIST .npz (default: embedded sample)")
    add("--out", default="bench.json", help="JSON results file (default bench.json)")
    add("--model", choices=("cnn", "mlp"), help="model (default cnn; tiny: MLP((32,)))")
    add("--plot", metavar="FILE", help="PNG of time per step against members per device")
    add("--epoch-cap", type=int, help="most steps per call of chunk_epoch (default: an epoch)")
    add("--case-budget", type=float, metavar="S", help="stop timing a case after S seconds")
    add("--matmul-size", type=int, help="side of the reference matmul (default 2048)")
    add("--seed", type=int, default=0, help="seed of initialisation and batch order")


def run(args: argparse.Namespace) -> int:
    """Runs ``meshensemble bench`` from parsed flags: table on stdout, JSON to ``--out``.

    Args:
      args: parsed ``bench`` arguments.

    Returns:
      0.

    Raises:
      UsageError: a bad flag value.

    Example:
      >>> run(build_parser().parse_args(["bench", "--tiny", "--out", "/tmp/b.json"]))
      0
    """
    from meshensemble.cli.app import setup_devices

    cfg = resolve(args)
    setup_devices(args.fake_devices)
    results = run_bench(cfg)
    text = format_table(results)
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
    with open(cfg.out, "w") as f:
        json.dump(results, f, indent=1, default=_json_default)
    print(f"wrote {cfg.out}")
    if cfg.plot:
        if plot_members(results, cfg.plot):
            print(f"wrote {cfg.plot}")
        else:
            print(f"--plot {cfg.plot}: no members-per-device cases were run; nothing plotted")
    return 0


def _json_default(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, tuple):
        return list(v)
    return str(v)


if __name__ == "__main__":
    from meshensemble.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
