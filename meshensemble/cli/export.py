"""``meshensemble export``: a trained run as a StableHLO artifact that runs with JAX alone.

Writes ``DIR/ensemble.jax`` (``jax.export``, parameters embedded, symbolic batch, lowered
for cpu, cuda and tpu) and ``DIR/export.json`` with
:func:`meshensemble.serving.export_ensemble`.

Example:
  >>> from meshensemble.cli import main
  >>> main(["export", "--workdir", "runs/tiny", "--out", "exported", "--platforms", "cpu"])
  wrote ensemble.jax and export.json to exported: 4 members, 10 classes, checkpoint 4, ...
  0
  >>> storage.listdir("exported")
  ['ensemble.jax', 'export.json']
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from meshensemble.cli.common import (
    UsageError,
    add_checkpoint_flag,
    add_debug_flag,
    add_fake_devices_flag,
    add_field_flag,
    resolve_checkpoint,
    setup_devices,
)
from meshensemble.runtime import storage
from meshensemble.serving.export import ARTIFACT_FILE, METADATA_FILE, PLATFORMS, export_ensemble
from meshensemble.serving.predictor import load_predictor
from meshensemble.training.outputs import check_writable, note_output


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Registers the ``export`` subcommand on the CLI's subparsers.

    Args:
      sub: the ``argparse`` subparsers object of ``meshensemble``.

    Returns:
      The subcommand's parser.

    Example:
      >>> from meshensemble.cli import Parser
      >>> parser = Parser(prog="meshensemble")
      >>> add_parser(parser.add_subparsers()).prog
      'meshensemble export'
      >>> parser.parse_args(["export", "--workdir", "runs/tiny", "--out", "exported"]).out
      'exported'
    """
    p = sub.add_parser(
        "export",
        help="export a trained run as a jax.export artifact (JAX alone runs it)",
        description=(
            f"Export a trained run: DIR/{ARTIFACT_FILE} (jax.export.Exported.serialize() of "
            "the ensemble's prediction as the run's task exports it, parameters embedded, "
            f"raw inputs in, symbolic batch) and DIR/{METADATA_FILE} (input, the task's "
            "outputs and calibration, preprocessing, data identity, versions)."
        ),
    )
    p.set_defaults(run=run)
    add = p.add_argument
    add_field_flag(p, "workdir", required=True, help="the trained run's folder (read only)")
    add("--out", required=True, metavar="DIR", help="the export folder (created if missing)")
    add_checkpoint_flag(p)
    add(
        "--platforms",
        default=",".join(PLATFORMS),
        help=f"lowering platforms, comma-separated (default: {','.join(PLATFORMS)}; tpu is "
        "dropped where this JAX cannot lower for it)",
    )
    add_fake_devices_flag(p)
    add("--quiet", action="store_true", help="no summary line")
    add_debug_flag(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Runs ``meshensemble export`` from parsed arguments.

    Returns:
      0 on success.

    Raises:
      FileNotFoundError, ValueError: bad input (exit 2), before anything is written.
      meshensemble.CheckpointError: no readable checkpoint (exit 1).
    """
    setup_devices(args.fake_devices)
    platforms = [p.strip() for p in args.platforms.split(",") if p.strip()]
    bad = [p for p in platforms if p not in PLATFORMS]
    if bad or not platforms:
        raise UsageError(
            f"--platforms {args.platforms}: choose from {', '.join(PLATFORMS)}, comma-separated"
        )
    if storage.isfile(args.out):
        raise UsageError(f"--out {args.out} is a file; give a folder")
    check_writable(args.out, "give a writable --out folder", name="--out")
    notes: list[str] = []  # a damaged checkpoint skipped: said once the restore succeeded
    step = resolve_checkpoint(args.workdir, args.checkpoint)
    predictor = load_predictor(args.workdir, checkpoint=step, echo=notes.append)
    for line in notes:
        print(line, file=sys.stderr)
    meta = export_ensemble(predictor, args.out, platforms)
    note_output(args.workdir, storage.join(args.out, ARTIFACT_FILE))  # a folder inside the run's
    note_output(args.workdir, storage.join(args.out, METADATA_FILE))
    if args.quiet:
        return 0
    cal = predictor.calibration
    how = "uncalibrated" if cal is None else predictor.task.calibration_summary(cal, True, {})
    width = f", {meta['classes']} classes" if meta.get("classes") else ""
    width += f", {meta['targets']} targets" if meta.get("targets") else ""
    print(
        f"wrote {ARTIFACT_FILE} and {METADATA_FILE} to {args.out}: {meta['members']} members"
        f"{width}, checkpoint {meta['checkpoint_step']}, {how}, for {', '.join(meta['platforms'])}"
    )
    return 0
