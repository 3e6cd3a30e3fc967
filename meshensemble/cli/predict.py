"""``meshensemble predict``: a trained run's predictions on new images, to ``.npz`` or ``.csv``.

Reads a ``.npy`` (memory-mapped), a ``.npz`` or a folder of PNG/JPEG images
(:func:`meshensemble.serving.open_images`), streams it through the run's ensemble on this
machine's devices (:meth:`meshensemble.Predictor.outputs`) and writes the result
atomically (:func:`meshensemble.serving.outputs.write_predictions`). Every bad value is
refused in one line before anything is written.

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
    add_debug_flag,
    add_fake_devices_flag,
    add_field_flag,
    setup_devices,
)
from meshensemble.evaluation import load_run_config
from meshensemble.serving.inputs import open_features, open_images
from meshensemble.serving.outputs import check_out_file, write_predictions
from meshensemble.serving.predictor import IMAGE_DTYPE, load_predictor, read_calibration
from meshensemble.training.checkpoint import list_checkpoints
from meshensemble.training.config import config_field, field_help

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
        help="predict new images with a trained run: probabilities, uncertainty, sets",
        description=(
            "Predict new images with a trained run: the ensemble's probabilities "
            "(calibrated when `evaluate --calibrate` was run), label, confidence, entropy, "
            "mutual information and, for a calibrated run, conformal prediction sets. "
            "Writes a .npz (arrays) or a .csv (one row per image)."
        ),
    )
    p.set_defaults(run=run)
    add = p.add_argument
    add_field_flag(p, "workdir", required=True, help="the trained run's folder (read only)")
    add(
        "--input",
        required=True,
        metavar="PATH",
        help="a .npy or .npz (key images, x_test or x) of uint8 images [N, 28, 28(, 1)], "
        "or a folder of PNG/JPEG images (sorted by name); for a regression run a .npy or "
        ".npz (key x, x_test or features) of features [N, F]",
    )
    add("--out", required=True, metavar="FILE", help="the output: FILE.npz or FILE.csv")
    add(
        "--members",
        action="store_true",
        help="also write member_probs [members, N, classes] (regression: member_mean, "
        "member_variance [members, N, T]); .npz outputs only",
    )
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
    add("--checkpoint", type=int, metavar="STEP", help="checkpoint step (default: the latest)")
    add_fake_devices_flag(p)
    add_field_flag(p, "mesh", help=field_help(config_field("mesh")) + " (may differ from training)")
    add_field_flag(p, "eval_batch_size", flag="--batch-size", default=1000)
    add("--quiet", action="store_true", help="no progress bar and no summary line")
    add_debug_flag(p)
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
    regression = load_run_config(args.workdir).task == "regression"
    wrong = "--no-temperature" if regression else "--no-variance-scale"
    if args.no_temperature if regression else args.no_variance_scale:
        kind = "regression" if regression else "classification"
        raise ValueError(f"{wrong} does not apply to {args.workdir}, a {kind} run; drop it")
    if regression:
        return run_regression(args)
    from meshensemble.data import IMAGE_SHAPE

    images = open_images(args.input, IMAGE_SHAPE, IMAGE_DTYPE)
    if args.sets:  # before restoring: the newest (or named) checkpoint must be calibrated
        steps = list_checkpoints(args.workdir)
        step = args.checkpoint if args.checkpoint is not None else max(steps, default=None)
        cal, why = read_calibration(args.workdir, step) if step is not None else (1, "")
        if cal is None:
            raise ValueError(f"no prediction sets: {why}")
    notes: list[str] = []  # a damaged checkpoint skipped: said once the restore succeeded
    predictor = load_predictor(
        args.workdir,
        args.mesh,
        checkpoint=args.checkpoint,
        batch_size=args.eval_batch_size,
        echo=notes.append,
    )
    for line in notes:
        print(line, file=sys.stderr)
    if args.sets:
        predictor.check_sets()
    from tqdm import tqdm

    quiet = args.quiet or len(images) < PROGRESS_MIN
    with tqdm(total=len(images), unit="img", file=sys.stderr, disable=quiet, leave=False) as bar:
        out = predictor.outputs(
            images,
            members=args.members,
            temperature=not args.no_temperature,
            sets=True if args.sets else None,
            progress=bar.update,
        )
    write_predictions(args.out, out, images.names)
    if not args.quiet:
        print(summary(predictor, out, args))
    return 0


def run_regression(args: argparse.Namespace) -> int:
    """``meshensemble predict`` on a regression run: features in, the mixture's moments out.

    Writes ``mean``, ``variance``, ``aleatoric``, ``epistemic`` ``[N, T]`` (variances
    scaled when calibrated, unless ``--no-variance-scale``), ``lower``/``upper`` when
    calibrated, ``member_mean``/``member_variance`` with ``--members``.

    Returns:
      0 on success.
    """
    notes: list[str] = []
    predictor = load_predictor(
        args.workdir,
        args.mesh,
        checkpoint=args.checkpoint,
        batch_size=args.eval_batch_size,
        echo=notes.append,
    )
    for line in notes:
        print(line, file=sys.stderr)
    x = open_features(args.input, predictor.num_features)
    if args.sets:
        predictor.check_intervals()
    from tqdm import tqdm

    quiet = args.quiet or len(x) < PROGRESS_MIN
    with tqdm(total=len(x), unit="row", file=sys.stderr, disable=quiet, leave=False) as bar:
        out = predictor.outputs(
            x,
            members=args.members,
            scale=not args.no_variance_scale,
            intervals=True if args.sets else None,
            progress=bar.update,
        )
    write_predictions(args.out, out)
    if not args.quiet:
        cal = predictor.calibration
        how = "uncalibrated"
        if cal is not None:
            s = "not applied" if args.no_variance_scale else "applied"
            how = f"variance scale {cal.variance_scale:.4g} {s}, intervals at alpha={cal.alpha:g}"
        print(
            f"wrote {len(x)} predictions ({', '.join(out)}) to {args.out}: checkpoint "
            f"{predictor.step} of {args.workdir}, {how}"
        )
    return 0


def summary(predictor: Any, out: dict[str, Any], args: argparse.Namespace) -> str:
    """The line ``predict`` prints: what was written, from which checkpoint, calibrated or not.

    Example:
      >>> predictor = me.load_predictor("runs/tiny")
      >>> out = predictor.outputs(images[:12])
      >>> args = argparse.Namespace(out="p.npz", workdir="runs/tiny", no_temperature=False)
      >>> summary(predictor, out, args)
      'wrote 12 predictions (probs, label, ...) to p.npz: checkpoint 4 of runs/tiny, ...'
    """
    cal = predictor.calibration
    if cal is None:
        how = "uncalibrated"
    else:
        t = "not applied" if args.no_temperature else "applied"
        how = f"temperature {cal.temperature:.4g} {t}"
        if "prediction_set" in out:
            how += f", {cal.method} sets at alpha={cal.alpha:g}"
    keys = ", ".join(out)
    return (
        f"wrote {len(out['label'])} predictions ({keys}) to {args.out}: checkpoint "
        f"{predictor.step} of {args.workdir}, {how}"
    )
