"""``meshensemble bench``: the command-line flags of :mod:`meshensemble.bench`."""

from meshensemble.bench import add_parser as add_parser

__all__ = ["add_parser"]
