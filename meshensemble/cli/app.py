"""The ``meshensemble`` command line: ``train`` (and the subcommands other modules add).

Every bad value gets one line on stderr naming the value and what is allowed, and exit
code 2, before anything is written to the workdir.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from meshensemble.models import REGISTRY
from meshensemble.models.conv import CONV_CHOICES
from meshensemble.training import (
    OPTIMIZERS,
    PRECISIONS,
    SCHEDULES,
    SHUFFLES,
    TrainConfig,
)


class UsageError(ValueError):
    """A bad command-line value; the CLI prints it on one line and exits 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        raise UsageError(f"{self.prog}: {message}")


def _train_parser(sub: Any) -> None:
    p = sub.add_parser("train", help="train an ensemble", description="Train an ensemble.")
    p.set_defaults(run=_run_train)
    add = p.add_argument
    add("--config", help="JSON file of TrainConfig fields; flags override it")
    add("--dataset", choices=("mnist", "fashion_mnist"))
    add("--source", choices=("auto", "tfds", "npz", "sample"))
    add("--data-file", help="a Keras-layout .npz (x_train, y_train, x_test, y_test)")
    add("--data-dir", help="TFDS data folder")
    add("--model", choices=tuple(REGISTRY))
    add("--members", type=int, help="ensemble size (default 8)")
    add("--mesh", help="e.g. ensemble=4,data=2 (default: all devices, members first)")
    add("--fake-devices", type=int, metavar="N", help="N simulated CPU devices (CPU platform)")
    add("--backend", choices=("shard_map", "pmap"))
    add("--member-strategy", choices=("auto", "vmap", "loop"))
    add("--conv", choices=CONV_CHOICES, help="CNN convolutions (default auto: im2col on CPU)")
    add("--precision", choices=tuple(PRECISIONS), help="bf16: bfloat16 compute, fp32 weights")
    add("--epochs", type=int)
    add("--batch-size", type=int)
    add("--optimizer", choices=OPTIMIZERS)
    add("--learning-rate", type=float)
    add("--momentum", type=float)
    add("--weight-decay", type=float)
    add("--schedule", choices=SCHEDULES)
    add("--warmup-epochs", type=float)
    add("--shuffle", choices=SHUFFLES)
    add("--seed", type=int)
    add("--max-steps", type=int, help="total steps of the run; stops there and evaluates")
    add("--chunk-steps", type=int, help="steps per compiled call (default: per platform)")
    add("--eval-batch-size", type=int)
    add("--streaming", action="store_true", default=None, help="feed host batches")
    add("--workdir", help="output folder (default runs/mnist)")
    add("--tensorboard", action="store_true", default=None, help="write TensorBoard events")
    add("--no-checkpoint", dest="checkpoint", action="store_false", default=None)
    add("--checkpoint-every", type=int, metavar="N", help="also save every N steps")
    add("--keep", type=int, metavar="K", help="checkpoints to keep (default 3)")
    add(
        "--no-resume",
        dest="resume",
        action="store_false",
        default=None,
        help="start over even if the workdir holds a run (needs --overwrite then)",
    )
    add("--overwrite", action="store_true", default=None, help="delete the workdir's run first")
    add("--on-nonfinite", choices=("stop", "reinit"), help="what a NaN/inf loss does")
    add("--quiet", action="store_true", default=None, help="print only the final table")
    add_distributed_flags(p)


def add_distributed_flags(p: argparse.ArgumentParser) -> None:
    """Adds the flags that run a command as one process of many.

    Args:
      p: a subcommand's parser.

    Example:
      >>> add_distributed_flags(parser)
    """
    add = p.add_argument
    add("--coordinator", metavar="HOST:PORT", help="process 0's coordinator (multi-process)")
    add("--num-processes", type=int, metavar="N", help="number of processes")
    add("--process-id", type=int, metavar="I", help="this process's id in [0, N)")
    add(
        "--heartbeat-timeout",
        type=int,
        default=None,
        metavar="S",
        help="seconds before a silent peer counts as dead (default 10)",
    )
    add(
        "--distributed-auto",
        action="store_true",
        help="let JAX detect the cluster (TPU pod, SLURM) and initialise from it",
    )


def setup_distributed(args: argparse.Namespace) -> None:
    """Starts the multi-process runtime from ``--coordinator`` etc. or the environment.

    Args:
      args: parsed arguments with the flags of :func:`add_distributed_flags`.

    Raises:
      UsageError: an incomplete or inconsistent set of values.

    Example:
      >>> setup_distributed(args)
    """
    from meshensemble.core import distributed

    try:
        distributed.initialize(
            args.coordinator,
            args.num_processes,
            args.process_id,
            args.heartbeat_timeout or distributed.DEFAULT_HEARTBEAT_TIMEOUT,
            auto=args.distributed_auto,
        )
    except ValueError as err:
        raise UsageError(str(err)) from None


