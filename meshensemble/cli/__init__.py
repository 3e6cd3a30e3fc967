"""The ``meshensemble`` command line: ``train``, ``evaluate``, ``bench`` and ``convert``.

Nothing in the package imports this room; it imports the others. Modules:
:mod:`~meshensemble.cli.common` (one-line errors, devices, processes),
:mod:`~meshensemble.cli.train`, :mod:`~meshensemble.cli.evaluate` and
:mod:`~meshensemble.cli.bench` and :mod:`~meshensemble.cli.convert` (npz to ArrayRecord
files), each with ``add_parser(sub)``.

Every bad value gets one line on stderr naming it and the fix, and exit code 2, before
anything is written to the workdir; a run that fails gets one line and exit code 1; Ctrl-C
gets one line and exit code 130 in every subcommand (``train`` first saves a checkpoint).
The exit code follows the exception's type (:mod:`meshensemble.errors`). Tracebacks
appear only with ``--debug`` or ``MESHENSEMBLE_DEBUG=1``.

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
import logging
import sys
import traceback
from collections.abc import Sequence

from meshensemble import startup
from meshensemble.cli import bench, convert, evaluate, export, predict, train
from meshensemble.cli.common import (
    Parser,
    PipeSafeStdout,
    UsageError,
    add_debug_flag,
    debug_requested,
    error_line,
    exit_code,
    hard_exit,
    leftovers_dropped,
    setup_devices,
    silence_absl_noise,
)
from meshensemble.runtime.distributed import StartupTimeoutError
from meshensemble.training.checkpoint import CheckpointError

__all__ = ["Parser", "UsageError", "build_parser", "main", "setup_devices"]


def build_parser() -> argparse.ArgumentParser:
    """The ``meshensemble`` argument parser, with every subcommand and ``--debug`` on each.

    Returns:
      An ``argparse.ArgumentParser``.

    Example:
      >>> build_parser().parse_args(["train", "--members", "4"]).members
      4
    """
    parser = Parser(prog="meshensemble", description="Deep ensembles on a JAX device mesh.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in (train, evaluate, bench, convert, predict, export):  # --help's order
        command.add_parser(sub)
    for p in sub.choices.values():
        add_debug_flag(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``meshensemble`` console script.

    Args:
      argv: arguments (default ``sys.argv[1:]``).

    Returns:
      The exit code: 0 on success, 2 for bad input, 1 for a run that failed, 130 when
      interrupted (Ctrl-C).

    Example:
      >>> main(["train", "--members", "0"])  # one line on stderr, nothing written
      2
    """
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    silence_absl_noise()
    if startup.release():  # a Ctrl-C while the command was still importing JAX
        print("error: interrupted (Ctrl-C) while starting; nothing was done", file=sys.stderr)
        return 130
    args = None
    stdout, sys.stdout = sys.stdout, PipeSafeStdout(sys.stdout)  # `train | head` trains on
    with leftovers_dropped():  # a failed save's stray reports: not on the command's stderr
        try:
            args = build_parser().parse_args(argv)
            return int(args.run(args) or 0)
        except (Exception, KeyboardInterrupt) as err:  # one place maps Ctrl-C: exit 130
            code = exit_code(err)
            if debug_requested(args):
                traceback.print_exc()
            if isinstance(err, CheckpointError | StartupTimeoutError):
                # orbax's background threads may still hold the failed write, the runtime
                # may still wait for its peers: leave without their teardown noise, the
                # one line being the last thing printed
                hard_exit(code, error_line(err))
            print(error_line(err), file=sys.stderr)
            return code
        finally:
            sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
