"""``meshensemble bench``: the flags of :class:`meshensemble.bench.BenchConfig`, and the run.

The flags are generated from the config's fields (a field with a ``help`` in its
metadata is a flag, ``batch_size`` -> ``--batch-size``), so they cannot drift from it;
``--fake-devices`` is the only flag of the command itself. A bad value comes back from
:func:`meshensemble.bench.resolve` as a ``ValueError`` and leaves as the CLI's one-line
usage error (exit 2) before anything runs or is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from meshensemble import bench
from meshensemble.cli.common import UsageError, add_fake_devices_flag, setup_devices
from meshensemble.runtime import storage

__all__ = ["FLAG_FIELDS", "add_parser", "run"]

FLAG_FIELDS = tuple(f.name for f in dataclasses.fields(bench.BenchConfig) if "help" in f.metadata)
"""The :class:`meshensemble.bench.BenchConfig` fields that are ``bench`` flags."""


def _flag_type(hint: Any) -> type:
    """The argparse type of a field's type hint (``int | None`` -> ``int``)."""
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint if hint in (int, float, str) else str  # tuples of names: a comma list


def add_parser(sub: Any) -> None:
    """Registers the ``bench`` subcommand, its flags made from ``BenchConfig``'s fields.

    Every flag defaults to None ("not given"), so that :func:`meshensemble.bench.resolve`
    can tell a given value from the (possibly ``--tiny``) default.

    Args:
      sub: the ``argparse`` subparsers of the ``meshensemble`` parser.

    Example:
      >>> from meshensemble.cli import Parser
      >>> parser = Parser(prog="meshensemble")
      >>> add_parser(parser.add_subparsers())
      >>> parser.parse_args(["bench", "--tiny"]).members  # None: not given
    """
    p = sub.add_parser(
        "bench",
        help="time ensemble training against the Flax HOWTO and a loop",
        description=(
            "Times the Flax HOWTO's pmap step, Ensemble.train_step on both backends, the "
            "training loop's on-device chunk, a sequential loop over members, member and "
            "mesh scaling and member strategies, in one process, round-robin, against "
            "float32 and bfloat16 matmuls (FLOPs counted analytically); and the time a "
            "fresh process takes to train to --target-accuracy, cold and warm "
            "compilation cache. Runs unchanged on a GPU (leave out --fake-devices). "
            "--suite accelerator measures every accelerator target into --out DIR "
            "(accelerator.json, accelerator.md)."
        ),
    )
    p.set_defaults(run=run)
    add_fake_devices_flag(p)
    hints = typing.get_type_hints(bench.BenchConfig)
    for field in dataclasses.fields(bench.BenchConfig):
        if field.name not in FLAG_FIELDS:
            continue
        meta = dict(field.metadata)
        flag = "--" + field.name.replace("_", "-")
        if hints[field.name] is bool:
            p.add_argument(flag, action="store_true", help=meta["help"])
        else:
            p.add_argument(flag, type=_flag_type(hints[field.name]), default=None, **meta)


def run(args: argparse.Namespace) -> int:
    """Runs ``meshensemble bench`` from parsed flags: table on stdout, JSON to ``--out``.

    With ``--suite accelerator`` ``--out`` is a folder: ``accelerator.json`` and
    ``accelerator.md`` (:func:`meshensemble.bench.write_suite`) go there, and the
    markdown table is printed too.

    Args:
      args: parsed ``bench`` arguments.

    Returns:
      0.

    Raises:
      UsageError: a bad flag value (before any device is set up or file written).

    Example:
      >>> from meshensemble.cli import build_parser
      >>> argv = ["bench", "--tiny", "--cases", "matmul", "--out", "b.json"]
      >>> run(build_parser().parse_args(argv))
      case ...
      0
    """
    given = {name: getattr(args, name) for name in FLAG_FIELDS if name != "tiny"}
    try:
        cfg = bench.resolve(tiny=bool(args.tiny), **given)
    except ValueError as err:
        raise UsageError(str(err)) from None
    setup_devices(args.fake_devices)
    results = bench.run_bench(cfg)
    print(bench.format_table(results))
    if cfg.suite:
        json_path, md_path = bench.write_suite(results, cfg.out)
        print(storage.read_text(md_path), end="")
        print(f"wrote {json_path} and {md_path}")
    else:
        bench.write_json(results, cfg.out)
        print(f"wrote {cfg.out}")
    if cfg.plot:
        if bench.plot_members(results, cfg.plot):
            print(f"wrote {cfg.plot}")
        else:
            print(f"--plot {cfg.plot}: no members-per-device cases were run; nothing plotted")
    return 0