def build_parser() -> argparse.ArgumentParser:
    """The ``meshensemble`` argument parser.

    Returns:
      An ``argparse.ArgumentParser`` with the subcommands.

    Example:
      >>> build_parser().parse_args(["train", "--members", "4"]).members
      4
    """
    parser = _Parser(prog="meshensemble", description="Deep ensembles on a JAX device mesh.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _train_parser(sub)
    from meshensemble import evaluation as evaluate
    from meshensemble.cli import bench

    evaluate.add_parser(sub)
    bench.add_parser(sub)
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Builds a :class:`TrainConfig`: defaults, then ``--config FILE``, then flags.

    Args:
      args: parsed ``train`` arguments.

    Returns:
      The validated config.

    Raises:
      UsageError: an unreadable config file, an unknown key in it, or a bad value.

    Example:
      >>> cfg = config_from_args(build_parser().parse_args(["train", "--epochs", "1"]))
    """
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    from_file: dict[str, Any] = {}
    if args.config:
        from_file = _read_config(args.config, fields, "--config")
    given = from_file | {k: v for k, v in vars(args).items() if k in fields and v is not None}
    values: dict[str, Any] = {}
    workdir = given.get("workdir", TrainConfig.workdir)
    saved_path = os.path.join(workdir, "config.json")
    resuming = given.get("resume", True) and not given.get("overwrite", False)
    if resuming and os.path.exists(saved_path):
        values = _read_config(saved_path, fields, "workdir config")
        for name in IDENTITY_FIELDS:
            if name in given and name in values and given[name] != values[name]:
                raise UsageError(
                    f"workdir {workdir} holds a run with {name}={values[name]!r}, but this "
                    f"command says {name}={given[name]!r}; resume with the same value, or add "
                    "--overwrite, or use another --workdir"
                )
    values.update(given)
    try:
        return TrainConfig(**values).validate()
    except (TypeError, ValueError) as err:
        raise UsageError(str(err)) from None


IDENTITY_FIELDS = (
    "dataset",
    "model",
    "members",
    "optimizer",
    "learning_rate",
    "momentum",
    "weight_decay",
    "schedule",
    "warmup_epochs",
    "shuffle",
    "seed",
    "batch_size",
)
"""Fields a resumed run must keep: they define the members and their data order."""


def _read_config(path: str, fields: set[str], what: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            loaded = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise UsageError(f"{what} {path}: cannot read JSON ({err})") from None
    if not isinstance(loaded, dict):
        raise UsageError(f"{what} {path}: must hold a JSON object of fields")
    unknown = sorted(set(loaded) - fields - {"resolved"})
    if unknown:
        raise UsageError(
            f"{what} {path}: unknown key(s) {', '.join(unknown)}; known: "
            f"{', '.join(sorted(fields))}"
        )
    return {k: v for k, v in loaded.items() if k in fields}


def setup_devices(fake_devices: int | None) -> None:
    """Applies ``--fake-devices N`` (N simulated CPU devices) before JAX starts.

    Args:
      fake_devices: the flag's value, or None to leave the platform alone.

    Raises:
      UsageError: ``fake_devices`` is not positive.

    Example:
      >>> setup_devices(8)
    """
    if fake_devices is None:
        return
    if fake_devices < 1:
        raise UsageError(f"--fake-devices {fake_devices} must be a positive integer")
    from meshensemble.core.mesh import use_fake_cpu_devices

    use_fake_cpu_devices(fake_devices)


def _run_train(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    setup_devices(args.fake_devices)
    setup_distributed(args)
    import jax

    from meshensemble.training import train

    try:
        train(cfg)
    except Exception as err:
        if jax.process_count() == 1:
            raise
        # Several processes: leave now with one line, instead of blocking in the
        # runtime's shutdown barrier waiting for peers that stopped or died.
        from meshensemble.core import distributed
        from meshensemble.data import DataError

        if isinstance(err, UsageError | ValueError | DataError | FileNotFoundError):
            distributed.hard_exit(2, f"error: {err}")
        if type(err).__name__ in ("CheckpointError", "NonFiniteError"):
            distributed.hard_exit(1, f"error: {err}")
        distributed.hard_exit(1, f"error: process {jax.process_index()}: {lost_peer(err)}")
    return 0


def lost_peer(err: BaseException) -> str:
    """One line about a failed multi-process collective, naming the lost process if known.

    Args:
      err: the exception raised in the survivor.

    Returns:
      A one-line description.

    Example:
      >>> lost_peer(RuntimeError("... /job:jax_worker/replica:0/task:1 ..."))
      'lost contact with process 1 (RuntimeError); ...'
    """
    import re

    text = str(err)
    found = sorted({int(m) for m in re.findall(r"task[:_ ]\s*(\d+)", text, re.IGNORECASE)})
    who = f"process {', '.join(map(str, found))}" if found else "a peer process"
    first = text.strip().splitlines()[0][:160] if text.strip() else type(err).__name__
    return (
        f"lost contact with {who} ({type(err).__name__}: {first}); the run stopped, "
        "resume it from the last checkpoint once all processes are back"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``meshensemble`` console script.

    Args:
      argv: arguments (default ``sys.argv[1:]``).

    Returns:
      The exit code: 0 on success, 2 for bad input.

    Example:
      >>> main(["train", "--source", "sample", "--epochs", "1", "--workdir", "/tmp/run"])
      0
    """
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    logging.getLogger("absl").setLevel(logging.WARNING)
    from meshensemble.data import DataError

    try:
        args = build_parser().parse_args(argv)
        return int(args.run(args) or 0)
    except (UsageError, DataError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # CheckpointError, NonFiniteError: the run failed
        if type(err).__name__ not in ("CheckpointError", "NonFiniteError"):
            raise
        if type(err).__name__ == "CheckpointError":
            # orbax's background threads may still hold the failed write: leave without
            # their teardown noise, the one line being the last thing printed
            from meshensemble.core.distributed import hard_exit

            hard_exit(1, f"error: {err}")
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
