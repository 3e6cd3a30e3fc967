"""The runners: one timed computation per :class:`meshensemble.bench.config.Spec` kind.

Each runner builds (and where it can, compiles ahead of time) its computation in
:meth:`Runner.prepare`; :meth:`Runner.run` makes one call and waits for it. The timer
(:mod:`meshensemble.bench.timing`) calls ``run`` and keeps the samples.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import jax_utils
from flax.training import train_state
from jax import lax

from meshensemble.bench.config import Spec
from meshensemble.bench.flops import count_flops
from meshensemble.bench.timing import timed
from meshensemble.bench.workloads import Context, make_model, single_step
from meshensemble.core.ensemble import Ensemble
from meshensemble.core.mesh import make_mesh, replicated_sharding
from meshensemble.data import normalize
from meshensemble.training import Feeder, TrainConfig


def program_memory(compiled: Any) -> int | None:
    """Peak bytes of a compiled program per device: arguments, outputs and temporaries.

    Args:
      compiled: a ``jax.stages.Compiled``.

    Returns:
      ``memory_analysis()``'s arguments + outputs + temporaries - aliased bytes, or None
      where the backend reports none.

    Example:
      >>> x = jnp.ones(1024, jnp.float32)
      >>> program_memory(jax.jit(jnp.sin).lower(x).compile())  # 4 KiB in, 4 KiB out
      8192
    """
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001
        return None
    if m is None:
        return None
    parts = (m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes)
    return int(sum(parts) - m.alias_size_in_bytes)


def memory_stats(device: jax.Device) -> dict[str, Any]:
    """A device's ``memory_stats()``, empty where the backend reports none.

    Args:
      device: a device.

    Returns:
      The stats (``peak_bytes_in_use``, ``bytes_limit`` ...), or ``{}`` (e.g. CPU).

    Example:
      >>> memory_stats(jax.devices()[0]).get("peak_bytes_in_use") is None   # CPU: no stats
      True
    """
    try:
        return device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend reports memory
        return {}


def device_memory(devices: Sequence[jax.Device]) -> int | None:
    """Largest ``peak_bytes_in_use`` over ``devices``.

    Args:
      devices: the devices a case uses.

    Returns:
      The bytes, or None where no device reports them (e.g. CPU).

    Example:
      >>> device_memory(jax.devices()[:1]) is None   # CPU devices report no peak
      True
    """
    peaks = [s["peak_bytes_in_use"] for s in map(memory_stats, devices) if "peak_bytes_in_use" in s]
    return max((int(p) for p in peaks), default=None)


class Runner:
    """One timed computation; :meth:`run` makes one call and waits for it.

    Attributes:
      ctx: the shared inputs.
      spec: what it computes.
      samples: seconds per step of each timed call.
      compile_s: seconds to build and compile.
      first_call_s: seconds of the untimed first call (None when compiled ahead).
      peak_bytes: peak memory per device (``memory_source`` says how it was measured).
      program_bytes: the compiled program's ``memory_analysis()`` bytes, or None.
      flops_per_call: FLOPs of one call (the matmuls only, ``2 * n**3``).

    Example:
      >>> spec = Spec("matmul", "256")
      >>> runner = RUNNERS[spec.kind](ctx, spec); runner.prepare(); runner.run()
      >>> runner.compile_s > 0, runner.flops_per_call
      (True, 33554432.0)
    """

    needs_first_call = True

    def __init__(self, ctx: Context, spec: Spec):
        self.ctx, self.spec = ctx, spec
        self.samples: list[float] = []
        self.compile_s: float | None = None
        self.first_call_s: float | None = None
        self.peak_bytes: int | None = None
        self.memory_source = "unavailable"
        self.program_bytes: int | None = None
        self.flops_per_call: float | None = None

    def prepare(self) -> None:
        """Builds and compiles the computation, then makes the first call if it needs one."""
        build_s = timed(self.build)
        if self.compile_s is None:
            self.compile_s = build_s
        if self.needs_first_call:
            self.first_call_s = timed(self.run)
        stats = device_memory(self.devices())
        if stats is not None:
            self.peak_bytes, self.memory_source = stats, "memory_stats"

    def compile_timed(self, fn: Any, *args: Any) -> Any:
        """Compiles ``fn`` for ``args`` ahead of time; records its compile time and memory."""
        t = time.perf_counter()
        compiled = fn.lower(*args).compile()
        self.compile_s = time.perf_counter() - t
        self.program_bytes = program_memory(compiled)
        if self.program_bytes is not None:
            self.peak_bytes, self.memory_source = self.program_bytes, "memory_analysis"
        return compiled

    def make_feeder(self, k: int, **train: Any) -> tuple[Ensemble, Feeder]:
        """The spec's ensemble and the training loop's feeder of ``k`` steps per chunk, as
        the loop builds them (``train``: more :class:`~meshensemble.training.TrainConfig`
        fields); the members' state goes to ``self.state``."""
        ens = make_ensemble(self.ctx, self.spec)
        members, batch_size = self.spec.members, self.ctx.cfg.batch_size
        cfg = TrainConfig(members=members, batch_size=batch_size, shuffle="shared", **train)
        self.state = self.ctx.ensemble_state(self.spec.model, members, ens.mesh)
        key = jax.random.key(self.ctx.cfg.seed + 1)
        return ens, Feeder(ens, self.ctx.dataset, cfg, key, k, self.ctx.steps_per_epoch)

    def devices(self) -> list[jax.Device]:
        """The devices the case uses."""
        return jax.devices()[: self.spec.devices]

    def build(self) -> None:
        """Makes the inputs and the computation (subclasses)."""
        raise NotImplementedError

    def run(self) -> None:
        """One call, waited for (subclasses)."""
        raise NotImplementedError


