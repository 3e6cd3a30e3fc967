"""The Ensemble: N members stacked on a leading axis, sharded over the mesh's ``ensemble`` axis."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshensemble.core import ahead, inputs, regression, sharding, stats, steps, tasks, tempering
from meshensemble.core.adapters import as_model
from meshensemble.core.backends import make_backend, put
from meshensemble.core.distributed import fetch
from meshensemble.core.mesh import (
    AXES,
    BATCH,
    DATA,
    ENSEMBLE,
    MEMBER_BATCH,
    MEMBERS,
    MODEL,
    make_mesh,
    member_sharding,
    members_per_device,
)
from meshensemble.core.state import EnsembleState, init_members, member_hyperparams
from meshensemble.core.steps import StepConfig

MAX_IN_FLIGHT = 2
"""Programs an :class:`Ensemble` lets run ahead of the host before it waits for the oldest.

Bounding the queue keeps the device busy (the next step is dispatched while one runs) and
keeps a host loop that never reads a result from queueing thousands of collective programs:
XLA:CPU's emulated all-reduce aborts the process then ("Termination timeout for all reduce")."""

STRATEGIES = ("auto", "vmap", "loop")
"""Ways to compute the members a device holds (see :func:`default_strategy`)."""


def default_strategy(platform: str) -> str:
    """The member strategy measured fastest on ``platform``.

    On CPU an unrolled loop over local members beats ``vmap`` (which turns each
    convolution into a slow grouped convolution); on accelerators ``vmap`` batches the
    members into one kernel.

    Args:
      platform: ``"cpu"``, ``"gpu"``, ``"tpu"`` ...

    Returns:
      ``"loop"`` or ``"vmap"``.

    Example:
      >>> me.default_strategy("cpu")
      'loop'
    """
    return "loop" if platform == "cpu" else "vmap"


