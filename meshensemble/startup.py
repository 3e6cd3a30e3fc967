"""Ctrl-C while the ``meshensemble`` command starts, before its own handlers exist.

Importing JAX takes seconds. A Ctrl-C then raises ``KeyboardInterrupt`` wherever Python
happens to be, and when that is inside JAX's garbage-collection callback Python swallows
it: the command went on and trained to the end. So when this process is the
``meshensemble`` console script, the package's first import holds SIGINT (:func:`hold`:
a Ctrl-C is only recorded) until :func:`meshensemble.cli.main` takes it back
(:func:`release`): a Ctrl-C held by then ends the command with exit 130 and one line,
before anything is written. Importing ``meshensemble`` in your own program leaves
Python's handler alone.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

_held: list[int] = []


def _record(signum: int, frame: Any) -> None:
    _held.append(signum)


def is_console_script(argv0: str | None = None) -> bool:
    """Whether ``argv0`` (default ``sys.argv[0]``) is the ``meshensemble`` command.

    Example:
      >>> is_console_script("/usr/local/bin/meshensemble"), is_console_script("python")
      (True, False)
    """
    name = sys.argv[0] if argv0 is None and sys.argv else argv0 or ""
    return os.path.splitext(os.path.basename(name))[0] in ("meshensemble", "meshensemble-script")


def hold() -> None:
    """Records SIGINT instead of raising, when this is the console script's main thread and
    SIGINT still has Python's own handler (nothing else installed one).

    Example:
      >>> hold()  # in a test or a library import: does nothing
    """
    if (
        is_console_script()
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ):
        signal.signal(signal.SIGINT, _record)


def release() -> bool:
    """Gives SIGINT back to Python's handler; whether a Ctrl-C arrived while it was held.

    Returns:
      True when a SIGINT was recorded since :func:`hold` (then cleared).

    Example:
      >>> release()  # nothing was held
      False
    """
    if signal.getsignal(signal.SIGINT) is _record:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    came = bool(_held)
    _held.clear()
    return came


hold()