MATMUL_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
"""The operands' dtype of each matmul case's precision."""


class Matmul(Runner):
    """A square matmul on one device in float32 or bfloat16: the FLOP/s yardsticks.

    JAX's default precision: on GPUs with TensorFloat-32 (A100, H100) the float32
    matmul runs in TF32, as the float32 training steps' matmuls and convolutions do.
    """

    needs_first_call = False

    def build(self) -> None:
        n = int(self.spec.model)
        dtype = MATMUL_DTYPES[self.spec.precision]
        dev = jax.devices()[0]
        k1, k2 = jax.random.split(jax.random.key(1))
        self.a = jax.device_put(jax.random.normal(k1, (n, n), dtype), dev)
        self.b = jax.device_put(jax.random.normal(k2, (n, n), dtype), dev)
        self.fn = self.compile_timed(jax.jit(jnp.matmul), self.a, self.b)
        self.flops_per_call = count_flops(jnp.matmul, self.a, self.b)["total"]

    def run(self) -> None:
        self.fn(self.a, self.b).block_until_ready()


class Howto(Runner):
    """The Flax HOWTO's training step, ``members / devices`` HOWTO runs per step."""

    def build(self) -> None:
        module = make_model(self.spec.model)
        devs = self.devices()
        n = len(devs)
        self.runs = self.spec.members // n
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
                tx=self.ctx.tx,
                opt_state=self.ctx.opt_state(params),
            )
            self.states.append(jax.device_put(state, self._line))
        self.apply_model = jax.pmap(apply_model, axis_name="ensemble", devices=devs)
        self.update_model = jax.pmap(lambda s, g: s.apply_gradients(grads=g), devices=devs)
        self.step_index = 0
        self.losses: list[Any] = []
        x, y = self._replicated(0)
        self.compile_timed(self.apply_model, self.states[0], x, y)

    def _replicated(self, i: int) -> tuple[Any, Any]:
        x, y = self.ctx.howto_batch(i)
        devs = self.devices()
        return jax_utils.replicate(x, devs), jax_utils.replicate(y, devs)

    def run(self) -> None:
        i, self.step_index = self.step_index, self.step_index + 1
        for r in range(self.runs):
            batch_images, batch_labels = self._replicated(i)
            grads, loss, _ = self.apply_model(self.states[r], batch_images, batch_labels)
            self.states[r] = self.update_model(self.states[r], grads)
            self.losses = [jax_utils.unreplicate(loss)]
        jax.block_until_ready((self.states, self.losses))


