"""Data-parallel training of one CNN on Fashion-MNIST: the mesh ``ensemble=1, data=N``.

The well-known multi-device recipe (8 fake CPU devices and ``jax.pmap``) replicates the
parameters on every device, reshapes each batch to ``[devices, B / devices, ...]`` and
averages the gradients with ``lax.pmean(grads, axis_name)`` inside the pmapped update.
On a mesh the same program is an ensemble of one member on ``make_mesh(ensemble=1,
data=N)``:

=====================================================  ===================================
pmap recipe                                            here (mesh)
=====================================================  ===================================
``params = jax_utils.replicate(init(rng))``            ``ens.init(rng, sample)``: one
                                                       member, ``[1, ...]`` on
                                                       ``P('ensemble')``; the ``ensemble``
                                                       axis has size 1, so every device
                                                       holds it whole (replicated over
                                                       ``data``)
``x.reshape(devices, B // devices, ...)``              ``ens.place(x)``: ``[B, ...]`` with
                                                       ``P('data')``, each device holds
                                                       ``B / N`` rows, no reshape
``jax.pmap(update, axis_name='batch')`` with           ``ens.train_step``: a ``shard_map``
``grads = lax.pmean(grads, 'batch')``                  step that averages the gradients
                                                       over ``data``
``jax_utils.unreplicate(params)``                      not needed: ``state`` is one global
                                                       array per leaf
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
queued steps, each with an all-reduce over all 8 devices, can deadlock it (XLA aborts
with "Termination timeout for all reduce"). Waiting for the step before the last keeps
the devices busy and the queue short."""


@dataclasses.dataclass
class Result:
    """What :func:`train_and_evaluate` returns.

    Attributes:
      model: the one-member ``me.Ensemble`` (its ``mesh`` is ``ensemble=1, data=N``).
      state: the final ``me.EnsembleState``; leaves ``[1, ...]``.
      history: one dict per epoch: ``epoch``, ``steps``, ``train_loss``,
        ``train_accuracy``, ``test_loss`` (NLL) and ``test_accuracy``.
    """

    model: me.Ensemble
    state: me.EnsembleState
    history: list[dict[str, Any]]


def create_mesh(config: Config) -> jax.sharding.Mesh:
    """The data-parallel mesh: ``ensemble=1`` and every device (or ``config.data``) on
    ``data``."""
    return me.make_mesh(ensemble=1, data=config.data or jax.device_count())


def create_model(config: Config, mesh: jax.sharding.Mesh) -> me.Ensemble:
    """ONE CNN (``num_members=1``) with SGD and momentum, trained over ``mesh``."""
    return me.Ensemble(
        me.models.CNN(),
        optax.sgd(config.learning_rate, config.momentum),
        num_members=1,
        mesh=mesh,
        input_transform=me.data.normalize,  # uint8 pixels -> [0, 1], on device
    )


def train_step(
    model: me.Ensemble, state: me.EnsembleState, images: np.ndarray, labels: np.ndarray
) -> tuple[me.EnsembleState, dict[str, jax.Array]]:
    """One data-parallel step.

    pmap recipe: reshape the batch to ``[devices, B / devices, ...]`` and call the
    pmapped ``update``, where ``lax.pmean(grads, 'batch')`` averages the devices'
    gradients. Mesh: place the ``[B, ...]`` batch with ``P('data')`` and call
    ``train_step``; its shard_map step computes each device's gradients on its
    ``B / N`` rows and averages them over ``data`` before the optimizer update, so every
    device applies the same update to the same parameters.
    """
    images, labels = model.place(images), model.place(labels)
    return model.train_step(state, images, labels)


