"""``meshensemble convert``: any source's data as the files of ``--source arrayrecord``.

Writes :func:`meshensemble.data.write_array_record_dataset`'s files (``train.array_record``
or its shards, ``test.array_record``, ``labels.npz``, and a manifest holding the generic
record codec: the examples' shape and dtype) from any source ``train`` reads (an npz, an
image folder, a CSV, TFDS by name), once, on storage every host of a pod reads;
``meshensemble train --source arrayrecord --data-dir DIR --input stream`` then reads only
each batch's examples from them.

Example:
  >>> from meshensemble.cli import main
  >>> main(["convert", "--data-file", "mnist.npz", "--out", "mnist_ar"])
  data: MNIST from mnist.npz (96 train / 32 test): source npz
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
from meshensemble.cli.common import UsageError, add_field_flag
from meshensemble.data import lazy
from meshensemble.runtime import storage
from meshensemble.training.config import config_field, field_help

SOURCE_FIELDS = ("source", "dataset", "data_file", "data_dir", "test_file", "test_fraction",
                 "target_column", "targets", "seed")  # fmt: skip
"""The train flags ``convert`` takes to name its data (the same help and choices)."""

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
        help="write a dataset (any source) as ArrayRecord files for --source arrayrecord",
        description=(
            "Write a dataset from any source train reads (--source npz|folder|csv|tfds|...; "
            "default: the npz of --data-file) as ArrayRecord files, a labels.npz and a "
            "manifest in --out, for `train --source arrayrecord --data-dir OUT --input "
            "stream` (each host then reads only its rows of each batch)."
        ),
    )
    p.set_defaults(run=run)
    for name in SOURCE_FIELDS:
        field = config_field(name)
        default = "npz" if name == "source" else field.default
        add_field_flag(p, name, default=default, help=f"{field_help(field)} (as for train)")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write")
    p.add_argument(
        "--shards",
        type=int,
        default=1,
        metavar="N",
        help=f"train files (default: 1; at most one per {lazy.MIN_RECORDS_PER_SHARD} examples)",
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
      meshensemble.data.DataError: the source's one-line problems (exit 2), before
        anything is written.
    """
    if args.shards < 1:
        raise UsageError(f"--shards {args.shards}: pass 1 or more train files")
    out = storage.absolute(args.out)
    if storage.isdir(out) and storage.listdir(out) and not args.overwrite:
        raise UsageError(
            f"--out {args.out}: not empty; pass --overwrite to replace it, or another folder"
        )
    dataset = data.load_dataset(
        args.dataset, args.source, args.data_file, args.data_dir, log=print,
        test_file=args.test_file, test_fraction=args.test_fraction,
        target_column=args.target_column, targets=args.targets, seed=args.seed,
    )  # fmt: skip
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
