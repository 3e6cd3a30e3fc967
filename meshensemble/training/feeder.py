"""Feeding the steps: K-step chunks from on-device data, or streamed host batches.

The training set is put on the mesh once (replicated: MNIST-sized sets fit on every
device). Each epoch's order is drawn on device from the order key (so the batches are
the same whatever the mesh) and every step gathers its batch on device, so no step waits
on a host copy. ``K`` steps run per compiled call: with ``K > 1`` one program whose step count is a
runtime argument ``n <= K`` (:meth:`Feeder.paced`), so the loop may cut calls short (to
honour a stop within :attr:`~meshensemble.training.TrainConfig.stop_within` seconds, or
a checkpoint step) without compiling anything new and with bitwise the same steps.

The streamed path (``--input stream``, for data that does not fit on the devices) runs one
step per call: a :class:`meshensemble.data.stream.StreamIterator` reads, in Grain threads
a few steps ahead, only this process's rows of each batch, in the same order (fetched to
the host once per epoch), and they are assembled with
``jax.make_array_from_process_local_data``; the members come out the same as on device.
Its position is saved in every checkpoint (:meth:`Feeder.input_state`).

Each epoch uses ``N // batch_size`` full batches; the remaining ``N % batch_size``
examples of that epoch's order are left out (each epoch draws a new order, so every
example is used over a run).

Example:
  >>> ds, cfg = me.data.synthetic(64, 32, seed=0), me.TrainConfig(members=2, batch_size=32)
  >>> feeder = Feeder(ens, ds, cfg, jax.random.key(1), k=2, steps_per_epoch=2)
  >>> state, metrics = feeder.run(state, epoch=1, first=0, n=2)   # epoch 1's 2 steps
  >>> metrics["loss"].shape   # [steps, members]
  (2, 2)
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from meshensemble import data as data_lib
from meshensemble.core import steps
from meshensemble.core.backends import put
from meshensemble.core.ensemble import Ensemble
from meshensemble.core.mesh import BATCH, MEMBER_BATCH, MEMBERS, REPLICATED
from meshensemble.core.sharding import state_shardings
from meshensemble.core.state import EnsembleState
from meshensemble.core.tasks import metric_specs
from meshensemble.data import stream as stream_lib
from meshensemble.runtime import precompile
from meshensemble.runtime.distributed import fetch
from meshensemble.training import order as order_lib
from meshensemble.training.config import TrainConfig


class Feeder:
    """Runs K steps from on-device data, or one step from a host batch (streaming).

    Args:
      ens: the ensemble being trained.
      dataset: the training data (only its train split is used).
      cfg: the run's config (``batch_size``, ``shuffle``, ``members``, ``input``).
      order_key: the key each epoch's order is drawn from (``fold_in(order_key, epoch)``).
      k: steps per compiled call.
      steps_per_epoch: ``N // batch_size``.
      source: where a streamed run reads the training examples (a
        :mod:`meshensemble.data.stream` source holding the train split's examples in its
        order); default the dataset's train arrays.

    Raises:
      ValueError: ``source`` holds another number of examples than the train split.

    Attributes:
      input: ``"device"`` or ``"stream"`` (``cfg.input``, with ``auto`` resolved).
      input_why: one line saying why.
      stream: the :class:`~meshensemble.data.stream.StreamIterator` (None on device).
      images: the training images on the mesh, uint8 ``[N, 28, 28, 1]`` replicated (absent
        when streaming).
      labels: the training labels on the mesh, int32 ``[N]`` replicated (absent when
        streaming).

    Example:
      >>> ds, cfg = me.data.synthetic(64, 32, seed=0), me.TrainConfig(members=2, batch_size=32)
      >>> feeder = Feeder(ens, ds, cfg, jax.random.key(1), k=2, steps_per_epoch=2)
      >>> feeder.input, feeder.images.shape   # the training set, on every device
      ('device', (64, 28, 28, 1))
      >>> compiled = feeder.chunk(2).lower(state, feeder.images, feeder.labels,
      ...                                  feeder.order(1), jnp.int32(0)).compile()
    """

    def __init__(
        self,
        ens: Ensemble,
        dataset: data_lib.Dataset,
        cfg: TrainConfig,
        order_key: jax.Array,
        k: int,
        steps_per_epoch: int,
        source: Any = None,
    ):
        self.ens, self.cfg, self.k = ens, cfg, k
        self.steps_per_epoch = steps_per_epoch
        self.batch = cfg.batch_size
        self.per_member = cfg.shuffle == "per-member" or cfg.bootstrap
        self.order_key = order_key
        self.n = len(dataset.train_labels)
        self._order_spec = MEMBERS if self.per_member else REPLICATED
        self._orders = jax.jit(
            self._draw,
            static_argnums=(1,),
            out_shardings=NamedSharding(ens.mesh, self._order_spec),
        )
        self._epoch: tuple[int, jax.Array] | None = None
        self._ahead: concurrent.futures.Future | None = None
        self._ran = False  # the chunk program has been called (so it is compiled)
        lazy = data_lib.is_lazy(dataset)  # a lazy train split always streams
        size = stream_lib.example_bytes(dataset)
        self.input, self.input_why = resolve_input(cfg, self.n, ens.mesh, lazy, size)
        self.streaming = self.input == "stream"
        self.stream = None
        if source is not None and len(source) != self.n:
            raise ValueError(
                f"the stream source holds {len(source)} examples but the training split has "
                f"{self.n}; pass a source of exactly the train split's examples (and no "
                "--validation, which takes examples out of it)"
            )
        self._shapes: Any = None
        self.dynamic = k > 1 and not self.streaming
        """Whether :meth:`run` calls :meth:`paced` (any ``n <= k``, one program)."""
        if self.streaming:
            members = cfg.members if self.per_member else None
            self.stream = stream_lib.StreamIterator(
                dataset if source is None else source,
                self.host_order,
                self.batch,
                steps_per_epoch,
                stream_lib.local_block(ens.mesh, self.batch, members),
            )
        else:
            self.images = put(dataset.train_images, ens.mesh, REPLICATED)
            self.labels = put(train_targets(ens.task, dataset.train_labels), ens.mesh, REPLICATED)

    def for_ensemble(self, ens: Ensemble) -> Feeder:
        """A feeder of the same data, order and chunk for another ensemble on the same mesh.

        It shares this feeder's on-device training set and its order program (nothing is
        placed or compiled again for them), and has its own chunk program (``ens``'s),
        not yet compiled. The auto-tuner times each candidate ensemble with one
        (:func:`meshensemble.training.tuning.resolve_choices`).

        Args:
          ens: an ensemble on this feeder's mesh.

        Returns:
          A new :class:`Feeder`.

        Raises:
          ValueError: ``ens`` is on another mesh.

        Example:
          >>> ds, cfg = me.data.synthetic(64, 32, seed=0), me.TrainConfig(members=2, batch_size=32)
          >>> feeder = Feeder(ens, ds, cfg, jax.random.key(1), k=2, steps_per_epoch=2)
          >>> vmap = me.Ensemble(me.models.MLP((8,)), optax.sgd(0.1), 2, mesh,
          ...                    input_transform=me.data.normalize, member_strategy="vmap")
          >>> other = feeder.for_ensemble(vmap)
          >>> other.images is feeder.images   # the same on-device training set
          True
        """
        if ens.mesh != self.ens.mesh:
            raise ValueError(
                f"for_ensemble needs an ensemble on the feeder's mesh {dict(self.ens.mesh.shape)}"
                f", got one on {dict(ens.mesh.shape)}; make a new Feeder for another mesh"
            )
        twin = copy.copy(self)  # the data, order program and epoch order: shared
        twin.ens, twin._ahead, twin._ran, twin._shapes = ens, None, False, None
        return twin

    def _draw(self, epoch: jax.Array, members: int) -> jax.Array:
        return order_lib.epoch_order(self.order_key, epoch, self.n, members, self.cfg.bootstrap)

    def order(self, epoch: int) -> jax.Array:
        """The epoch's order of the training examples; the same on any mesh.

        Args:
          epoch: the epoch, from 1.

        Returns:
          int32 ``[N]`` (shared, replicated) or ``[members, N]`` (per member, split
          over ``ensemble``).
        """
        if self._epoch is None or self._epoch[0] != epoch:
            members = self.cfg.members if self.per_member else 0
            self._epoch = (epoch, self._orders(np.int32(epoch), members))
        return self._epoch[1]

    def host_order(self, epoch: int) -> np.ndarray:
        """:meth:`order` on the host (numpy), as the streamed path reads it once per epoch."""
        order = self.order(epoch)
        if not self.per_member:  # replicated: this process's copy is the whole order
            return np.asarray(order.addressable_data(0))
        return fetch(order)

    def input_state(self) -> dict[str, Any]:
        """What a checkpoint records of the input: ``{"input": ...}`` (the streamed
        iterator's :meth:`~meshensemble.data.stream.StreamIterator.get_state`), or ``{}``."""
        return {} if self.stream is None else {"input": self.stream.get_state()}

    def restore_input(self, loop: dict[str, Any]) -> None:
        """Puts the streamed iterator where a checkpoint's ``loop`` entry says (if it
        recorded one; otherwise :meth:`run` starts reading at the step it is asked for)."""
        if self.stream is not None and loop.get("input"):
            self.stream.set_state(loop["input"])

    def chunk(self, n: int) -> Callable[..., Any]:
        """The global program of ``n`` steps from on-device data (built once per ``n``).

        Args:
          n: steps per call.

        Returns:
          ``fn(state, images, labels, order, first) -> (state, metrics)``: steps
          ``first .. first + n - 1`` of the epoch whose ``order`` is given; ``state`` is
          donated; ``metrics["loss"]`` is ``[n, members]``. ``fn.lower(...)`` lowers it
          ahead of time (``shard_map`` backend).

        Raises:
          ValueError: the feeder streams host batches (no on-device data).
        """
        return self._program("chunk", n)

    def paced(self) -> Callable[..., Any]:
        """The global program of up to ``k`` steps whose step count is an argument.

        Built once: every call, whatever its count, runs the same compiled program, so a
        run split into shorter calls computes bitwise the same members.

        Returns:
          ``fn(state, images, labels, order, first, count) -> (state, metrics)``: steps
          ``first .. first + count - 1`` of the epoch (``count`` an int32 scalar in
          ``[1, k]``); ``metrics["loss"]`` is ``[k, members]`` whose last ``count`` rows
          are the steps run (see :func:`meshensemble.core.steps.train_chunk`).

        Raises:
          ValueError: the feeder streams host batches (no on-device data).

        Example:
          >>> ds, cfg = me.data.synthetic(64, 32, seed=0), me.TrainConfig(members=2, batch_size=32)
          >>> feeder = Feeder(ens, ds, cfg, jax.random.key(1), k=2, steps_per_epoch=2)
          >>> state, metrics = feeder.paced()(state, feeder.images, feeder.labels,
          ...                                 feeder.order(1), np.int32(0), np.int32(1))
          >>> metrics["loss"].shape   # [k, members]: the last `count` rows are the steps run
          (2, 2)
        """
        return self._program("paced", self.k, count=True)

    def _program(self, kind: str, n: int, count: bool = False) -> Callable[..., Any]:
        """:meth:`chunk` (``n`` steps) or, with ``count``, :meth:`paced` (a step count
        argument of at most ``n``): the same chunk program, built once per key."""
        if self.streaming:
            raise ValueError("a streaming Feeder has no on-device chunk; use run()")
        specs = (self.ens.state_spec, REPLICATED, REPLICATED, self._order_spec, REPLICATED)
        return self.ens.build(
            (kind, n, self.batch, self._order_spec),
            lambda step_cfg: functools.partial(steps.train_chunk, step_cfg, n, self.batch),
            specs + (REPLICATED,) * count,
            (self.ens.state_spec, metric_specs(self.ens.task, steps=True)),
            donate_argnums=(0,),
        )

    def compile_ahead(self, init: Callable[[], EnsembleState]) -> bool:
        """Starts compiling the K-step chunk in a thread, from the state's shapes.

        Meant to run while the members' initialisation compiles (XLA releases the GIL):
        :meth:`run` then calls the compiled program (the same program a lazy call would
        compile, so the results are the same). Only on the ``shard_map`` backend, in one
        process, from on-device data; elsewhere the chunk compiles at its first call.
        Once the chunk is compiled (or compiling) it is never compiled again: a second
        call, e.g. the run's after the auto-tuner timed this feeder, starts nothing.

        Args:
          init: ``() -> state``, the initialisation the run will call (only traced here,
            with ``jax.eval_shape``).

        Returns:
          Whether the compilation was started (False also when it already was, or the
          chunk has already run).

        Example:
          >>> ds, cfg = me.data.synthetic(64, 32, seed=0), me.TrainConfig(members=2, batch_size=32)
          >>> feeder = Feeder(ens, ds, cfg, jax.random.key(1), k=2, steps_per_epoch=2)
          >>> feeder.compile_ahead(lambda: ens.init(key, images[:1]))   # started
          True
          >>> state = ens.init(key, images[:1])   # both compile at once
          >>> feeder.compile_ahead(lambda: ens.init(key, images[:1]))   # never twice
          False
        """
        if self._ahead is not None or self._ran:  # compiled (or compiling) already
            return False
        shapes = self._state_shapes(init)  # first: a sharded state's layout is known after it
        chunk = None if self.streaming else self.paced() if self.dynamic else self.chunk(self.k)
        if chunk is None or not hasattr(chunk, "lower") or jax.process_count() > 1:
            return False
        width = (self.cfg.members, self.n) if self.per_member else (self.n,)
        order = jax.ShapeDtypeStruct(
            width, np.int32, sharding=NamedSharding(self.ens.mesh, self._order_spec)
        )
        args = (shapes, self.images, self.labels, order, np.int32(0))
        args += (np.int32(1),) if self.dynamic else ()
        self._ahead = precompile.start_compiling(lambda: chunk.lower(*args).compile())
        return True

    def wait_compiled(self) -> bool:
        """Waits for the chunk :meth:`compile_ahead` started, if it did.

        Returns:
          Whether a chunk compiled ahead of time is ready (False: none was started, or
          it failed to compile; :meth:`run` then compiles it at its first call).

        Example:
          >>> ds, cfg = me.data.synthetic(64, 32, seed=0), me.TrainConfig(members=2, batch_size=32)
          >>> feeder = Feeder(ens, ds, cfg, jax.random.key(1), k=2, steps_per_epoch=2)
          >>> feeder.wait_compiled()   # nothing was started
          False
        """
        # a failure (e.g. a layout it cannot take): run() compiles at the call instead
        return self._ahead is not None and self._ahead.exception() is None

    def compile_eval_ahead(
        self, init: Callable[[], EnsembleState], images: Any, labels: Any, batch_size: int
    ) -> bool:
        """Starts compiling :meth:`Ensemble.evaluate`'s program in a thread, like the chunk.

        The evaluation then runs the program compiled here (the same program, the same
        results) instead of compiling at the first epoch's end.

        Args:
          init: ``() -> state``, the initialisation the run will call (only traced).
          images: the evaluation images ``[N, ...]`` (only their shape and dtype are used).
          labels: their labels ``[N]``.
          batch_size: the ``batch_size`` the evaluation will be called with.

        Returns:
          Whether the compilation was started (not on ``pmap``, nor across processes).

        Example:
          >>> ds, cfg = me.data.synthetic(64, 32, seed=0), me.TrainConfig(members=2, batch_size=32)
          >>> feeder = Feeder(ens, ds, cfg, jax.random.key(1), k=2, steps_per_epoch=2)
          >>> init = lambda: ens.init(key, images[:1])
          >>> feeder.compile_eval_ahead(init, ds.test_images, ds.test_labels, 16)
          True
        """
        n = len(labels)
        if n == 0 or jax.process_count() > 1:
            return False
        b = self.ens.eval_batch_size(batch_size, n)
        batch = lambda a: jax.ShapeDtypeStruct((b, *np.shape(a)[1:]), np.asarray(a[:1]).dtype)
        fn = self.ens.eval_fn()
        mask = jax.ShapeDtypeStruct((b,), np.bool_)
        return fn.compile_ahead(self._state_shapes(init), batch(images), batch(labels), mask)

    def _state_shapes(self, init: Callable[[], EnsembleState]) -> Any:
        """The state's shapes with the members' sharding (traced once per feeder)."""
        if self._shapes is None:
            abstract = jax.eval_shape(init)  # a sharded state's layout is known after it
            placed = state_shardings(self.ens.state_spec, self.ens.mesh, abstract)
            self._shapes = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, placed
            )
        return self._shapes

    def _compiled(self, n: int) -> Callable[..., Any]:
        """The ahead-of-time chunk when it was built for ``n`` steps and compiled cleanly."""
        if self._ahead is not None and (n == self.k or self.dynamic):
            try:
                return self._ahead.result()
            except Exception:  # e.g. a layout it cannot take: compile at the call instead
                self._ahead = None
        return self.paced() if self.dynamic else self.chunk(n)

    def run(
        self, state: EnsembleState, epoch: int, first: int, n: int
    ) -> tuple[EnsembleState, dict[str, jax.Array]]:
        """Runs steps ``first .. first + n - 1`` of ``epoch`` (one step when streaming).

        Args:
          state: the ensemble state (donated).
          epoch: the epoch, from 1.
          first: the first step's index within the epoch, from 0.
          n: how many steps (ignored when streaming: one).

        Returns:
          ``(state, metrics)`` with ``metrics["loss"]`` of shape ``[n, members]``, or
          ``[k, members]`` when :attr:`dynamic` (its last ``n`` rows are the steps run,
          the rows before them zeros).
        """
        if self.streaming:
            return self._streamed(state, epoch, first)
        self._ran = True
        order = self.order(epoch)
        count = (np.int32(n),) if self.dynamic else ()
        return self._compiled(n)(state, self.images, self.labels, order, np.int32(first), *count)

    def _streamed(self, state: EnsembleState, epoch: int, first: int):
        """One step from this process's streamed rows, assembled into global arrays."""
        x, y = self.stream.next_batch(epoch, first)
        lead = (self.cfg.members, self.batch) if self.per_member else (self.batch,)
        sharding = NamedSharding(self.ens.mesh, MEMBER_BATCH if self.per_member else BATCH)
        place = lambda a: jax.make_array_from_process_local_data(
            sharding, a, lead + a.shape[len(lead) :]
        )
        x, y = place(x), place(y)
        shard_map = self.cfg.backend == "shard_map"  # labels were checked when the data was loaded
        step = self.ens.train_step_fn(self.per_member) if shard_map else self.ens.train_step
        state, metrics = step(state, x, y)
        return state, jax.tree.map(lambda v: v[None], metrics)


def train_targets(task: Any, labels: Any) -> np.ndarray:
    """The training targets as the steps take them: ``labels`` in the task's target dtype,
    through its ``as_targets``.

    Args:
      task: the run's :class:`meshensemble.tasks.Task`.
      labels: the targets, ``[N]`` class ids or ``[N, T]`` floats.

    Returns:
      The host array the task trains on (``[N]`` or ``[N, T]``, the task's dtype).

    Example:
      >>> train_targets(me.tasks.Classification(), [1, 2]).dtype
      dtype('int32')
    """
    return task.as_targets(np.asarray(labels).astype(task.target_dtype))


def check_lazy_input(cfg: TrainConfig, dataset: data_lib.Dataset) -> None:
    """Refuses ``--input device`` for a lazy train split (:func:`meshensemble.data.is_lazy`).

    Such a split (``--source arrayrecord``, ``--source tfds --input stream``) is meant to
    stay in its files; the on-device input would load it whole on every host.

    Args:
      cfg: the run's config (``input``).
      dataset: the run's data.

    Raises:
      meshensemble.data.DataError: one line naming the fix (``--input stream`` or ``auto``).

    Example:
      >>> check_lazy_input(me.TrainConfig(input="auto"), me.data.synthetic())  # in memory: fine
    """
    if data_lib.is_lazy(dataset) and cfg.input == "device" and not cfg.streaming:
        raise data_lib.DataError(
            f"--input device would load all {len(dataset.train_labels):,} training images of "
            f"the lazily read {dataset.source} data on every device; use --input stream (or "
            "auto), or --source npz for data that fits"
        )


def resolve_input(
    cfg: TrainConfig,
    num_train: int,
    mesh: Any,
    lazy: bool = False,
    example_bytes: int = stream_lib.EXAMPLE_BYTES,
) -> tuple[str, str]:
    """Which input a run uses, ``"device"`` or ``"stream"``, and one line saying why.

    Args:
      cfg: the run's config (``input``; the deprecated ``streaming`` means ``stream``).
      num_train: training examples.
      mesh: the run's mesh (its first device in this process is asked for its memory).
      lazy: the train split is read lazily (:func:`meshensemble.data.is_lazy`): ``auto``
        then streams.
      example_bytes: device bytes of one training example
        (:func:`meshensemble.data.stream.example_bytes`; default MNIST's).

    Returns:
      ``(input, why)``; ``auto`` is decided by
      :func:`meshensemble.data.stream.choose_input`.

    Example:
      >>> resolve_input(me.TrainConfig(input="auto"), 60_000, mesh)
      ('device', 'input: device (--input auto: 60,000 examples, 45.1 MiB/device, within ...)')
    """
    if cfg.streaming or cfg.input == "stream":
        how = "--streaming, deprecated" if cfg.streaming else "--input stream"
        return "stream", f"input: stream ({how})"
    if cfg.input == "device":
        return "device", "input: device (--input device)"
    if lazy:
        return "stream", "input: stream (--input auto: the train split is read from its files)"
    # a device of this process (memory_stats answers only for addressable devices)
    choice, why = stream_lib.choose_input(num_train, mesh.local_devices[0], example_bytes)
    return choice, f"input: {choice} (--input auto: {why})"
