"""``meshensemble evaluate``: a trained run's test metrics, calibration and OOD detection.

The flags that mean a :class:`~meshensemble.TrainConfig` field (``--workdir``,
``--mesh``, ``--source``, ``--data-file``, ``--data-dir``, ``--batch-size`` as
``eval_batch_size``)
take its type, choices and help from the field's metadata.

Example:
  >>> from meshensemble.cli import main
  >>> main(["evaluate", "--workdir", "runs/tiny", "--ood", "noise"])
  data: MNIST from ...mnist.npz ...
  ...
  wrote evaluation.json, ood_histogram.png and reliability_diagram.png to runs/tiny
  0
"""

from __future__ import annotations

import argparse
from typing import Any

from meshensemble.calibration import METHODS
from meshensemble.cli.common import (
    add_device_flags,
    add_field_flag,
    add_run_flags,
    argument_group,
    resolve_checkpoint,
    setup_devices,
)
from meshensemble.evaluation import CALIBRATION_PLOT, EVALUATION_FILE, evaluate_run
from meshensemble.training.config import config_field, field_help

OOD_HELP = (
    "an OOD set of the run's task; repeat for several (classification: a shift of the test "
    "inputs: noise, inverted, contrast, hflip, vflip; fashion_mnist; or another dataset of "
    "the same input shape: a TFDS name, an image folder or an npz; default the task's own: "
    "noise and inverted)"
)
"""The help of ``--ood``."""
_SAME_NAMES = ("mesh", "num_bins", "source", "data_file", "data_dir", "ood_file", "calibrate",
               "alpha", "conformal")  # fmt: skip
"""The flags :func:`run` passes to ``evaluate_run`` under their own names."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Registers the ``evaluate`` subcommand on the CLI's subparsers.

    Args:
      sub: the ``argparse`` subparsers object of ``meshensemble``.

    Returns:
      The subcommand's parser.

    Example:
      >>> from meshensemble.cli import Parser
      >>> parser = Parser(prog="meshensemble")
      >>> add_parser(parser.add_subparsers()).prog
      'meshensemble evaluate'
      >>> parser.parse_args(["evaluate", "--workdir", "runs/tiny"]).workdir
      'runs/tiny'
    """
    p = sub.add_parser(
        "evaluate",
        help="evaluate a trained run: test metrics, calibration, OOD detection",
        description=(
            "Evaluate a trained run as its task scores it: test metrics of the ensemble and "
            "its members, what the task adds (classification: OOD detection, AUROC/AUPR of "
            "max_prob, entropy and mutual information, and the reliability diagram) and "
            f"calibration. Writes {EVALUATION_FILE} and the task's figures to the workdir."
        ),
    )
    p.set_defaults(run=run)
    run_group = add_run_flags(
        p, "the trained run's folder (config.json, checkpoints/); the results go there"
    )
    for name in ("source", "data_file", "data_dir"):
        add_field_flag(
            p,
            name,
            help=f"overrides the run's {name} (default: the data the run recorded; its "
            f"identity is checked): {field_help(config_field(name))}",
            default=None,
        )
    add = argument_group(p, "OOD detection").add_argument
    add(
        "--ood",
        action="append",
        metavar="NAME|PATH",
        help=OOD_HELP,
    )
    add("--ood-file", help="a Keras-layout Fashion-MNIST .npz for --ood fashion_mnist")
    add_calibration_flags(argument_group(p, "calibration"))
    add_device_flags(p, run_group)
    return p


def add_calibration_flags(group: Any) -> None:
    """Adds ``--calibrate``, ``--alpha``, ``--conformal`` and ``--num-bins`` to ``group``.

    Args:
      group: the parser's ``calibration`` argument group.

    Example:
      >>> from meshensemble.cli import Parser
      >>> parser = Parser(prog="meshensemble evaluate")
      >>> add_calibration_flags(parser)
      >>> parser.parse_args(["--calibrate"]).alpha
      0.1
    """
    add = group.add_argument
    add(
        "--calibrate",
        action="store_true",
        help="fit a temperature and a conformal threshold on the run's validation split "
        f"(train with --validation N); reports before/after and writes {CALIBRATION_PLOT}; "
        "for a regression run: a variance scale and a conformal interval quantile",
    )
    add(
        "--alpha",
        type=float,
        default=0.1,
        help="conformal miscoverage rate for --calibrate (default: 0.1, i.e. 90%% coverage)",
    )
    add(
        "--conformal",
        choices=METHODS,
        default="thr",
        help="conformal score for --calibrate (default: thr)",
    )
    add("--num-bins", type=int, default=15, help="calibration bins (default: 15)")


def run(args: argparse.Namespace) -> int:
    """Runs ``meshensemble evaluate`` from parsed arguments.

    Returns:
      0 on success.

    Raises:
      FileNotFoundError, ValueError, meshensemble.data.DataError: bad input (exit 2).
      meshensemble.training.OutputError: a result could not be written (exit 1).
    """
    setup_devices(args.fake_devices)
    evaluate_run(
        args.workdir,
        checkpoint=resolve_checkpoint(args.workdir, args.checkpoint),
        ood=tuple(args.ood) if args.ood else None,
        batch_size=args.eval_batch_size,
        **{name: getattr(args, name) for name in _SAME_NAMES},
    )
    return 0
