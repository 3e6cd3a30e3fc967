"""``meshensemble train``: its flags are generated from :class:`~meshensemble.TrainConfig`.

Every field ``name`` becomes ``--name-with-dashes`` with the type, choices and help of
its metadata and its default in the help, listed in ``--help`` under the field's group
(data, model, ensemble and mesh, optimisation, run control, multi-host, performance);
booleans are ``--flag/--no-flag`` (e.g. ``--checkpoint/--no-checkpoint``). Only
``--config``, ``--fake-devices``, ``--debug`` and the distributed flags are not fields
(each in its group too).

A command given a workdir that holds a run takes the values it does not give from the
run's ``config.json`` (except ``max_steps``, ``resume`` and ``overwrite``, which belong
to one command); :func:`meshensemble.training.train` then refuses a different run.

Example:
  >>> from meshensemble.cli import main
  >>> main(["train", "--model", "mlp", "--members", "4", "--epochs", "1", "--batch-size", "32",
  ...       "--source", "npz", "--data-file", "mnist.npz", "--workdir", "runs/x", "--quiet"])
  accuracy nll brier ece
  ...
  0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from meshensemble.cli.common import (
    DISTRIBUTED_FLAGS,
    FAILED_RUN_ERRORS,
    UsageError,
    add_debug_flag,
    add_distributed_flags,
    add_fake_devices_flag,
    add_field_flag,
    argument_group,
    error_line,
    exit_code,
    hard_exit,
    lost_peer,
    setup_devices,
    setup_distributed,
)
from meshensemble.errors import EXIT_INTERRUPTED
from meshensemble.runtime import storage
from meshensemble.training import CONFIG_FILE, TrainConfig, train
from meshensemble.training.config import GROUPS, inherited_fields, with_task_defaults

OTHER_FLAGS = ("--config", "--fake-devices", "--debug", *DISTRIBUTED_FLAGS)
"""The ``train`` flags that are not :class:`TrainConfig` fields."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Registers the ``train`` subcommand on the CLI's subparsers.

    Args:
      sub: the ``argparse`` subparsers object of ``meshensemble``.

    Returns:
      The subcommand's parser.

    Example:
      >>> from meshensemble.cli import Parser
      >>> parser = Parser(prog="meshensemble")
      >>> add_parser(parser.add_subparsers()).prog
      'meshensemble train'
      >>> parser.parse_args(["train", "--epochs", "2"]).epochs
      2
    """
    p = sub.add_parser(
        "train",
        help="train an ensemble",
        description=(
            "Train an ensemble. Every flag left out keeps the value of --config, else of "
            f"the workdir's {CONFIG_FILE} when resuming, else the default shown."
        ),
    )
    p.set_defaults(run=run)
    for title in GROUPS:  # the groups' order in --help
        argument_group(p, title)
    argument_group(p, "run control").add_argument(
        "--config", metavar="FILE", help="JSON file of TrainConfig fields; flags override it"
    )
    add_fake_devices_flag(p, "ensemble and mesh")
    for f in dataclasses.fields(TrainConfig):
        add_field_flag(p, f.name)
    add_distributed_flags(p, "multi-host")
    add_debug_flag(argument_group(p, "run control"))
    return p


def _read_config(path: str, fields: set[str], what: str) -> dict[str, Any]:
    try:
        loaded = storage.read_json(path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        msg = " ".join(str(err).split())
        raise UsageError(f"{what} {path}: cannot read JSON ({msg})") from None
    if not isinstance(loaded, dict):
        raise UsageError(f"{what} {path}: must hold a JSON object of fields")
    unknown = sorted(set(loaded) - fields - {"resolved"})
    if unknown:
        raise UsageError(
            f"{what} {path}: unknown key(s) {', '.join(unknown)}; known: "
            f"{', '.join(sorted(fields))}"
        )
    return {k: v for k, v in loaded.items() if k in fields}


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Builds a :class:`TrainConfig`: defaults, the workdir's run, ``--config FILE``, flags.

    Args:
      args: parsed ``train`` arguments.

    Returns:
      The validated config.

    Raises:
      UsageError: an unreadable config file, an unknown key in it, a bad value, or
        ``--rank`` without a ``--backbone``.

    Example:
      >>> from meshensemble.cli import build_parser
      >>> cfg = config_from_args(build_parser().parse_args(["train", "--epochs", "1"]))
      >>> cfg.epochs, cfg.members   # a flag left out keeps the field's default
      (1, 8)
    """
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    from_file = _read_config(args.config, fields, "--config") if args.config else {}
    given = from_file | {k: v for k, v in vars(args).items() if k in fields and v is not None}
    values: dict[str, Any] = {}
    saved_path = storage.join(given.get("workdir", TrainConfig.workdir), CONFIG_FILE)
    resuming = given.get("resume", True) and not given.get("overwrite", False)
    if resuming and storage.exists(saved_path):
        saved = _read_config(saved_path, fields, "workdir config")
        values = {k: v for k, v in saved.items() if k in inherited_fields()}
        task = saved.get("task", "classification")
        if given.get("task", task) != task:
            raise UsageError(
                f"workdir {given.get('workdir', TrainConfig.workdir)} holds a {task} run, "
                f"which a resumed command continues; drop --task {given['task']}, or add "
                "--overwrite or use another workdir"
            )
    values.update(given)
    values = with_task_defaults(values)  # e.g. regression's optimizer, when not given
    if getattr(args, "rank", None) is not None and not values.get("backbone"):
        raise UsageError(
            f"--rank {args.rank} is the rank of --backbone adapters, and this run has no "
            "--backbone; drop --rank, or add --backbone RUN_OR_FILE"
        )
    try:
        return TrainConfig(**values).validate()
    except (TypeError, ValueError) as err:
        raise UsageError(str(err)) from None


def run(args: argparse.Namespace) -> int:
    """Runs ``meshensemble train`` from parsed arguments.

    Returns:
      0 when the run finished or stopped on SIGTERM after saving; 130 when it stopped on
      SIGINT (Ctrl-C) after saving (the run's own line says where), so that
      ``train && evaluate`` does not carry on.

    Raises:
      UsageError, ValueError, meshensemble.data.DataError: bad input (exit 2).
      meshensemble.CheckpointError, meshensemble.training.NonFiniteError,
      meshensemble.training.OutputError: the run failed (exit 1).
    """
    cfg = config_from_args(args)
    setup_devices(args.fake_devices)
    setup_distributed(args)
    import jax

    try:
        result = train(cfg)
    except Exception as err:
        if jax.process_count() == 1:
            raise
        # Several processes: leave now with one line, instead of blocking in the
        # runtime's shutdown barrier waiting for peers that stopped or died.
        code = exit_code(err)
        if code == 2 or isinstance(err, FAILED_RUN_ERRORS):
            hard_exit(code, error_line(err))
        hard_exit(1, f"error: process {jax.process_index()}: {lost_peer(err)}")
    return EXIT_INTERRUPTED if result.signal == "SIGINT" else 0
