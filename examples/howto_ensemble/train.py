"""The Flax HOWTO "Ensembling on multiple devices", reworked on a device mesh.

The HOWTO trains one CNN per device with ``jax.pmap``. Here the members are stacked on a
leading axis and sharded over the mesh axis ``ensemble``; with 8 members on 8 devices
(``make_mesh(ensemble=8, data=1)``) that is exactly one member per device, as in the
HOWTO. On fewer devices the ``ensemble`` axis is a divisor of the member count and each
device holds several members. The functions keep the HOWTO's names and shape:

=====================================================  ===================================
HOWTO (pmap)                                           here (mesh)
=====================================================  ===================================
``jax.pmap(create_train_state)(split(rng, n), ...)``   ``ens.init(rng, sample)``: leaves
                                                       ``[members, ...]``, ``P('ensemble')``
``jax_utils.replicate(batch)``                         not needed: the batch is placed with
                                                       ``P('data')`` (copied over
                                                       ``ensemble``)
``jax.pmap(apply_model, axis_name='ensemble')``        ``ens.train_step`` (a ``shard_map``
then ``jax.pmap(update_model)``                        step: gradients and update at once)
``lax.pmean(probs, axis_name='ensemble')``             inside ``ens.train_step`` and
                                                       ``ens.predict``
``jax_utils.unreplicate(loss)``                        not needed: metrics are global
                                                       arrays (``loss`` is ``[members]``)
=====================================================  ===================================
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from config import Config

import meshensemble as me

MAX_IN_FLIGHT = 2
"""Steps dispatched ahead of the host. Dispatch is asynchronous, but on simulated CPU
devices XLA runs every device's collectives on one small thread pool, and dozens of
queued steps with collectives over all devices can deadlock it (XLA aborts with
"Termination timeout for all reduce"). Waiting for the step before the last keeps the
devices busy and the queue short."""


@dataclasses.dataclass
class Result:
    """What :func:`train_and_evaluate` returns.

    Attributes:
      ensemble: the ``me.Ensemble`` (its ``mesh`` is the mesh used).
      state: the final ``me.EnsembleState``; leaves ``[members, ...]``.
      history: one dict per epoch: ``epoch``, ``steps``, ``train_loss`` (mean over
        members), ``train_member_loss`` (``[members]``), ``train_accuracy`` (of the
        ensemble), ``test_loss`` and ``test_accuracy`` (of the ensemble's mean softmax).
    """

    ensemble: me.Ensemble
    state: me.EnsembleState
    history: list[dict[str, Any]]


def ensemble_axis_size(num_members: int, num_devices: int) -> int:
    """The largest divisor of ``num_members`` not above ``num_devices``.

    One member per device when there are enough devices (the HOWTO's layout), otherwise
    several members per device.
    """
    return max(d for d in range(1, min(num_members, num_devices) + 1) if num_members % d == 0)


def create_mesh(config: Config) -> jax.sharding.Mesh:
    """The mesh ``ensemble=E, data=1``: members split over devices, batches copied."""
    e = config.ensemble or ensemble_axis_size(config.num_members, jax.device_count())
    return me.make_mesh(ensemble=e, data=1)


def create_ensemble(config: Config, mesh: jax.sharding.Mesh) -> me.Ensemble:
    """The HOWTO's CNN and SGD with momentum, ``num_members`` times over ``mesh``."""
    return me.Ensemble(
        me.models.CNN(),
        optax.sgd(config.learning_rate, config.momentum),
        num_members=config.num_members,
        mesh=mesh,
        input_transform=me.data.normalize,  # uint8 pixels -> [0, 1], on device
    )


def create_train_state(ens: me.Ensemble, rng: jax.Array, sample: np.ndarray) -> me.EnsembleState:
    """HOWTO: ``jax.pmap(create_train_state)(jax.random.split(rng, n), ...)``.

    Mesh: one call. Member ``i`` is initialised with ``jax.random.split(rng, n)[i]``,
    the HOWTO's keys; its parameters and optimizer state are stacked on a leading axis
    sharded over ``ensemble`` (``P('ensemble')``), so each device holds its members.
    """
    return ens.init(rng, sample)


def train_epoch(
    ens: me.Ensemble,
    state: me.EnsembleState,
    images: np.ndarray,
    labels: np.ndarray,
    batch_size: int,
    rng: jax.Array,
    max_steps: int | None = None,
) -> tuple[me.EnsembleState, np.ndarray, float, int]:
    """One epoch over shuffled batches; every member sees the same batches (the HOWTO's).

    Returns:
      ``(state, train_member_loss [members], train_accuracy, steps)``: each member's mean
      loss, the ensemble's mean accuracy over the epoch's batches, and the steps run.
    """
    steps_per_epoch = len(images) // batch_size
    if max_steps is not None:
        steps_per_epoch = min(steps_per_epoch, max_steps)
    perms = np.asarray(jax.random.permutation(rng, len(images)))
    perms = perms[: steps_per_epoch * batch_size].reshape((steps_per_epoch, batch_size))
    epoch_metrics = []
    for perm in perms:
        # HOWTO: batch = jax_utils.replicate(batch), a copy per device, then
        # grads, loss, accuracy = apply_model(state, batch); state = update_model(state, grads)
        # Mesh: pass the host batch as is. ens.train_step places it with P('data') (split
        # over `data`, here of size 1, and copied over `ensemble`) and runs one shard_map
        # step: every member's gradients and update, and the ensemble's accuracy from
        # lax.pmean(probs, 'ensemble').
        state, metrics = ens.train_step(state, images[perm], labels[perm])
        epoch_metrics.append(metrics)  # device arrays: fetched once, after the epoch
        if len(epoch_metrics) > MAX_IN_FLIGHT:
            jax.block_until_ready(epoch_metrics[-1 - MAX_IN_FLIGHT])
    # HOWTO: jax_utils.unreplicate(loss). Mesh: metrics are global arrays already,
    # metrics["loss"] is [members] and metrics["ensemble_accuracy"] a scalar.
    fetched = jax.device_get(epoch_metrics)
    member_loss = np.mean([m["loss"] for m in fetched], axis=0)
    accuracy = float(np.mean([m["ensemble_accuracy"] for m in fetched]))
    return state, member_loss, accuracy, len(perms)


def evaluate(
    ens: me.Ensemble, state: me.EnsembleState, images: np.ndarray, labels: np.ndarray
) -> tuple[float, float]:
    """The ensemble's test loss (NLL) and accuracy.

    HOWTO: ``apply_model`` on the replicated test set, whose
    ``lax.pmean(jax.nn.softmax(logits), axis_name='ensemble')`` gives the ensemble's
    probabilities. Mesh: ``ens.predict`` does that ``pmean`` over ``ensemble`` inside
    its shard_map and returns ``[N, classes]``, no unreplicate needed.
    """
    probs = np.asarray(ens.predict(state, images))
    accuracy = float(np.mean(probs.argmax(-1) == labels))
    nll = float(-np.mean(np.log(np.maximum(probs[np.arange(len(labels)), labels], 1e-12))))
    return nll, accuracy


def train_and_evaluate(
    config: Config,
    dataset: me.data.Dataset | None = None,
    log: Callable[[str], Any] = print,
) -> Result:
    """Trains the ensemble as the HOWTO does and evaluates it after every epoch.

    Args:
      config: the run's settings (see ``config.py``).
      dataset: data to use instead of loading ``config.dataset`` from ``config.source``.
      log: where the progress lines go.

    Returns:
      A :class:`Result`.
    """
    if dataset is None:
        dataset = me.data.load_dataset(
            config.dataset, config.source, config.data_file, config.data_dir, log=log
        )
    if config.batch_size > dataset.num_train:
        raise ValueError(
            f"batch_size={config.batch_size} is larger than the {dataset.num_train} "
            "training examples; use a smaller --batch-size"
        )
    mesh = create_mesh(config)
    ens = create_ensemble(config, mesh)
    devices = mesh.devices.size
    log(
        f"mesh: ensemble={mesh.shape['ensemble']} x data={mesh.shape['data']} on {devices} "
        f"{mesh.devices.flat[0].platform} device(s), {config.num_members} members, "
        f"{ens.members_per_device} per device"
    )

    rng, init_rng = jax.random.split(jax.random.PRNGKey(config.seed))
    state = create_train_state(ens, init_rng, dataset.train_images[:1])

    history: list[dict[str, Any]] = []
    steps_left = math.inf if config.max_steps is None else config.max_steps
    for epoch in range(1, config.num_epochs + 1):
        if steps_left <= 0:
            break
        rng, input_rng = jax.random.split(rng)
        state, member_loss, train_accuracy, steps = train_epoch(
            ens,
            state,
            dataset.train_images,
            dataset.train_labels,
            config.batch_size,
            input_rng,
            max_steps=None if math.isinf(steps_left) else int(steps_left),
        )
        steps_left -= steps
        test_loss, test_accuracy = evaluate(ens, state, dataset.test_images, dataset.test_labels)
        record = {
            "epoch": epoch,
            "steps": steps,
            "train_loss": float(member_loss.mean()),
            "train_member_loss": member_loss.tolist(),
            "train_accuracy": train_accuracy,
            "test_loss": test_loss,
            "test_accuracy": test_accuracy,
        }
        history.append(record)
        log(
            f"epoch: {epoch:3d}, train_loss: {record['train_loss']:.4f}, "
            f"train_accuracy: {100 * train_accuracy:.2f}, test_loss: {test_loss:.4f}, "
            f"test_accuracy: {100 * test_accuracy:.2f}"
        )
    return Result(ens, state, history)
