"""Trains the Flax HOWTO's ensemble on a device mesh.

    python examples/howto_ensemble/main.py --fake-devices 8 --num-epochs 3

See README.md in this folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

import config as config_lib
import train

import meshensemble as me


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; every flag left out keeps the value of ``config.py``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--fake-devices", type=int, metavar="N", help="simulate N CPU devices (e.g. 8)")
    add("--dataset", choices=me.data.DATASETS)
    add("--source", choices=me.data.SOURCES, help="where the data comes from (default auto)")
    add("--data-file", help="a Keras-layout .npz (x_train, y_train, x_test, y_test)")
    add("--data-dir", help="TFDS data folder")
    add("--num-members", type=int, help="ensemble size (default 8)")
    add("--ensemble", type=int, help="mesh ensemble axis (default: one member per device)")
    add("--learning-rate", type=float)
    add("--momentum", type=float)
    add("--batch-size", type=int)
    add("--num-epochs", type=int)
    add("--max-steps", type=int, help="stop after this many steps in total")
    add("--seed", type=int)
    return p.parse_args(argv)


def get_config(args: argparse.Namespace) -> config_lib.Config:
    """``config.py``'s defaults, overridden by the flags given."""
    fields = {f.name for f in dataclasses.fields(config_lib.Config)}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    return dataclasses.replace(config_lib.get_config(), **given)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the example; returns the exit code (2 for bad input or missing data)."""
    args = parse_args(argv)
    if args.fake_devices is not None:
        # Before any JAX computation: JAX fixes its device count when it first starts.
        me.use_fake_cpu_devices(args.fake_devices)
    try:
        train.train_and_evaluate(get_config(args))
    except ValueError as err:  # includes me.data.DataError
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