def make_ensemble(ctx: Context, spec: Spec) -> Ensemble:
    """The :class:`meshensemble.Ensemble` of a spec, on its mesh of the first devices.

    Args:
      ctx: the shared inputs (the optimizer).
      spec: the members, mesh, backend, strategy and precision.

    Returns:
      The ensemble (its members' state comes from :meth:`Context.ensemble_state`).

    Example:
      >>> ens = make_ensemble(ctx, Spec("ensemble", "mlp32", members=4))
      >>> ens.num_members, dict(ens.mesh.shape)
      (4, {'ensemble': 1, 'data': 1})
    """
    mesh = make_mesh(spec.ensemble, spec.data, devices=jax.devices()[: spec.devices])
    return Ensemble(
        make_model(spec.model),
        ctx.tx,
        spec.members,
        mesh,
        backend=spec.backend,
        member_strategy=spec.strategy,
        input_transform=normalize,
        compute_dtype=jnp.bfloat16 if spec.precision == "bf16" else None,
    )


class EnsembleStep(Runner):
    """``Ensemble.train_step`` on host batches, one step per call."""

    def build(self) -> None:
        self.ens = make_ensemble(self.ctx, self.spec)
        x, y = self.ctx.host_batch(0)
        self.state = self.ctx.ensemble_state(self.spec.model, self.spec.members, self.ens.mesh)
        self.step_index = 0
        if self.spec.backend == "shard_map":  # compile ahead of time for the memory analysis
            compiled = self.compile_timed(self.ens.train_step_fn(False), self.state, x, y)
            if self.spec.devices == 1:
                examples = self.spec.members * self.ctx.cfg.batch_size
                self.ctx.record_flops(self.spec.model, compiled, examples)

    def run(self) -> None:
        x, y = self.ctx.host_batch(self.step_index)
        self.step_index += 1
        self.state, metrics = self.ens.train_step(self.state, x, y)
        jax.block_until_ready((self.state, metrics))


class Chunk(Runner):
    """The training loop's on-device chunk of ``K`` steps, built as the loop builds it."""

    needs_first_call = False

    def build(self) -> None:
        ens, feeder = self.make_feeder(self.spec.k)
        first = jax.device_put(jnp.int32(0), replicated_sharding(ens.mesh))
        self.args = (feeder.images, feeder.labels, feeder.order(1), first)
        # the program the loop runs: K > 1 is the paced chunk (its step count an argument)
        program = feeder.paced() if feeder.dynamic else feeder.chunk(self.spec.k)
        if feeder.dynamic:
            self.args += (jax.device_put(jnp.int32(self.spec.k), replicated_sharding(ens.mesh)),)
        self.fn = self.compile_timed(program, self.state, *self.args)

    def run(self) -> None:
        self.state, metrics = self.fn(self.state, *self.args)
        jax.block_until_ready((self.state, metrics))


class Sequential(Runner):
    """The members one after another with a jitted single-model step on one device."""

    def build(self) -> None:
        self.device = jax.devices()[0]
        x, y = self.ctx.host_batch(0)
        members = [self.ctx.member_params(self.spec.model, i) for i in range(self.spec.members)]
        self.states = [jax.device_put((p, self.ctx.opt_state(p)), self.device) for p in members]
        step = single_step(make_model(self.spec.model), self.ctx.tx)
        self.step = jax.jit(step, donate_argnums=(0, 1))
        xd, yd = jax.device_put((x, y), self.device)
        compiled = self.compile_timed(self.step, *self.states[0], xd, yd)
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


RUNNERS: dict[str, type[Runner]] = {
    "matmul": Matmul,
    "howto": Howto,
    "ensemble": EnsembleStep,
    "chunk": Chunk,
    "sequential": Sequential,
}
"""The runner class of each :attr:`Spec.kind`."""
