"""Default hyperparameters: those of the Flax HOWTO "Ensembling on multiple devices"."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Config:
    """The HOWTO's settings, plus where the data comes from and the mesh.

    Attributes:
      dataset: ``"mnist"`` or ``"fashion_mnist"``.
      source: ``"auto"``, ``"tfds"``, ``"npz"`` or ``"sample"`` (see
        ``me.data.load_dataset``).
      data_file: a Keras-layout ``.npz`` for sources ``npz`` and ``auto``.
      data_dir: TFDS's data folder.
      num_members: ensemble size; the HOWTO has one member per device (8 on 8 devices).
      ensemble: size of the mesh's ``ensemble`` axis; None: the largest divisor of
        ``num_members`` that the devices allow (8 on 8 devices, as in the HOWTO).
      learning_rate: SGD learning rate.
      momentum: SGD momentum.
      batch_size: examples per step, the same batch for every member.
      num_epochs: epochs to train.
      max_steps: stop after this many steps in total (None: run every epoch in full).
      seed: seeds the members' initialisation and the batch order.
    """

    dataset: str = "mnist"
    source: str = "auto"
    data_file: str | None = None
    data_dir: str | None = None
    num_members: int = 8
    ensemble: int | None = None
    learning_rate: float = 0.1
    momentum: float = 0.9
    batch_size: int = 128
    num_epochs: int = 10
    max_steps: int | None = None
    seed: int = 0


def get_config() -> Config:
    """The default config."""
    return Config()
