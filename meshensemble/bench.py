"""``meshensemble bench`` (being written)."""

from typing import Any


def add_parser(sub: Any) -> None:
    """Registers the ``bench`` subcommand."""
