"""The ``meshensemble`` command line: ``train``, ``evaluate`` and ``bench``.

Nothing in the package imports this room; it imports the others.
"""

from meshensemble.cli.app import UsageError as UsageError
from meshensemble.cli.app import main as main

__all__ = ["UsageError", "main"]
