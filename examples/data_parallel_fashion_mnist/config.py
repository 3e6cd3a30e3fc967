"""Default hyperparameters of the data-parallel Fashion-MNIST example."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Config:
    """Settings of one CNN trained data-parallel over the mesh's ``data`` axis.

    Attributes:
      dataset: ``"fashion_mnist"`` (or ``"mnist"``).
      source: ``"auto"``, ``"tfds"`` or ``"npz"`` (there is no embedded Fashion-MNIST
        sample, so ``auto`` needs TFDS's prepared data, the network or ``data_file``).
      data_file: a Keras-layout ``.npz`` (e.g. Keras's ``fashion-mnist`` saved with
        ``np.savez``).
      data_dir: TFDS's data folder.
      data: size of the mesh's ``data`` axis; None: every device (8 with
        ``--fake-devices 8``).
      learning_rate: SGD learning rate.
      momentum: SGD momentum.
      batch_size: global batch, split over ``data`` (each device gets
        ``batch_size / data``); a multiple of ``data``.
      num_epochs: epochs to train.
      max_steps: stop after this many steps in total (None: every epoch in full).
      seed: seeds initialisation and the batch order.
    """

    dataset: str = "fashion_mnist"
    source: str = "auto"
    data_file: str | None = None
    data_dir: str | None = None
    data: int | None = None
    learning_rate: float = 0.1
    momentum: float = 0.9
    batch_size: int = 128
    num_epochs: int = 5
    max_steps: int | None = None
    seed: int = 0


def get_config() -> Config:
    """The default config."""
    return Config()