def train_epoch(
    model: me.Ensemble,
    state: me.EnsembleState,
    images: np.ndarray,
    labels: np.ndarray,
    batch_size: int,
    rng: jax.Array,
    max_steps: int | None = None,
) -> tuple[me.EnsembleState, float, float, int]:
    """One epoch over shuffled batches; returns ``(state, loss, accuracy, steps)``."""
    steps = len(images) // batch_size
    if max_steps is not None:
        steps = min(steps, max_steps)
    perms = np.asarray(jax.random.permutation(rng, len(images)))
    perms = perms[: steps * batch_size].reshape((steps, batch_size))
    epoch_metrics = []
    for perm in perms:
        state, metrics = train_step(model, state, images[perm], labels[perm])
        epoch_metrics.append(metrics)  # device arrays: fetched once, after the epoch
        if len(epoch_metrics) > MAX_IN_FLIGHT:
            jax.block_until_ready(epoch_metrics[-1 - MAX_IN_FLIGHT])
    fetched = jax.device_get(epoch_metrics)
    loss = float(np.mean([m["loss"][0] for m in fetched]))  # "loss" is [members] = [1]
    accuracy = float(np.mean([m["accuracy"][0] for m in fetched]))
    return state, loss, accuracy, steps


def evaluate(
    model: me.Ensemble, state: me.EnsembleState, images: np.ndarray, labels: np.ndarray
) -> tuple[float, float]:
    """Test loss (NLL) and accuracy, computed on the mesh.

    ``evaluate`` streams the test set in batches split over ``data`` and sums the
    statistics with ``lax.psum`` over ``data``: the pmap recipe's ``pmap`` of the
    evaluation and mean over devices.
    """
    ev = model.evaluate(state, images, labels)
    return ev["nll"], ev["accuracy"]


def train_and_evaluate(
    config: Config,
    dataset: me.data.Dataset | None = None,
    log: Callable[[str], Any] = print,
) -> Result:
    """Trains one CNN data-parallel and evaluates it after every epoch.

    Args:
      config: the run's settings (see ``config.py``).
      dataset: data to use instead of loading ``config.dataset`` from ``config.source``.
      log: where the progress lines go.

    Returns:
      A :class:`Result`.

    Raises:
      ValueError: the batch does not split evenly over ``data``, or is larger than the
        training set (``me.data.DataError``, a ``ValueError``, for missing data).
    """
    if dataset is None:
        dataset = me.data.load_dataset(
            config.dataset, config.source, config.data_file, config.data_dir, log=log
        )
    mesh = create_mesh(config)
    n = mesh.shape["data"]
    if config.batch_size % n or config.batch_size > dataset.num_train:
        raise ValueError(
            f"batch_size={config.batch_size} must be a multiple of the data axis ({n}) and "
            f"at most the {dataset.num_train} training examples"
        )
    model = create_model(config, mesh)
    log(
        f"mesh: ensemble=1 x data={n} on {n} {mesh.devices.flat[0].platform} device(s): "
        f"1 CNN, batch {config.batch_size} split into {n} x {config.batch_size // n}, "
        "gradients averaged over data"
    )

    rng, init_rng = jax.random.split(jax.random.PRNGKey(config.seed))
    state = model.init(init_rng, dataset.train_images[:1])

    history: list[dict[str, Any]] = []
    steps_left = math.inf if config.max_steps is None else config.max_steps
    for epoch in range(1, config.num_epochs + 1):
        if steps_left <= 0:
            break
        rng, input_rng = jax.random.split(rng)
        state, train_loss, train_accuracy, steps = train_epoch(
            model,
            state,
            dataset.train_images,
            dataset.train_labels,
            config.batch_size,
            input_rng,
            max_steps=None if math.isinf(steps_left) else int(steps_left),
        )
        steps_left -= steps
        test_loss, test_accuracy = evaluate(model, state, dataset.test_images, dataset.test_labels)
        record = {
            "epoch": epoch,
            "steps": steps,
            "train_loss": train_loss,
            "train_accuracy": train_accuracy,
            "test_loss": test_loss,
            "test_accuracy": test_accuracy,
        }
        history.append(record)
        log(
            f"epoch: {epoch:3d}, train_loss: {train_loss:.4f}, train_accuracy: "
            f"{100 * train_accuracy:.2f}, test_loss: {test_loss:.4f}, test_accuracy: "
            f"{100 * test_accuracy:.2f}"
        )
    return Result(model, state, history)
