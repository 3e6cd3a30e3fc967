"""``meshensemble convert``: an npz dataset to the ArrayRecord files of ``--source arrayrecord``.

Writes :func:`meshensemble.data.write_array_record_dataset`'s files (``train.array_record``
or its shards, ``test.array_record``, ``labels.npz``) from a Keras-layout npz, once, on
storage every host of a pod reads; ``meshensemble train --source arrayrecord --data-dir DIR
--input stream`` then reads only each batch's examples from them.

Example:
  >>> from meshensemble.cli import main
  >>> main(["convert", "--data-file", "mnist.npz", "--out", "mnist_ar"])
  wrote MNIST from mnist.npz (96 train / 32 test) as 4 files in mnist_ar:
  ...
  0
  >>> storage.listdir("mnist_ar")
  ['labels.npz', 'manifest.json', 'test.array_record', 'train.array_record']
"""

from __future__ import annotations

import argparse
from typing import Any

from meshensemble import data
from meshensemble.cli.common import UsageError
from meshensemble.data import lazy
from meshensemble.runtime import storage

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Registers the ``convert`` subcommand on the CLI's subparsers.

    Args:
      sub: the ``argparse`` subparsers object of ``meshensemble``.

    Returns:
      The subcommand's parser.

    Example:
      >>> from meshensemble.cli import Parser
      >>> parser = Parser(prog="meshensemble")
      >>> add_parser(parser.add_subparsers()).prog
      'meshensemble convert'
      >>> parser.parse_args(["convert", "--data-file", "mnist.npz", "--out", "mnist_ar"]).out
      'mnist_ar'
    """
    p = sub.add_parser(
        "convert",
        help="write an npz dataset as ArrayRecord files for --source arrayrecord",
        description=(
            "Write a Keras-layout npz (x_train, y_train, x_test, y_test) as ArrayRecord "
            "files and a labels.npz in --out, for `train --source arrayrecord --data-dir "
            "OUT --input stream` (each host then reads only its rows of each batch)."
        ),
    )
    p.set_defaults(run=run)
    p.add_argument("--data-file", required=True, metavar="PATH", help="the npz to convert")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write")
    p.add_argument(
        "--shards",
        type=int,
        default=1,
        metavar="N",
        help=f"train files (default: 1; at most one per {lazy.MIN_RECORDS_PER_SHARD} examples)",
    )
    p.add_argument(
        "--dataset", default="mnist", choices=data.DATASETS, help="the dataset (default: mnist)"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty --out folder (once the new files are complete)",
    )
    return p


def run(args: argparse.Namespace) -> int:
    """Runs ``meshensemble convert`` from parsed arguments: prints the files written.

    Returns:
      0 when the files were written.

    Raises:
      UsageError: ``--shards`` below 1, or a non-empty ``--out`` without ``--overwrite``
        (exit 2), before anything is written.
      meshensemble.data.DataError: an unreadable or malformed npz (exit 2).
    """
    if args.shards < 1:
        raise UsageError(f"--shards {args.shards}: pass 1 or more train files")
    out = storage.absolute(args.out)
    if storage.isdir(out) and storage.listdir(out) and not args.overwrite:
        raise UsageError(
            f"--out {args.out}: not empty; pass --overwrite to replace it, or another folder"
        )
    dataset = data.load_npz(args.data_file, args.dataset)
    shards = lazy.shard_count(dataset.num_train, args.shards)
    if shards < args.shards:
        print(
            f"--shards {args.shards}: writing {shards} train file(s) instead, at least "
            f"{lazy.MIN_RECORDS_PER_SHARD} of the {dataset.num_train:,} examples each"
        )
    paths = data.write_array_record_dataset(
        args.out, dataset, shards=shards, overwrite=args.overwrite
    )
    print(f"wrote {dataset.note} as {len(paths)} files in {args.out}:")
    for path in paths:
        print(f"  {path}")
    return 0
