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

from meshensemble.core import derive, evaluating, inputs, keys, sharding, steps, streaming, tasks
from meshensemble.core.adapters import as_model
from meshensemble.core.backends import make_backend, put
from meshensemble.core.layout import Layout, given_values
from meshensemble.core.members import STRATEGIES as STRATEGIES
from meshensemble.core.members import default_strategy as default_strategy
from meshensemble.core.mesh import (
    BATCH,
    DATA,
    MEMBER_BATCH,
    MEMBERS,
    MODEL,
    make_mesh,
    member_sharding,
    members_per_device,
)
from meshensemble.core.state import EnsembleState, init_members, member_hyperparams
from meshensemble.core.steps import StepConfig
from meshensemble.runtime import precompile

MAX_IN_FLIGHT = 2
"""Programs an :class:`Ensemble` lets run ahead of the host before it waits for the oldest.

Bounding the queue keeps the device busy (the next step is dispatched while one runs) and
keeps a host loop that never reads a result from queueing thousands of collective programs:
XLA:CPU's emulated all-reduce aborts the process then ("Termination timeout for all reduce")."""


class Ensemble:
    """Trains ``num_members`` copies of a model as one program over a device mesh.

    Parameters and optimizer state are stacked on a leading member axis and sharded
    over the mesh axis ``ensemble``; batches are copied over ``ensemble`` and split
    over ``data``. Steps run under ``jax.shard_map`` (or ``jax.pmap`` for the legacy
    backend); gradients are averaged over ``data``; the ensemble prediction is the
    task's combination of the members' (for classification, the default, the mean of
    their softmax: ``lax.pmean`` over ``ensemble``).

    Args:
      model: a Flax Linen module, an ``(init_fn, apply_fn)`` pair or a
        :class:`meshensemble.Model`.
      optimizer: an optax optimizer for one member (each member gets its own state).
      num_members: number of members, a positive multiple of ``mesh.shape["ensemble"]``.
      mesh: a mesh with axes ``("ensemble", "data")``; default ``make_mesh()`` (all
        devices on ``ensemble``).
      backend: ``"shard_map"`` (default) or ``"pmap"`` (legacy; 1-D meshes only).
      loss_fn: per-example loss ``loss_fn(outputs [B, W], targets [B, ...]) -> [B]``;
        default the task's (softmax cross-entropy with integer labels for classification).
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
        ``input_transform``), e.g. ``me.data.augment.make_augment("shift", 2)``: each
        member draws its own, new every step, the same on any mesh and after a resume
        (see :mod:`meshensemble.data.augment`). Default None (none).
      shard_members: FSDP, each member's state split over ``data``; ``axis_rules``: logical
        name -> mesh axis pairs for a ``model`` axis (:mod:`meshensemble.core.sharding`).
      task: a :class:`meshensemble.tasks.Task`: ``me.tasks.Classification()`` (None, the
        default), ``me.tasks.Regression(targets=T)`` (outputs ``[B, 2T]``, float targets,
        predict/evaluate return the Gaussian mixture's dicts) or a user's subclass; the
        steps, predict and evaluate ask it (docs/tasks.md).
      sample: inputs of the model's shape (``images[:1]``): what :attr:`state_spec` lays
        sharded members out for (the steps use their batches'; :meth:`state_specs`).
      key_impl: the state keys' PRNG implementation where their words do not name it
        (``"unsafe_rbg"``); default None, by words (:mod:`meshensemble.core.keys`).
      shared, frozen: the member layout, filters ``(path, leaf) -> bool`` over a member's
        parameters (:mod:`meshensemble.core.layout`; the state is then a ``SharedState``);
        None (default): every leaf a member's own and trained.

    Raises:
      ValueError: the mesh lacks the axes, ``num_members`` is not a multiple of the
        ``ensemble`` axis, an unknown backend or strategy, or ``pmap`` on a 2-D mesh;
        ``hyperparams`` with an optimizer not made with ``optax.inject_hyperparams``,
        an unknown or scheduled hyperparameter, a shape other than ``[num_members]``
        or values that are not finite numbers; an unknown ``key_impl``.

    Example:
      >>> mesh = me.make_mesh(ensemble=2, data=1)  # e.g. ensemble=4, data=2 on 8 devices
      >>> ens = me.Ensemble(me.models.MLP((8,)), optax.sgd(0.1), num_members=2, mesh=mesh,
      ...                   input_transform=me.data.normalize)  # me.models.CNN() for MNIST
      >>> state = ens.init(jax.random.key(0), images[:1])
      >>> state, metrics = ens.train_step(state, images, labels)
      >>> probs = ens.predict(state, images)  # [N, 10]
      >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
      >>> lrs = me.Ensemble(me.models.MLP((8,)), tx, 4, mesh=me.make_mesh(ensemble=4, data=2),
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
        sample: Any = None,
        key_impl: str | None = None,
        shared: Callable[[tuple[str, ...], Any], bool] | None = None,
        frozen: Callable[[tuple[str, ...], Any], bool] | None = None,
    ):
        inputs.check_optimizer(optimizer)
        mesh = inputs.check_mesh_axes(make_mesh() if mesh is None else mesh)
        self.members_per_device = members_per_device(mesh, num_members)
        inputs.check_choice("member_strategy", member_strategy, STRATEGIES)
        self.mesh = mesh
        self.num_members = int(num_members)
        self.backend = make_backend(backend, mesh, shard_members)
        if member_strategy == "auto":
            member_strategy = default_strategy(mesh.devices.flat[0].platform)
        self.member_strategy = member_strategy
        self.model = as_model(model)
        self.optimizer = optimizer
        self.task = tasks.check_task(task)
        self.loss_fn = loss_fn or self.task.loss
        self.input_transform = input_transform
        self.hyperparams = member_hyperparams(hyperparams, optimizer, self.num_members)
        self.compute_dtype = inputs.compute_dtype(compute_dtype)
        self.augment = augment
        self.key_impl = keys.check_impl(key_impl)
        self.sample = None if sample is None else derive.row(sample)
        self.shard_members, self.axis_rules = shard_members, axis_rules or sharding.DEFAULT_RULES
        self.layout = Layout(shared=shared, frozen=frozen)
        # per-leaf layouts, by input shape: split members, or a member layout
        self._sharded = self.shard_members or MODEL in mesh.axis_names or not self.layout.trivial
        # Caches of pure functions of their keys (filled on first use, never reassigned):
        self._compiled: dict[Any, Callable[..., Any]] = {}  # programs by name and layout
        self._layouts: dict[Any, EnsembleState] = {}  # state specs by input signature
        self._classes: dict[Any, int] = {}  # output widths by state and input signature
        self._checked: dict[int, jax.Array] = {}  # the last placed targets found good
        self._in_flight: collections.deque[Any] = collections.deque()

    # ------------------------------------------------------------------ building
    @property
    def data_size(self) -> int:
        """Size of the mesh's ``data`` axis."""
        return int(self.mesh.shape[DATA])

    def step_config(self, sample: Any = None) -> StepConfig:
        """The static configuration that the per-device functions of the steps take.

        Args:
          sample: with sharded members, inputs of the batches to come (their shape fixes
            the layout, :meth:`state_specs`); default the constructor's ``sample``.

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
            rng_impl=self.key_impl,
            input_transform=self.input_transform,
            compute_dtype=self.compute_dtype,
            augment=self.augment,
            gather_axes=sharding.gather_axes(sharding.whole_param_specs(self._specs(sample)))
            if self.shard_members
            else None,
            task=self.task,
            frozen=self.layout.frozen and self.layout.frozen_flags(self._member(sample)),
        )

    def _member(self, sample: Any) -> Any:  # one member's parameter shapes (traced, cheap)
        x = self.sample if sample is None else sample
        x = self.state_spec if x is None else x  # no sample: state_spec's line
        return derive.member_params(self.model, self.input_transform, x)

    @property
    def state_spec(self) -> Any:
        """The state's specs for :meth:`build`: ``P("ensemble")``, or per leaf when sharded.

        The same before and after :meth:`init`: with sharded members (``shard_members``
        or a ``model`` axis), ``state_specs(sample)`` of the constructor's ``sample``.

        Raises:
          ValueError: members are sharded and the ensemble was made without ``sample``.

        Example:
          >>> spec = ens.state_spec  # P("ensemble"): members not sharded, one spec for all
        """
        if self._sharded and self.sample is None:
            raise ValueError(
                "sharded members and member layouts are laid out by the input shape, and this "
                "ensemble has no sample; pass Ensemble(..., sample=images[:1]) or use "
                "ens.state_specs(images)"
            )
        return self.state_specs(self.sample)

    def state_specs(self, sample: Any) -> Any:
        """The state's specs for inputs like ``sample``: a pure function of the arguments.

        Traces the members' init abstractly (nothing runs) and applies the rules of
        :mod:`meshensemble.core.sharding`, once per input shape.

        Args:
          sample: an input batch ``[B, ...]`` (array or ``jax.ShapeDtypeStruct``); unused
            (may be None) when members are not sharded.

        Returns:
          ``P("ensemble")`` when members are not sharded, else an
          :class:`EnsembleState` of ``PartitionSpec`` s.

        Example:
          >>> fsdp = me.Ensemble(me.models.MLP(), optax.sgd(0.1), 2, me.make_mesh(2, 4),
          ...                    shard_members=True)
          >>> fsdp.state_specs(images[:1]).params["Dense_0"]["kernel"]  # [2, 784, 128]
          P('ensemble', 'data')
        """
        if not self._sharded:
            return MEMBERS
        x = derive.row(sample)
        key = derive.signature(x)
        if key not in self._layouts:
            init, pieces = self._init_fn(False), (self.mesh, self.model, self.shard_members)
            rules = (self.axis_rules, self.input_transform)
            self._layouts[key] = sharding.init_layout(init, x, *pieces, *rules)
        return self._layouts[key]

    def _specs(self, sample: Any) -> Any:  # the layout for sample, else the constructor's
        return self.state_spec if sample is None else self.state_specs(sample)

    def _layout_key(self, sample: Any) -> Any:  # what a program's layout depends on
        x = derive.row(sample) if sample is not None else self.sample
        return derive.signature(x) if self._sharded else None

    def build(
        self,
        name: Any,
        make: Callable[[StepConfig], Callable[..., Any]],
        in_specs: tuple[Any, ...],
        out_specs: Any,
        *,
        donate_argnums: tuple[int, ...] = (),
        sample: Any = None,
    ) -> Callable[..., Any]:
        """A per-device function made global over this ensemble's mesh and backend, built once.

        The hook for code that needs its own compiled program over the ensemble (the
        training loop's chunk of K steps, the benchmark). ``make(cfg)`` returns the
        per-device function (it sees local views, as everything in
        :mod:`~meshensemble.core.steps` does); the result is cached under ``name`` (and
        the input signature when members are sharded), so calling ``build`` again is free.
        The program reads the key implementation from the state it is given.

        Args:
          name: a hashable cache key naming the program, e.g. ``("chunk", 8, 128)``.
          make: ``make(step_config) -> per_device_fn``.
          in_specs: one ``PartitionSpec`` (or spec tree) per argument.
          out_specs: the specs of the result.
          donate_argnums: arguments whose buffers the call may reuse (e.g. the state).
          sample: with sharded members, inputs like the batches (see :meth:`step_config`).

        Returns:
          A callable on global arrays (placed as ``in_specs`` say, without copies when
          they already are) with a ``lower(*args)`` method for ahead-of-time compilation
          on the ``shard_map`` backend.

        Example:
          >>> count = ens.build("count", lambda cfg: lambda state, x: state.step + x.shape[0],
          ...                   (ens.state_spec, me.core.mesh.BATCH), P("ensemble"))
        """
        return self._fn(
            ("user", name, self._layout_key(sample)),
            lambda: self.backend.build(
                make(self.step_config(sample)), in_specs, out_specs, donate_argnums=donate_argnums
            ),
        )

    def _fn(self, key: Any, make: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
        """Builds each global function once per Ensemble (jit caches shapes below that)."""
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

    def train_step_fn(self, per_member: bool = False, sample: Any = None) -> Callable[..., Any]:
        """The global function behind :meth:`train_step`, without its host-side checks.

        Args:
          per_member: whether batches are per member (``[members, B, ...]``).
          sample: with sharded members, inputs like the batches (see :meth:`step_config`).

        Returns:
          ``fn(state, images, labels) -> (state, metrics)``, donating ``state``; on the
          ``shard_map`` backend ``fn.lower(state, images, labels)`` lowers it ahead of time.

        Example:
          >>> compiled = ens.train_step_fn().lower(state, images, labels).compile()
        """
        spec = MEMBER_BATCH if per_member else BATCH
        metric_specs, specs = tasks.metric_specs(self.task), self._specs(sample)
        make = lambda cfg: functools.partial(steps.train_step, cfg)
        in_specs, out_specs = (specs, spec, spec), (specs, metric_specs)
        return self.build(
            ("train", per_member), make, in_specs, out_specs, donate_argnums=(0,), sample=sample
        )

    # ------------------------------------------------------------------ API
    def init(self, key: jax.Array, sample: Any, params: Any = None) -> EnsembleState:
        """Initialises all members; member ``i`` uses ``jax.random.split(key, M)[i]``.

        As in the Flax HOWTO, member ``i``'s parameters equal
        ``model.init(jax.random.split(key, num_members)[i], sample)["params"]``.

        Args:
          key: a legacy ``jax.random.PRNGKey`` or a typed ``jax.random.key``.
          sample: an input batch with the model's input shape, e.g. ``images[:1]``.
          params: values for any subset of the parameters (e.g. a pretrained backbone),
            a tree at the model's paths: one member's shape (every member gets it) or, for
            a member's own leaf, ``[num_members, ...]``; cast to the leaf's dtype. The
            optimizer state starts from them. Default None (all initialised).

        Returns:
          An :class:`EnsembleState` whose leaves have leading axis ``num_members`` and
          sharding ``NamedSharding(mesh, P("ensemble"))`` (a ``SharedState`` with a layout).

        Raises:
          ValueError: ``key`` is not a single PRNG key, or a typed key whose implementation
            its word count does not name and ``key_impl`` does not either; a given path
            that is not a parameter or a shape that does not fit (one line naming it).

        Example:
          >>> state = ens.init(jax.random.PRNGKey(0), images[:1])
          >>> head = {"Dense_1": {"bias": np.full(10, 0.5)}}   # every member's output bias
          >>> np.asarray(ens.init(key, images[:1], params=head).params["Dense_1"]["bias"])[1, :3]
          array([0.5, 0.5, 0.5], dtype=float32)
        """
        key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
        typed = keys.check_key(key, self.key_impl)
        sample = np.asarray(sample) if not isinstance(sample, jax.Array) else sample
        init = self._fn(
            ("init", typed, sample.shape, str(sample.dtype)),
            lambda: self._build_init(typed, sample),
        )
        if params is None:
            return init(key, sample)
        shapes = self._member(sample)
        given = given_values(shapes, params, self.layout.shared_mask(shapes), self.num_members)
        return init(key, sample, given[0])

    def _init_fn(self, typed: bool) -> Callable[..., EnsembleState]:
        m, transform, hyper = self.num_members, self.input_transform, self.hyperparams
        return init_members(self.model, self.optimizer, m, transform, hyper, typed, self.layout)

    def _build_init(self, typed: bool, sample: Any) -> Callable[..., Any]:
        init = self._init_fn(typed)
        if not self._sharded:
            return jax.jit(init, out_shardings=member_sharding(self.mesh))
        specs = self.state_specs(sample)
        return jax.jit(init, out_shardings=sharding.state_shardings(specs, self.mesh))

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
          (2,)
        """
        inputs.check_state(state, self.num_members)
        images, labels = inputs.as_array(images, "images"), inputs.as_array(labels, "labels")
        labels = self.task.as_targets(labels)
        words = self.task.input_word, self.task.target_word
        per_member = inputs.check_batch(
            images, labels, self.num_members, self.data_size, self.task.target_ndim, words
        )
        self._check_targets(state, images, labels, per_member)
        row = derive.row(images, per_member) if self._sharded else None
        out = self._dispatched(self.train_step_fn(per_member, row)(state, images, labels))
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
          ``ensemble``; the examples split over ``data`` when ``N`` is a multiple of it,
          and whole on every device of an ``ensemble`` group otherwise (the padding that
          made ``N`` divisible is dropped).

        Raises:
          ValueError: the state belongs to another ensemble size, or ``temperature`` is
            not positive, not finite, or neither a scalar nor ``[members]``.

        Example:
          >>> p = ens.predict_members(state, images)  # [members, N, 10]
          >>> t = ens.predict_members(state, images, temperature=[1.2, 1.5])  # per member
          >>> z = ens.predict_members(state, images, logits=True)  # [members, N, 10] logits
        """
        if temperature is None and not logits:
            return self._predict(state, images, members=True)
        raw = lambda members, logits: self._predict(state, images, members, logits)
        return self.task.tempered(raw, temperature, self.num_members, True, logits)

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
          >>> classes = ens.predict(state, images).argmax(-1)  # the ensemble's classes, [N]
          >>> calibrated = ens.predict(state, images, temperature=1.3)  # probabilities
        """
        if temperature is None:
            return self._predict(state, images, members=False)
        raw = lambda members, logits: self._predict(state, images, members, logits)
        return self.task.tempered(raw, temperature, self.num_members, False)

    @inputs.explains_errors
    def _predict(
        self, state: EnsembleState, images: Any, members: bool, logits: bool = False
    ) -> Any:
        inputs.check_state(state, self.num_members)
        images = inputs.as_array(images, "images")
        n = inputs.num_examples(images)
        padded = streaming.pad(images, self.data_size)
        per_device = steps.member_predictions if members else steps.ensemble_prediction
        per_device = steps.member_logits if logits else per_device
        row = derive.row(images) if self._sharded else None
        make = lambda cfg: functools.partial(per_device, cfg)
        in_specs, out_spec = (self._specs(row), BATCH), MEMBER_BATCH if members else BATCH
        fn = self.build(("predict", members, logits), make, in_specs, out_spec, sample=row)
        return streaming.unpad_on_mesh(self._dispatched(fn(state, padded)), n, self.mesh, members)

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
          >>> accuracy = ens.evaluate(state, test_images, test_labels)["accuracy"]
        """
        inputs.check_state(state, self.num_members)
        inputs.check_positive_int("batch_size", batch_size)
        inputs.check_positive_int("num_bins", num_bins)
        images, labels, n = evaluating.check_eval_set(images, labels, self.task)
        self._check_targets(state, images, labels, per_member=False)
        fn = self.eval_fn(num_bins, derive.row(images) if self._sharded else None)
        b = self.eval_batch_size(batch_size, n)
        finish = functools.partial(self.task.finalize, num_bins=num_bins)
        return evaluating.evaluate_batches(fn, state, images, labels, b, finish, self._dispatched)

    def eval_fn(self, num_bins: int = 15, sample: Any = None) -> precompile.AheadOfTime:
        """The global function behind :meth:`evaluate` (one batch), built once.

        Args:
          num_bins: bins of the expected calibration error.
          sample: with sharded members, inputs like the batches (see :meth:`step_config`).

        Returns:
          ``fn(state, images, labels, mask) -> (sums, per_example)`` on a batch of
          :meth:`eval_batch_size` examples (``mask`` bool ``[B]`` marks the real ones), an
          :class:`~meshensemble.runtime.precompile.AheadOfTime`: ``fn.compile_ahead(...)`` with the
          arguments' shapes compiles it in a thread before the first evaluation.

        Example:
          >>> started = ens.eval_fn().compile_ahead(state, images, labels, np.ones(32, bool))
        """
        make = lambda cfg: functools.partial(steps.eval_stats, cfg, (("num_bins", num_bins),))
        in_specs = (self._specs(sample), BATCH, BATCH, BATCH)
        name = ("evaluate", num_bins)
        program = lambda: self.build(name, make, in_specs, evaluating.EVAL_SPECS, sample=sample)
        ahead = lambda: precompile.AheadOfTime(program())
        return self._fn(("evaluate", num_bins, self._layout_key(sample)), ahead)

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
          >>> images = ens.place(images, local=True)  # each process its own rows (1: all)
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
        key = (derive.state_signature(state), derive.signature(derive.row(images)))
        if key not in self._classes:
            self._classes[key] = derive.num_classes(self.model, self.input_transform, state, images)
        return self._classes[key]

    def _check_targets(
        self, state: EnsembleState, images: Any, labels: Any, per_member: bool
    ) -> None:
        """The task's value checks of targets (e.g. labels in range), once per placed array."""
        placed = isinstance(labels, jax.Array)
        if placed and (not labels.is_fully_addressable or self._checked.get(id(labels)) is labels):
            return  # multi-process: checked where each process loads its data
        width = lambda: self.num_classes(state, derive.row(images, per_member))
        self.task.check_targets(labels, width)
        if placed:  # the same placed targets again: no new check
            self._checked.clear()
            self._checked[id(labels)] = labels