class Ensemble:
    """Trains ``num_members`` copies of a model as one program over a device mesh.

    Parameters and optimizer state are stacked on a leading member axis and sharded
    over the mesh axis ``ensemble``; batches are copied over ``ensemble`` and split
    over ``data``. Steps run under ``jax.shard_map`` (or ``jax.pmap`` for the legacy
    backend); gradients are averaged over ``data``; the ensemble prediction is the
    mean of the members' softmax (``lax.pmean`` over ``ensemble``).

    Args:
      model: a Flax Linen module, an ``(init_fn, apply_fn)`` pair or a
        :class:`meshensemble.Model`.
      optimizer: an optax optimizer for one member (each member gets its own state).
      num_members: number of members, a positive multiple of ``mesh.shape["ensemble"]``.
      mesh: a mesh with axes ``("ensemble", "data")``; default ``make_mesh()`` (all
        devices on ``ensemble``).
      backend: ``"shard_map"`` (default) or ``"pmap"`` (legacy; 1-D meshes only).
      loss_fn: per-example loss ``loss_fn(logits [B, C], labels [B]) -> [B]``; default
        softmax cross-entropy with integer labels.
      member_strategy: ``"auto"`` (fastest measured for the platform), ``"vmap"`` or
        ``"loop"`` (several members per device; one member per device is always
        vmapped, over an axis of size 1).
      input_transform: applied on device to images before the model, e.g.
        :func:`meshensemble.data.normalize` for uint8 images; default none.
      hyperparams: per-member values of the optimizer's hyperparameters, e.g.
        ``{"learning_rate": [1e-3, 3e-3, 1e-2, 3e-2]}``: each ``[num_members]``, member
        ``i`` gets value ``i``. Needs an optimizer made with
        ``optax.inject_hyperparams`` (the values go into ``opt_state.hyperparams``,
        sharded with the members) with these hyperparameters given as numbers, not
        schedules. Default none (every member uses the optimizer's own values).
      compute_dtype: mixed precision, e.g. ``"bfloat16"``: the members compute forward
        and backward passes with parameters and inputs cast to this dtype, while
        parameters, optimizer state and updates stay float32 (master weights) and the
        loss and softmax are float32. For accelerators (bf16 is slow on most CPUs).
        Default None (compute in the parameters' dtype).
      augment: ``fn(key, image) -> image``, a training example's augmentation (after
        ``input_transform``), e.g. ``me.core.augment.make_augment("shift", 2)``: each
        member draws its own, new every step, the same on any mesh and after a resume
        (see :mod:`meshensemble.core.augment`). Default None (none).
      shard_members: FSDP, each member's state split over ``data``; ``axis_rules``: logical
        name -> mesh axis pairs for a ``model`` axis (:mod:`meshensemble.core.sharding`).
      task: ``me.tasks.Classification()`` (None, the default) or
        ``me.tasks.Regression(targets=T)``: outputs ``[B, 2T]``, float targets, and
        predict/evaluate return the Gaussian mixture's dicts (:mod:`meshensemble.core.tasks`).

    Raises:
      ValueError: the mesh lacks the axes, ``num_members`` is not a multiple of the
        ``ensemble`` axis, an unknown backend or strategy, or ``pmap`` on a 2-D mesh;
        ``hyperparams`` with an optimizer not made with ``optax.inject_hyperparams``,
        an unknown or scheduled hyperparameter, a shape other than ``[num_members]``
        or values that are not finite numbers.

    Example:
      >>> mesh = me.make_mesh(ensemble=4, data=2)
      >>> ens = me.Ensemble(me.models.CNN(), optax.sgd(0.1, 0.9), num_members=8, mesh=mesh)
      >>> state = ens.init(jax.random.key(0), images[:1])
      >>> state, metrics = ens.train_step(state, images, labels)
      >>> probs = ens.predict(state, images)  # [N, 10]
      >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
      >>> lrs = me.Ensemble(me.models.CNN(), tx, 4, mesh=me.make_mesh(ensemble=4, data=2),
      ...     hyperparams={"learning_rate": [0.01, 0.03, 0.1, 0.3]})
      >>> # metrics["loss"] is per member: compare the rates
    """

    def __init__(
        self,
        model: Any,
        optimizer: optax.GradientTransformation,
        num_members: int,
        mesh: Mesh | None = None,
        *,
        backend: str = "shard_map",
        loss_fn: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
        member_strategy: str = "auto",
        input_transform: Callable[[jax.Array], jax.Array] | None = None,
        hyperparams: Mapping[str, Any] | None = None,
        compute_dtype: Any = None,
        augment: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
        shard_members: bool = False,
        axis_rules: Any = None,
        task: Any = None,
    ):
        inputs.check_optimizer(optimizer)
        mesh = make_mesh() if mesh is None else mesh
        if tuple(mesh.axis_names) not in (AXES, (*AXES, MODEL)):
            raise ValueError(
                f"mesh axes {tuple(mesh.axis_names)} are not {AXES} (or with {MODEL!r}); "
                "build it with me.make_mesh(ensemble=..., data=..., model=...)"
            )
        self.members_per_device = members_per_device(mesh, num_members)
        if member_strategy not in STRATEGIES:
            raise ValueError(
                f"member_strategy={member_strategy!r} is unknown; choose one of "
                f"{', '.join(STRATEGIES)}"
            )
        self.mesh = mesh
        self.num_members = int(num_members)
        self.backend = make_backend(backend, mesh, shard_members)
        if member_strategy == "auto":
            member_strategy = default_strategy(mesh.devices.flat[0].platform)
        self.member_strategy = member_strategy
        self.model = as_model(model)
        self.optimizer = optimizer
        self.task = tasks.check_task(task)
        self.regression = self.task.kind == "regression"
        self.loss_fn = loss_fn or (
            self.task.loss if self.regression else steps.softmax_cross_entropy
        )
        self.input_transform = input_transform
        self.hyperparams = member_hyperparams(hyperparams, optimizer, self.num_members)
        self.compute_dtype = inputs.compute_dtype(compute_dtype)
        self.augment = augment
        self._rng_impl: Any = None
        self._compiled: dict[Any, Callable[..., Any]] = {}
        self._num_classes: int | None = None
        self._checked_labels: jax.Array | None = None
        self._in_flight: collections.deque[Any] = collections.deque()
        self.shard_members, self.axis_rules = shard_members, axis_rules or sharding.DEFAULT_RULES
        self._sharded, self._state_specs = self.shard_members or MODEL in mesh.axis_names, None

    # ------------------------------------------------------------------ building
    @property
    def data_size(self) -> int:
        """Size of the mesh's ``data`` axis."""
        return int(self.mesh.shape[DATA])

    def step_config(self) -> StepConfig:
        """The static configuration that the per-device functions of the steps take.

        Returns:
          A :class:`~meshensemble.core.steps.StepConfig` (model, optimizer, loss, member
          strategy, gradient mode of the backend, key implementation, input transform,
          compute dtype).

        Example:
          >>> fn = functools.partial(me.core.steps.train_chunk, ens.step_config(), 8, 128)
        """
        return StepConfig(
            model=self.model,
            tx=self.optimizer,
            loss_fn=self.loss_fn,
            strategy=self.member_strategy,
            grad_mode=self.backend.grad_mode,
            rng_impl=self._rng_impl,
            input_transform=self.input_transform,
            compute_dtype=self.compute_dtype,
            augment=self.augment,
            gather_axes=self.shard_members and sharding.gather_axes(self.state_spec.params) or None,
            task=self.task,
        )

    @property
    def state_spec(self) -> Any:
        """The state's specs for :meth:`build`: ``P("ensemble")``, or per leaf when sharded.

        Raises:
          ValueError: members are sharded and :meth:`init` has not run yet.

        Example:
          >>> ens.build("mine", make, (ens.state_spec, me.BATCH), ens.state_spec)
        """
        if not self._sharded:
            return MEMBERS
        if self._state_specs is None:
            raise ValueError("the sharded state's layout is unknown; call ens.init first")
        return self._state_specs

    def build(
        self,
        name: Any,
        make: Callable[[StepConfig], Callable[..., Any]],
        in_specs: tuple[Any, ...],
        out_specs: Any,
        *,
        donate_argnums: tuple[int, ...] = (),
    ) -> Callable[..., Any]:
        """A per-device function made global over this ensemble's mesh and backend, built once.

        The hook for code that needs its own compiled program over the ensemble (the
        training loop's chunk of K steps, the benchmark). ``make(cfg)`` returns the
        per-device function (it sees local views, as everything in
        :mod:`~meshensemble.core.steps` does); the result is cached under ``name`` (and
        the key implementation of the state), so calling ``build`` again is free.

        Args:
          name: a hashable cache key naming the program, e.g. ``("chunk", 8, 128)``.
          make: ``make(step_config) -> per_device_fn``.
          in_specs: one ``PartitionSpec`` (or spec tree) per argument.
          out_specs: the specs of the result.
          donate_argnums: arguments whose buffers the call may reuse (e.g. the state).

        Returns:
          A callable on global arrays (placed as ``in_specs`` say, without copies when
          they already are) with a ``lower(*args)`` method for ahead-of-time compilation
          on the ``shard_map`` backend.

        Example:
          >>> chunk = ens.build(("chunk", 8), lambda cfg: functools.partial(
          ...     me.core.steps.train_chunk, cfg, 8, 128), specs, out_specs, donate_argnums=(0,))
        """
        return self._fn(
            ("user", name),
            lambda: self.backend.build(
                make(self.step_config()), in_specs, out_specs, donate_argnums=donate_argnums
            ),
        )

    def _fn(self, key: Any, make: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
        """Builds each global function once per Ensemble (jit caches shapes below that)."""
        key = (key, self._rng_impl)
        if key not in self._compiled:
            self._compiled[key] = make()
        return self._compiled[key]

    def _dispatched(self, out: Any) -> Any:
        """Records a dispatched program's result; waits for the oldest beyond the bound."""
        # The last leaf: for train_step a metric (the state's leaves are consumed next step).
        leaf = next(reversed(jax.tree.leaves(out)), None)
        if isinstance(leaf, jax.Array):
            self._in_flight.append(leaf)
        while len(self._in_flight) > MAX_IN_FLIGHT:
            oldest = self._in_flight.popleft()
            if not oldest.is_deleted():
                oldest.block_until_ready()
        return out

    def train_step_fn(self, per_member: bool = False) -> Callable[..., Any]:
        """The global function behind :meth:`train_step`, without its host-side checks.

        Args:
          per_member: whether batches are per member (``[members, B, ...]``).

        Returns:
          ``fn(state, images, labels) -> (state, metrics)``, donating ``state``; on the
          ``shard_map`` backend ``fn.lower(state, images, labels)`` lowers it ahead of time.

        Example:
          >>> compiled = ens.train_step_fn().lower(state, images, labels).compile()
        """
        spec = MEMBER_BATCH if per_member else BATCH
        metric_specs = self.task.train_metric_specs()
        return self._fn(
            ("train", per_member),
            lambda: self.backend.build(
                functools.partial(steps.train_step, self.step_config()),
                (self.state_spec, spec, spec),
                (self.state_spec, metric_specs),
                donate_argnums=(0,),
            ),
        )

    # ------------------------------------------------------------------ API
    def init(self, key: jax.Array, sample: Any) -> EnsembleState:
        """Initialises all members; member ``i`` uses ``jax.random.split(key, M)[i]``.

        As in the Flax HOWTO, member ``i``'s parameters equal
        ``model.init(jax.random.split(key, num_members)[i], sample)["params"]``.

        Args:
          key: a legacy ``jax.random.PRNGKey`` or a typed ``jax.random.key``.
          sample: an input batch with the model's input shape, e.g. ``images[:1]``.

        Returns:
          An :class:`EnsembleState` whose leaves have leading axis ``num_members`` and
          sharding ``NamedSharding(mesh, P("ensemble"))``.

        Raises:
          ValueError: ``key`` is not a single PRNG key.

        Example:
          >>> state = ens.init(jax.random.PRNGKey(0), images[:1])
        """
        key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
        typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        if (typed and key.shape != ()) or (not typed and key.shape != (2,)):
            raise ValueError(
                f"key of shape {key.shape} and dtype {key.dtype} is not one PRNG key; "
                "pass jax.random.key(seed) or jax.random.PRNGKey(seed)"
            )
        self._rng_impl = jax.random.key_impl(key) if typed else None
        sample = np.asarray(sample) if not isinstance(sample, jax.Array) else sample
        init = self._fn(
            ("init", sample.shape, str(sample.dtype)), lambda: self._build_init(typed, sample)
        )
        return init(key, sample)

    def _build_init(self, typed: bool, sample: Any) -> Callable[..., Any]:
        init = init_members(
            self.model,
            self.optimizer,
            self.num_members,
            self.input_transform,
            self.hyperparams,
            typed,
        )
        if not self._sharded:
            return jax.jit(init, out_shardings=member_sharding(self.mesh))
        self._state_specs = sharding.init_layout(self, init, typed, sample)
        return jax.jit(init, out_shardings=sharding.state_shardings(self._state_specs, self.mesh))

    @inputs.explains_errors
    def train_step(
        self, state: EnsembleState, images: Any, labels: Any
    ) -> tuple[EnsembleState, dict[str, jax.Array]]:
        """One optimizer step of every member (jitted; ``state`` is donated).

        Args:
          state: from :meth:`init` or a previous step.
          images: ``[B, ...]`` shared by all members, or ``[members, B, ...]`` (each
            member its own examples). Numpy or ``jax.Array``, sharded or not.
          labels: ``[B]`` or ``[members, B]`` integer class indices.

        Returns:
          ``(state, metrics)``: ``metrics["loss"]`` and ``metrics["accuracy"]`` are
          ``[members]``; ``metrics["ensemble_accuracy"]`` and ``metrics["ensemble_nll"]``
          are scalars from the averaged softmax (NaN for per-member batches).

        Raises:
          ValueError: images and labels disagree in length, the batch is not divisible
            by the ``data`` axis, a per-member batch has the wrong member count, the
            state belongs to another ensemble size or optimizer, or the images' shape
            does not fit its parameters. Nothing is changed then.

        Example:
          >>> state, metrics = ens.train_step(state, images, labels)
          >>> metrics["loss"].shape
          (8,)
        """
        inputs.check_state(state, self.num_members)
        images, labels = inputs.as_array(images, "images"), inputs.as_array(labels, "labels")
        if self.regression:
            per_member, labels = self.task.check_batch(
                images, labels, self.num_members, self.data_size
            )
        else:
            per_member = inputs.check_batch(images, labels, self.num_members, self.data_size)
            self._check_label_range(state, images, labels, per_member)
        out = self._dispatched(self.train_step_fn(per_member)(state, images, labels))
        inputs.consume(state)
        return out

    def predict_members(
        self, state: EnsembleState, images: Any, temperature: Any = None, logits: bool = False
    ) -> jax.Array:
        """Every member's softmax prediction (or logits), optionally temperature-scaled.

        With ``temperature`` each member's prediction is ``softmax(z_m / T_m)``, computed
        on the mesh from its float32 softmax as ``softmax(log max(p_m, eps) / T_m)``
        (``eps = 1e-12``, the clip of ``me.calibration.ensemble_logits``; equal to it up to
        float32 rounding except for classes less likely than ``eps``).

        Args:
          state: the ensemble state.
          images: ``[N, ...]``, any ``N`` (padded to the ``data`` axis internally).
          temperature: None (no scaling: exactly the unscaled program), a scalar
            ``T > 0`` for every member, or ``[members]`` temperatures, one per member
            (as ``me.calibration.fit_temperature(..., per_member=True)`` returns).
          logits: return the members' logits ``z_m`` (float32, the model's output in
            inference mode) instead of their softmax; with ``temperature``, ``z_m / T_m``.
            For scores that need the logits' scale (max-logit, energy).

        Returns:
          ``[members, N, classes]`` probabilities (or logits), members sharded over
          ``ensemble``; the
          examples are split over ``data`` when ``N`` is a multiple of the ``data`` axis,
          and whole on every device of an ``ensemble`` group otherwise (the padding that
          made ``N`` divisible is dropped).

        Raises:
          ValueError: the state belongs to another ensemble size, or ``temperature`` is
            not positive, not finite, or neither a scalar nor ``[members]``.

        Example:
          >>> ens.predict_members(state, images).shape  # (8, N, 10)
          >>> ens.predict_members(state, images, temperature=[1.2] * 8)  # per member
          >>> ens.predict_members(state, images, logits=True)  # [8, N, 10] logits
        """
        if self.regression:
            return regression.predict(self, state, images, True, temperature, logits)
        t = tempering.check_temperature(temperature, self.num_members)
        out = self._predict(state, images, members=True, logits=logits)
        if t is None:
            return out
        return tempering.divided(out, t) if logits else tempering.tempered(out, t)

    def predict(self, state: EnsembleState, images: Any, temperature: Any = None) -> jax.Array:
        """The ensemble's prediction: the mean of the members' softmax, optionally calibrated.

        Computed on the mesh: each device averages its local members, then
        ``lax.pmean`` over ``ensemble``. A scalar ``temperature`` calibrates the pooled
        prediction ("pool, then calibrate", what ``meshensemble evaluate --calibrate``
        fits): ``softmax(log max(mean_m p_m, eps) / T)``, i.e.
        ``me.calibration.apply_temperature(me.calibration.ensemble_logits(member_probs), T)``.
        ``[members]`` temperatures scale each member first ("calibrate, then pool"):
        ``mean_m softmax(z_m / T_m)``.

        Args:
          state: the ensemble state.
          images: ``[N, ...]``, any ``N``.
          temperature: None (today's prediction, bitwise), a scalar ``T > 0``, or
            ``[members]`` temperatures.

        Returns:
          ``[N, classes]`` probabilities.

        Raises:
          ValueError: the state belongs to another ensemble size, or ``temperature`` is
            not positive, not finite, or neither a scalar nor ``[members]``.

        Example:
          >>> ens.predict(state, images).argmax(-1)  # the ensemble's classes, [N]
          >>> ens.predict(state, images, temperature=1.3)  # calibrated probabilities
        """
        if self.regression:
            return regression.predict(self, state, images, False, temperature)
        t = tempering.check_temperature(temperature, self.num_members)
        if t is None:
            return self._predict(state, images, members=False)
        if t.ndim == 0:
            return tempering.tempered(self._predict(state, images, members=False), t)
        members = self._predict(state, images, members=True)
        return tempering.mean_members(tempering.tempered(members, t))

    @inputs.explains_errors
    def _predict(
        self, state: EnsembleState, images: Any, members: bool, logits: bool = False
    ) -> jax.Array:
        inputs.check_state(state, self.num_members)
        images = inputs.as_array(images, "images")
        n = int(np.shape(images)[0]) if np.ndim(images) else 0
        if n == 0:
            raise ValueError(
                f"images of shape {np.shape(images)} hold no example; give at least one image"
            )
        padded = inputs.pad(images, self.data_size)
        per_device = steps.member_probs if members else steps.ensemble_probs
        per_device = steps.member_logits if logits else per_device
        fn = self._fn(
            ("predict", members, logits),
            lambda: self.backend.build(
                functools.partial(per_device, self.step_config()),
                (self.state_spec, BATCH),
                MEMBER_BATCH if members else BATCH,
            ),
        )
        out = self._dispatched(fn(state, padded))
        if out.shape[-2] == n:
            return out
        # Drop the padding: the result is no longer divisible over `data`, so keep it
        # whole on every device (members stay split over `ensemble`).
        spec = P(ENSEMBLE) if members else P()
        out = put(out, self.mesh, spec)
        return out[:, :n] if members else out[:n]

    @inputs.explains_errors
    def evaluate(
        self,
        state: EnsembleState,
        images: Any,
        labels: Any,
        batch_size: int = 1000,
        num_bins: int = 15,
    ) -> dict[str, Any]:
        """Ensemble and per-member metrics over a whole set, computed on the mesh.

        Streams over ``images`` in padded, masked batches; each batch's sums are reduced
        with collectives over ``data`` (the softmax averaged and the argmax votes counted
        over ``ensemble``), then added up on device. Only the sums and, per example, the
        ensemble's confidence and correctness (for the adaptive ECE) reach the host, never
        ``[members, N, classes]``.

        Args:
          state: the ensemble state.
          images: ``[N, ...]``, any ``N``.
          labels: ``[N]`` integer class indices.
          batch_size: examples per compiled call (rounded up to a multiple of ``data``).
          num_bins: bins of the expected calibration error.

        Returns:
          The dict of :func:`meshensemble.metrics.ensemble_metrics`: ``accuracy``,
          ``nll``, ``brier``, ``ece``, ``adaptive_ece``, ``entropy``,
          ``expected_entropy``, ``mutual_information``, ``disagreement`` (pairwise),
          ``pairwise_kl``, ``disagreement_vs_ensemble`` (floats, for the ensemble),
          ``member_*`` (lists of length members) and ``mean_member_*`` (floats).

        Raises:
          ValueError: images and labels differ in length, no examples, or labels out of
            range.

        Example:
          >>> ens.evaluate(state, test_images, test_labels)["accuracy"]
        """
        if self.regression:
            return regression.evaluate(self, state, images, labels, batch_size)
        inputs.check_state(state, self.num_members)
        inputs.check_positive_int("batch_size", batch_size)
        inputs.check_positive_int("num_bins", num_bins)
        images, labels, n = tempering.check_eval_set(images, labels)
        self._check_label_range(state, images, labels, per_member=False)
        fn = self.eval_fn(num_bins)
        b = self.eval_batch_size(batch_size, n)
        partial_sums, examples = [], []
        for start in range(0, n, b):
            x, y = images[start : start + b], labels[start : start + b]
            k = len(y)
            mask = np.arange(b) < k
            if k < b:
                x, y = inputs.pad_to(x, b), np.concatenate([y, np.zeros(b - k, y.dtype)])
            sums, per_example = self._dispatched(fn(state, x, y, mask))
            partial_sums.append(sums)
            examples.append(per_example)
        # The sums are added on the host (no small programs to compile); N floats each
        # (confidence, correctness, mask) come to the host too, for the adaptive ECE.
        partial_sums, examples = fetch((partial_sums, examples))
        total = functools.reduce(lambda a, b: jax.tree.map(np.add, a, b), partial_sums)
        joined = {k: np.concatenate([e[k] for e in examples]) for k in stats.EXAMPLE_STAT_KEYS}
        return stats.finalize_stats(total, num_bins, examples=joined)

    def eval_fn(self, num_bins: int = 15) -> ahead.AheadOfTime:
        """The global function behind :meth:`evaluate` (one batch), built once.

        Args:
          num_bins: bins of the expected calibration error.

        Returns:
          ``fn(state, images, labels, mask) -> (sums, per_example)`` on a batch of
          :meth:`eval_batch_size` examples (``mask`` bool ``[B]`` marks the real ones), an
          :class:`~meshensemble.core.ahead.AheadOfTime`: ``fn.compile_ahead(...)`` with the
          arguments' shapes compiles it in a thread before the first evaluation.

        Example:
          >>> ens.eval_fn().compile_ahead(state_shapes, x_shape, y_shape, mask_shape)
        """
        return self._fn(
            ("evaluate", num_bins),
            lambda: ahead.AheadOfTime(
                self.backend.build(
                    functools.partial(steps.eval_stats, self.step_config(), num_bins),
                    (self.state_spec, BATCH, BATCH, BATCH),
                    tempering.eval_specs(),
                )
            ),
        )

    def eval_batch_size(self, batch_size: int, n: int) -> int:
        """The examples per call :meth:`evaluate` uses for ``n`` examples.

        Args:
          batch_size: the requested batch size.
          n: how many examples are evaluated.

        Returns:
          ``min(batch_size, n)`` rounded up to a multiple of the ``data`` axis.

        Example:
          >>> ens.eval_batch_size(1000, 10000)
          1000
        """
        b = min(batch_size, n)
        return b + -b % self.data_size

    def place(self, x: Any, per_member: bool = False, local: bool = False) -> jax.Array:
        """Puts a batch on the mesh: split over ``data`` (and ``ensemble`` per member).

        Args:
          x: by default the global batch ``[B, ...]`` (or ``[members, B, ...]`` with
            ``per_member``), the same value in every process. With ``local=True``, only
            this process's part: the rows its devices hold along ``data``, in process
            order (``jax.make_array_from_process_local_data``).
          per_member: whether ``x`` has a leading member axis.
          local: whether ``x`` is this process's part rather than the global batch.

        Returns:
          A global ``jax.Array`` sharded as the steps expect (no copy if it already is),
          which ``train_step``, ``predict`` and ``evaluate`` take as it is.

        Example:
          >>> images = ens.place(images)                     # the same in every process
          >>> images = ens.place(my_rows, local=True)        # each process its own rows
        """
        spec = MEMBER_BATCH if per_member else BATCH
        if local:
            return jax.make_array_from_process_local_data(
                NamedSharding(self.mesh, spec), np.asarray(x)
            )
        return put(x, self.mesh, spec)

    # ------------------------------------------------------------------ checks
    def num_classes(self, state: EnsembleState, images: Any) -> int:
        """The number of classes the model predicts (from its output shape; nothing runs).

        Args:
          state: an ensemble state (its shapes are used, not its values).
          images: inputs of the model's shape, ``[B, ...]`` (or ``[members, B, ...]``).

        Returns:
          ``C``, the size of the model's last output axis.

        Example:
          >>> ens.num_classes(state, images)
          10
        """
        if self._num_classes is None:
            member = lambda v: jax.ShapeDtypeStruct(v.shape[1:], v.dtype)
            params, model_state, rng = jax.tree.map(
                member, (state.params, state.model_state, state.rng)
            )
            dtype = getattr(images, "dtype", None) or np.result_type(images)
            x = jax.ShapeDtypeStruct((1, *np.shape(images)[1:]), dtype)
            transform = self.input_transform or (lambda v: v)
            apply = lambda p, ms, xx, r: self.model.apply(p, ms, transform(xx), False, r)[0]
            self._num_classes = int(jax.eval_shape(apply, params, model_state, x, rng).shape[-1])
        return self._num_classes

    def _check_label_range(
        self, state: EnsembleState, images: Any, labels: Any, per_member: bool
    ) -> None:
        """ValueError naming the labels' range when one is outside ``[0, classes)``."""
        if isinstance(labels, jax.Array):
            if not labels.is_fully_addressable or labels is self._checked_labels:
                return  # multi-process: checked where each process loads its data
            lo, hi = (int(v) for v in jax.device_get((jnp.min(labels), jnp.max(labels))))
        else:
            lo, hi = int(np.min(labels)), int(np.max(labels))
        shape = np.shape(images)[1:] if per_member else np.shape(images)
        dtype = getattr(images, "dtype", None) or np.result_type(images)
        classes = self.num_classes(state, jax.ShapeDtypeStruct(shape, dtype))
        if lo < 0 or hi >= classes:
            raise ValueError(
                f"labels range over [{lo}, {hi}] but the model predicts {classes} classes; "
                f"give class indices in [0, {classes})"
            )
        if isinstance(labels, jax.Array):
            self._checked_labels = labels  # the same placed labels again: no new check
