"""``meshensemble predict``: a trained run's predictions on new inputs, to ``.npz`` or ``.csv``.

One path for every task: reads a ``.npy`` (memory-mapped), a ``.npz`` or (for images) a
folder of PNG/JPEG images (:func:`meshensemble.serving.open_inputs`), streams it through
the run's ensemble on this machine's devices (:meth:`meshensemble.Predictor.outputs`: what
the run's task serves) and writes the result atomically
(:func:`meshensemble.serving.outputs.write_predictions`). Every bad value is refused in one
line before anything is written.

Example:
  >>> from meshensemble.cli import main
  >>> np.save("new.npy", images[:12])   # uint8 [N, 28, 28, 1]
  >>> main(["predict", "--workdir", "runs/tiny", "--input", "new.npy", "--out", "p.npz"])
  wrote 12 predictions (probs, label, ...) to p.npz: checkpoint 4 of runs/tiny, ...
  0
  >>> np.load("p.npz")["probs"].shape
  (12, 10)
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from meshensemble.cli.common import (
    add_device_flags,
    add_run_flags,
    argument_group,
    resolve_checkpoint,
    setup_devices,
)
from meshensemble.serving.inputs import open_inputs
from meshensemble.serving.outputs import check_out_file, write_predictions
from meshensemble.serving.predictor import load_predictor, read_calibration
from meshensemble.training.checkpoint import list_checkpoints
from meshensemble.training.identity import read_saved_config
from meshensemble.training.outputs import note_output
from meshensemble.training.restore import load_run_config, run_identity, run_task

PROGRESS_MIN = 10_000
"""Inputs of at least this many images show a progress bar on stderr (unless ``--quiet``)."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Registers the ``predict`` subcommand on the CLI's subparsers.

    Args:
      sub: the ``argparse`` subparsers object of ``meshensemble``.

    Returns:
      The subcommand's parser.

    Example:
      >>> from meshensemble.cli import Parser
      >>> parser = Parser(prog="meshensemble")
      >>> add_parser(parser.add_subparsers()).prog
      'meshensemble predict'
      >>> argv = ["predict", "--workdir", "runs/tiny", "--input", "new.npy", "--out", "p.npz"]
      >>> parser.parse_args(argv).input
      'new.npy'
    """
    p = sub.add_parser(
        "predict",
        help="predict new inputs with a trained run: what its task serves",
        description=(
            "Predict new inputs with a trained run: what its task serves (classification: "
            "the ensemble's probabilities, label, confidence, entropy, mutual information "
            "and conformal prediction sets; regression: the mixture's mean, variance and its "
            "parts, and conformal intervals), calibrated when `evaluate --calibrate` fitted "
            "a calibration for this very run. Writes a .npz (arrays) or a .csv (a row each)."
        ),
    )
    p.set_defaults(run=run)
    run_group = add_run_flags(p, "the trained run's folder (read only)")
    add = argument_group(p, "inputs and outputs").add_argument
    add(
        "--input",
        required=True,
        metavar="PATH",
        help="a .npy or .npz (key images, x_test or x) of inputs of the run's shape (uint8 "
        "images [N, H, W(, C)] or features [N, F]), or a folder of PNG/JPEG images (sorted "
        "by name); for a regression run a .npy or .npz (key x, x_test or features)",
    )
    add("--out", required=True, metavar="FILE", help="the output: FILE.npz or FILE.csv")
    add(
        "--members",
        action="store_true",
        help="also write member_probs [members, N, classes] (regression: member_mean, "
        "member_variance [members, N, T]); .npz outputs only",
    )
    add("--quiet", action="store_true", help="no progress bar and no summary line")
    add = argument_group(p, "calibration").add_argument
    add(
        "--no-temperature",
        action="store_true",
        help="write the uncalibrated probs (sets still use the calibrated ones)",
    )
    add(
        "--no-variance-scale",
        action="store_true",
        help="regression runs: write the uncalibrated variances (intervals still use the "
        "calibrated ones)",
    )
    add(
        "--sets",
        action="store_true",
        help="require prediction sets, or a regression run's conformal intervals (fails if "
        "uncalibrated)",
    )
    add_device_flags(p, run_group)
    return p


def run(args: argparse.Namespace) -> int:
    """Runs ``meshensemble predict`` from parsed arguments.

    Returns:
      0 on success.

    Raises:
      FileNotFoundError, ValueError: bad input (exit 2), before anything is written.
      meshensemble.CheckpointError: no readable checkpoint (exit 1).
      meshensemble.training.OutputError: the output could not be written (exit 1).
    """
    setup_devices(args.fake_devices)
    check_out_file(args.out, args.input)
    if args.members and args.out.lower().endswith(".csv"):
        raise ValueError(
            f"--members writes every member's arrays [members, N, ...], which {args.out} "
            "(one row per example) cannot hold; use --out FILE.npz, or drop --members"
        )
    cfg = load_run_config(args.workdir)
    args.checkpoint = resolve_checkpoint(args.workdir, args.checkpoint)
    task = run_task(cfg, (read_saved_config(args.workdir) or {}).get("resolved") or {})
    for flag in ("no_temperature", "no_variance_scale"):
        if getattr(args, flag) and flag != task.uncalibrated_flag:
            raise ValueError(
                f"--{flag.replace('_', '-')} does not apply to {args.workdir}, a {task.name} "
                "run; drop it"
            )
    if args.sets:  # before restoring: the newest (or named) checkpoint must be calibrated
        steps = list_checkpoints(args.workdir)
        step = args.checkpoint if args.checkpoint is not None else max(steps, default=None)
        if step is not None:
            ident = run_identity(args.workdir, cfg, step)
            cal, why = read_calibration(args.workdir, task, step, ident)
            if cal is None:
                raise ValueError(f"no {task.conformal_name}: {why}")
    notes: list[str] = []  # said once the restore succeeded (a damaged checkpoint skipped...)
    predictor = load_predictor(
        args.workdir, args.mesh, checkpoint=args.checkpoint, batch_size=args.eval_batch_size,
        echo=notes.append,
    )  # fmt: skip
    for line in notes:
        print(line, file=sys.stderr)
    x = open_inputs(args.input, predictor.input_shape, predictor.input_dtype)
    if args.sets:
        predictor.check_sets()
    from tqdm import tqdm

    quiet = args.quiet or len(x) < PROGRESS_MIN
    with tqdm(total=len(x), unit="ex", file=sys.stderr, disable=quiet, leave=False) as bar:
        out = predictor.outputs(
            x, members=args.members, calibrated=not (args.no_temperature or args.no_variance_scale),
            sets=True if args.sets else None, progress=bar.update,
        )  # fmt: skip
    write_predictions(args.out, out, getattr(x, "names", None), task.csv_keys(out))
    note_output(args.workdir, args.out)  # inside the run's folder: train --overwrite removes it
    if not args.quiet:
        print(summary(predictor, out, args))
    return 0


def summary(predictor: Any, out: dict[str, Any], args: argparse.Namespace) -> str:
    """The line ``predict`` prints: what was written, from which checkpoint, calibrated or not.

    Example:
      >>> predictor = me.load_predictor("runs/tiny")
      >>> out = predictor.outputs(images[:12])
      >>> args = argparse.Namespace(out="p.npz", workdir="runs/tiny", no_temperature=False,
      ...                           no_variance_scale=False)
      >>> summary(predictor, out, args)
      'wrote 12 predictions (probs, label, ...) to p.npz: checkpoint 4 of runs/tiny, ...'
    """
    cal, off = predictor.calibration, args.no_temperature or args.no_variance_scale
    how = "uncalibrated" if cal is None else predictor.task.calibration_summary(cal, not off, out)
    n = len(next(iter(out.values()), []))
    return (
        f"wrote {n} predictions ({', '.join(out)}) to {args.out}: checkpoint "
        f"{predictor.step} of {args.workdir}, {how}"
    )
